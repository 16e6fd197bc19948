"""A request's outputs (its ``n`` choices, ``fanout.py``) as an HTTP answer: collected into one body, or
streamed as server-sent events.

A stream answers at once: the engine accepts the request (a full queue or a prompt too long is still a plain
HTTP error, before any header), then the response headers go out and, while the prompt is being computed
(or a step stalls), an SSE comment line (``: keep-alive``) every ``keepalive_s`` seconds tells clients and
proxies the connection is alive. Comment lines are part of SSE: every client skips them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from kvdrive.runtime.engine import RequestOutput
from kvdrive.runtime.engine.sampling import TokenLogprob
from kvdrive.runtime.server import response_schemas as s
from kvdrive.runtime.server.errors import ApiError
from kvdrive.runtime.server.fanout import Fanout
from kvdrive.runtime.server.logprobs import LogprobRenderer
from kvdrive.runtime.server.response_schemas import DeltaToolCall
from kvdrive.runtime.server.tool_parsing import ToolStream

KEEPALIVE = ": keep-alive\n\n"


def finish_reason(reason: str | None) -> str | None:
    return "stop" if reason in ("stop", "abort") else reason


@dataclass(frozen=True)
class Choice:
    """One whole choice: its text, why it ended, its tokens' log-probabilities when asked for."""

    text: str
    finish_reason: str | None
    logprobs: s.ChatLogprobs | s.CompletionLogprobs | None


@dataclass(frozen=True)
class Collected:
    choices: list[Choice]
    usage: s.Usage  # the prompt counted once, every choice's tokens


def _usage(seen: dict[int, RequestOutput], per_prompt: int) -> s.Usage:
    """Each prompt once (as its sample 0 saw it: computed, or reused from stored pages), every choice's
    tokens."""
    prompts: dict[int, RequestOutput] = {}
    for c in sorted(seen):
        prompts.setdefault(c // per_prompt, seen[c])
    return s.Usage.of(sum(o.prompt_tokens for o in prompts.values()),
                      sum(o.completion_tokens for o in seen.values()),
                      sum(o.cached_tokens for o in prompts.values()))


Render = Callable[[int], LogprobRenderer]  # choice index -> its renderer, when log-probabilities were asked for


async def collect(outputs: Fanout, render: Render | None = None) -> Collected:
    """Every choice whole (an echoed prompt's log-probabilities first, when it came with them)."""
    parts: dict[int, list[str]] = {i: [] for i in range(outputs.n)}
    lps: dict[int, list[TokenLogprob]] = {i: [] for i in range(outputs.n)}
    prompt_lps: dict[int, tuple[TokenLogprob, ...]] = {}
    reasons: dict[int, str | None] = {}
    seen: dict[int, RequestOutput] = {}
    async for i, out in outputs:
        parts[i].append(out.text_delta)
        lps[i] += out.logprobs
        if out.prompt_logprobs is not None:
            prompt_lps[i] = out.prompt_logprobs
        seen[i] = out
        if out.finished:
            reasons[i] = finish_reason(out.finish_reason)
    n = outputs.per_prompt  # a prompt's other samples echo its sample 0's prompt log-probabilities
    choices = [Choice("".join(parts[i]), reasons.get(i),
                      render(i).body(tuple(lps[i]), prompt_lps.get(i - i % n)) if render is not None else None)
               for i in range(outputs.n)]
    return Collected(choices, _usage(seen, outputs.per_prompt))


async def stream(rid: str, outputs: Fanout, chat: bool, model: str, include_usage: bool,
                 prefix: Callable[[int], str] | None = None, keepalive_s: float = 5.0,
                 render: Render | None = None, tool_stream: Callable[[], ToolStream] | None = None,
                 continuous_usage: bool = False) -> StreamingResponse:
    """Wait until the engine accepted the request (its first output: errors before that are HTTP errors),
    then answer with SSE: each choice's chunks carry its index (and its tokens' log-probabilities when
    ``render`` is given). ``prefix``: a completion's echoed prompt per choice; sent at once, or with the first
    token when the prompt's log-probabilities come with it. ``tool_stream``: a chat answer's text is read for
    tool calls (``tool_parsing.py``), sent as call deltas; such an answer ends with finish_reason "tool_calls".
    ``continuous_usage`` (vLLM's ``continuous_usage_stats``, with ``include_usage``): every chunk after the
    engine's first output carries the usage so far, as vLLM's do (load generators count tokens by it)."""
    it = outputs.__aiter__()
    first = await anext(it, None)
    renders = {i: render(i) for i in range(outputs.n)} if render is not None else {}
    echo_lps = prefix is not None and render is not None  # the echo waits for its log-probabilities

    parsers = {i: tool_stream() for i in range(outputs.n)} if tool_stream is not None else {}
    seen: dict[int, RequestOutput] = {}

    def chunk(index: int, text: str | None, reason: str | None, role: bool = False,
              lps: tuple[TokenLogprob, ...] = (), prompt: tuple[TokenLogprob, ...] | None = None,
              calls: list[DeltaToolCall] | None = None) -> str:
        body: dict[str, Any]
        r = renders.get(index)
        if chat:
            delta = s.ChatDelta(content=text or None, tool_calls=calls or None) if not role else s.ChatDelta(content="")
            logprobs = r.chat_body(lps) if r is not None and lps else None
            body = s.ChatCompletionChunk(id=rid, model=model, choices=[s.ChatDeltaChoice(
                index=index, delta=delta, finish_reason=reason, logprobs=logprobs)]).model_dump(exclude_none=False)
        else:
            cl = r.completion_body(lps, prompt) if r is not None and (lps or prompt is not None) else None
            body = s.CompletionResponse(id=rid, model=model, choices=[s.CompletionChoice(
                index=index, text=text or "", finish_reason=reason, logprobs=cl)]).model_dump(exclude={"usage"})
        if continuous_usage and include_usage and seen:
            body["usage"] = _usage(seen, outputs.per_prompt).model_dump()
        return f"data: {json.dumps(body)}\n\n"

    async def events() -> AsyncIterator[str]:
        prompts: dict[int, tuple[TokenLogprob, ...]] = {}  # prompt -> its log-probabilities (echo)
        echoed: set[int] = set()
        for i in range(outputs.n):
            if chat:
                yield chunk(i, None, None, role=True)
            elif prefix is not None and not echo_lps:
                yield chunk(i, prefix(i), None)
        item = first
        pending: asyncio.Future[tuple[int, RequestOutput] | None] | None = None
        try:
            while item is not None:
                i, out = item
                seen[i] = out
                reason = finish_reason(out.finish_reason) if out.finished else None
                if out.prompt_logprobs is not None:  # a prompt's sample 0: its other samples echo the same
                    prompts[i // outputs.per_prompt] = out.prompt_logprobs
                if echo_lps and i not in echoed and i // outputs.per_prompt in prompts:
                    assert prefix is not None
                    echoed.add(i)
                    yield chunk(i, prefix(i) + out.text_delta, reason, lps=out.logprobs,
                                prompt=prompts[i // outputs.per_prompt])
                elif i in parsers:
                    text, calls = parsers[i].feed(out.text_delta)
                    if reason:
                        text += parsers[i].finish()
                        reason = "tool_calls" if parsers[i].calls and reason == "stop" else reason
                    if text or calls or reason or (i in renders and out.logprobs):
                        yield chunk(i, text, reason, lps=out.logprobs, calls=calls)
                elif out.text_delta or reason or (i in renders and out.logprobs):
                    yield chunk(i, out.text_delta, reason, lps=out.logprobs)
                # the next output, read in a task of its own so that a keep-alive line goes out each time none
                # came for keepalive_s (waiting with a timeout on the read itself would cancel it: an abort)
                pending = asyncio.ensure_future(anext(it, None))
                while not (await asyncio.wait({pending}, timeout=keepalive_s))[0]:
                    yield KEEPALIVE
                item, pending = pending.result(), None
        except ApiError as exc:
            yield f"data: {json.dumps({'error': {'message': exc.message, 'type': exc.kind, 'code': exc.status}})}\n\n"
        finally:
            if pending is not None:  # the client left while a read was pending: cancelling it aborts the request
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending
            await outputs.aclose()  # client gone: aborts every choice still running
        if include_usage and seen:
            body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "model": model,
                    "created": int(time.time()), "choices": [], "usage": _usage(seen, outputs.per_prompt).model_dump()}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
