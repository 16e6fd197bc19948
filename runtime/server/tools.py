"""Tool calling: the tools in the prompt, the grammar of a forced call, and the calls read back from the text.

**The prompt.** A chat template that renders ``tools`` itself gets them (as transformers gives them). Otherwise
(the demo model and Gemma 3 have none) one generic prompt describes them, prepended to the system message::

    You can call these functions. To call one, answer with
    <tool_call>{"name": "<function name>", "arguments": {<its arguments>}}</tool_call>
    (one block per call). [tool_choice: "You must call ..."] Otherwise answer the user directly.
    Functions:
    {"name": ..., "description": ..., "parameters": {...}}

An assistant turn's earlier calls are written back in the same form, and tool results as user turns
``<tool_response>{"tool_call_id": ..., "content": ...}</tool_response>`` (consecutive ones merged, so that
templates requiring turns to alternate accept them).

**Forced calls.** With ``tool_choice: required`` or a named function the answer is grammar-constrained
(``structured.py:tool_grammar``, a Lark grammar with each function's JSON schema): one call, or several when
``parallel_tool_calls``, at most MAX_CALLS); it always parses, and its arguments follow their schema. A call
repeated with the same arguments in one answer is answered once. With ``auto`` the model
decides: a text holding well-formed ``<tool_call>`` blocks naming known functions is answered as calls; a text
that does not parse is answered as text, never as an error.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvdrive.runtime.prompt import ChatMessage
from kvdrive.runtime.server import schemas as s
from kvdrive.runtime.server.output_schemas import (
    CallFunction,
    DeltaFunction,
    DeltaToolCall,
    ToolCall,
    ToolDef,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALLS = 8  # calls in one forced answer with parallel_tool_calls (a small model may repeat a call without end)


def active(body: s.ChatCompletionRequest) -> bool:
    """Whether the request's tools are in play (given, and tool_choice is not "none")."""
    return bool(body.tools) and body.tool_choice != "none"


def forced(body: s.ChatCompletionRequest) -> str | None:
    """The function a named tool_choice forces, "*" for required, None when the model decides."""
    choice = body.tool_choice
    if isinstance(choice, s.NamedToolChoice):
        return choice.function.name
    return "*" if choice == "required" else None


def _describe(tool: ToolDef) -> str:
    f = tool.function
    return json.dumps({"name": f.name, "description": f.description or "", "parameters": f.parameters})


def _preamble(body: s.ChatCompletionRequest) -> str:
    must = forced(body)
    rule = ("You must call at least one of them." if must == "*" else
            f"You must call the function {must}." if must else "Otherwise answer the user directly.")
    return (f"You can call these functions. To call one, answer with\n{OPEN}"
            '{"name": "<function name>", "arguments": {<its arguments>}}'
            f"{CLOSE}\n(one block per call). {rule}\nFunctions:\n" + "\n".join(_describe(t) for t in body.tools or []))


def _call_text(call: ToolCall) -> str:
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    return OPEN + json.dumps({"name": call.function.name, "arguments": arguments}) + CLOSE


def messages(body: s.ChatCompletionRequest, template_has_tools: bool) -> tuple[list[ChatMessage], list[dict[str, Any]] | None]:
    """The conversation as the chat template gets it, and the tools it renders itself (None: described in
    the generic prompt, or no tools in play). Earlier calls and tool results are written in the generic form
    for a template without tools even when no tools are in play now (``tool_choice: none``)."""
    tool_turns = any(m.role == "tool" or m.tool_calls for m in body.messages)
    if template_has_tools or not (active(body) or tool_turns):
        tools = [t.model_dump() for t in body.tools or []] if active(body) else None
        return [ChatMessage(m.role, m.text(), tuple(c.model_dump() for c in m.tool_calls or ()), m.tool_call_id)
                for m in body.messages], tools
    out: list[ChatMessage] = []
    for m in body.messages:
        role, text = m.role, m.text()
        if m.role == "assistant" and m.tool_calls:
            text = "\n".join([text, *(_call_text(c) for c in m.tool_calls)]).strip()
        elif m.role == "tool":
            role = "user"
            text = "<tool_response>" + json.dumps({"tool_call_id": m.tool_call_id, "content": text}) + "</tool_response>"
        if m.role == "tool" and out and out[-1].role == "user":  # templates requiring alternating turns accept it
            out[-1] = ChatMessage(role, out[-1].content + "\n" + text)
        else:
            out.append(ChatMessage(role, text))
    if not active(body):
        return out, None
    if out and out[0].role in ("system", "developer"):
        out[0] = ChatMessage(out[0].role, _preamble(body) + "\n\n" + out[0].content)
    else:
        out.insert(0, ChatMessage("system", _preamble(body)))
    return out, None


def _parse_block(raw: str, names: set[str]) -> ToolCall | None:
    """A block's call, or None when it is not a call of a known function (whatever the model wrote: deep
    nesting, a name that is not a string)."""
    try:
        call = json.loads(raw)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or call["name"] not in names:
            return None
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # a model may write the arguments as a JSON text already
            arguments = json.loads(arguments)
    except (ValueError, RecursionError):
        return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=CallFunction(name=call["name"],
                                                                             arguments=json.dumps(arguments)))


def parse(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(the content outside the calls, or None when only calls; the calls), as ``ToolStream`` sends them: a
    block that is not a call of a known function stays in the content as written. One pass over the text."""
    stream = ToolStream(names)
    content, deltas = stream.feed(text)
    content += stream.finish()
    calls = [ToolCall(id=d.id or "", function=CallFunction(name=d.function.name or "", arguments=args.function.arguments
                                                           or ""))
             for d, args in zip(deltas[::2], deltas[1::2], strict=True)]
    if not calls:
        return text, []
    return content.strip() or None, calls


@dataclass
class ToolStream:
    """A streamed answer's text turned into content deltas and call deltas. Text that may start a block is
    held back until it is known; a whole block is sent as two deltas (the call's id and name, then its
    arguments), as OpenAI sends them. A block that does not parse is sent as the content it was."""

    names: set[str]
    calls: int = 0
    _held: str = ""
    _sent: set[tuple[str, str]] = field(default_factory=set)
    _blank: str = ""

    def feed(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        """(content to send now, call deltas to send now) for the next piece of the answer's text. Whitespace
        alone is held until text follows it (the separators between calls are not content)."""
        content, deltas = self._feed(text)
        if not content.strip():
            self._blank += content
            return "", deltas
        content, self._blank = self._blank + content, ""
        return content, deltas

    def _feed(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        self._held += text
        content, deltas = "", []
        while True:
            start = self._held.find(OPEN)
            if start < 0:
                keep = max((k for k in range(1, len(OPEN)) if self._held.endswith(OPEN[:k])), default=0)
                cut = len(self._held) - keep
                content += self._held[:cut]
                self._held = self._held[cut:]
                return content, deltas
            end = self._held.find(CLOSE, start)
            if end < 0:
                content += self._held[:start]
                self._held = self._held[start:]
                return content, deltas
            raw = self._held[start + len(OPEN) : end]
            call = _parse_block(raw, self.names)
            if call is None:
                content += self._held[: end + len(CLOSE)]
            else:
                content += self._held[:start]
                key = (call.function.name, call.function.arguments)
                if key not in self._sent:  # a repeated call is answered once
                    self._sent.add(key)
                    deltas += self._deltas(call)
            self._held = self._held[end + len(CLOSE) :]

    def _deltas(self, call: ToolCall) -> list[DeltaToolCall]:
        i, self.calls = self.calls, self.calls + 1
        return [DeltaToolCall(index=i, id=call.id, type="function", function=DeltaFunction(name=call.function.name,
                                                                                          arguments="")),
                DeltaToolCall(index=i, function=DeltaFunction(arguments=call.function.arguments))]

    def finish(self) -> str:
        """The text still held (an unfinished block): content."""
        held, self._held = self._held, ""
        if not held.strip():
            return ""
        blank, self._blank = self._blank, ""
        return blank + held
