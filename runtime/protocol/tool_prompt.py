"""Tools in the prompt: which tools a chat request puts in play, and the conversation as the chat template gets it.

A chat template that renders ``tools`` itself gets them (as transformers gives them). Otherwise (the demo model
and Gemma 3 have none) one generic prompt describes them, prepended to the system message::

    You can call these functions. To call one, answer with
    <tool_call>{"name": "<function name>", "arguments": {<its arguments>}}</tool_call>
    (one block per call). [tool_choice: "You must call ..."] Otherwise answer the user directly.
    Functions:
    {"name": ..., "description": ..., "parameters": {...}}

An assistant turn's earlier calls are written back in the same form, and tool results as user turns
``<tool_response>{"tool_call_id": ..., "content": ...}</tool_response>`` (consecutive ones merged, so that
templates requiring turns to alternate accept them). The ``<tool_call>`` markup (``OPEN``, ``CLOSE``) is what a
forced call's grammar writes and what the server reads calls back from (``kvdrive.runtime.server.tool_parsing``).
"""

from __future__ import annotations

import json
from typing import Any

from kvdrive.runtime.prompt import ChatMessage
from kvdrive.runtime.protocol import request_schemas as r
from kvdrive.runtime.protocol.output_schemas import NamedToolChoice, ToolCall, ToolDef

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def active(body: r.ChatCompletionRequest) -> bool:
    """Whether the request's tools are in play (given, and tool_choice is not "none")."""
    return bool(body.tools) and body.tool_choice != "none"


def forced(body: r.ChatCompletionRequest) -> str | None:
    """The function a named tool_choice forces, "*" for required, None when the model decides."""
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        return choice.function.name
    return "*" if choice == "required" else None


def _describe(tool: ToolDef) -> str:
    f = tool.function
    return json.dumps({"name": f.name, "description": f.description or "", "parameters": f.parameters})


def _preamble(body: r.ChatCompletionRequest) -> str:
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


def messages(body: r.ChatCompletionRequest, template_has_tools: bool) -> tuple[list[ChatMessage], list[dict[str, Any]] | None]:
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
