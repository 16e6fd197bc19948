"""Tool calls read back from an answer's text: whole (``parse``) or as it streams (``ToolStream``).

With ``tool_choice: required`` or a named function the answer is grammar-constrained (``structured.py:tool_grammar``):
it always parses, and its arguments follow their schema. A call repeated with the same arguments in one answer is
answered once. With ``auto`` the model decides: a text holding well-formed ``<tool_call>`` blocks
(``kvdrive.runtime.protocol.tool_prompt``) naming known functions is answered as calls; a text that does not parse
is answered as text, never as an error.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from kvdrive.runtime.protocol.output_schemas import CallFunction, ToolCall
from kvdrive.runtime.protocol.tool_prompt import CLOSE, OPEN
from kvdrive.runtime.server.response_schemas import DeltaFunction, DeltaToolCall


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
