"""Reading tool calls out of a model's text, whole and streamed, on hostile output: the two agree, a block
that is not a call of a known function stays text, nothing raises, and the work is linear in the text."""

from __future__ import annotations

import json
import time

import pytest

from kvdrive.runtime.server.tool_parsing import ToolStream, parse

NAMES = {"get_weather"}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def _streamed(text: str, piece: int) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) as a client assembles a stream fed ``piece`` characters at a time."""
    stream, content, calls = ToolStream(NAMES), "", []
    for i in range(0, len(text), piece):
        chunk, deltas = stream.feed(text[i : i + piece])
        content += chunk
        for d in deltas:
            if d.id:
                calls.append([d.function.name or "", ""])
            else:
                calls[-1][1] += d.function.arguments or ""
    content += stream.finish()
    return content, [(n, a) for n, a in calls]


@pytest.mark.parametrize("text", [
    CALL,
    "Let me check. " + CALL,
    CALL + "\n" + CALL,  # a repeated call is answered once
    'a <tool_call>{"name": ["x"]}</tool_call> b ' + CALL,  # a name that is not a string stays text
    "<tool_call>" + "[" * 3000 + "</tool_call>",  # nesting deeper than the JSON parser's recursion
    '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
    "no calls at all, ünïcödé ✓",
    "<tool_call>" + CALL,  # an opening tag inside another block
    CALL[:-3],  # cut before the block ends
])
@pytest.mark.parametrize("piece", [1, 7, 10_000])
def test_whole_and_streamed_answers_agree(text: str, piece: int) -> None:
    content, calls = parse(text, NAMES)
    streamed_content, streamed_calls = _streamed(text, piece)
    assert [(c.function.name, c.function.arguments) for c in calls] == streamed_calls
    assert (content or "").strip() == streamed_content.strip()
    for _, arguments in streamed_calls:
        assert json.loads(arguments) == {"city": "Paris"}
    if text in (CALL, CALL + "\n" + CALL):
        assert content is None and len(calls) == 1


def test_an_unclosed_flood_is_linear() -> None:
    t0 = time.perf_counter()
    content, calls = parse("<tool_call>" * 20_000, NAMES)
    assert calls == [] and content == "<tool_call>" * 20_000
    assert time.perf_counter() - t0 < 1.0  # quadratic scanning took 20 s
