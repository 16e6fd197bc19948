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
from kvdrive.runtime.server import schemas as s
from kvdrive.runtime.server.errors import ApiError
from kvdrive.runtime.server.fanout import Fanout
from kvdrive.runtime.server.logprobs import LogprobRenderer

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


def _usage(seen: dict[int, RequestOutput]) -> s.Usage:
    """The prompt once (as sample 0 saw it: computed, or reused from stored pages), every choice's tokens."""
    first = seen.get(0) or next(iter(seen.values()))
    return s.Usage.of(first.prompt_tokens, sum(o.completion_tokens for o in seen.values()), first.cached_tokens)


async def collect(outputs: Fanout, render: Callable[[], LogprobRenderer] | None = None) -> Collected:
    """Every choice whole. ``render``: a renderer per choice, when log-probabilities were asked for."""
    parts: dict[int, list[str]] = {i: [] for i in range(outputs.n)}
    lps: dict[int, list[TokenLogprob]] = {i: [] for i in range(outputs.n)}
    reasons: dict[int, str | None] = {}
    seen: dict[int, RequestOutput] = {}
    async for i, out in outputs:
        parts[i].append(out.text_delta)
        lps[i] += out.logprobs
        seen[i] = out
        if out.finished:
            reasons[i] = finish_reason(out.finish_reason)
    choices = [Choice("".join(parts[i]), reasons.get(i), render().body(tuple(lps[i])) if render is not None else None)
               for i in range(outputs.n)]
    return Collected(choices, _usage(seen))


async def stream(rid: str, outputs: Fanout, chat: bool, model: str, include_usage: bool, prefix: str = "",
                 keepalive_s: float = 5.0, render: Callable[[], LogprobRenderer] | None = None) -> StreamingResponse:
    """Wait until the engine accepted the request (its first output: errors before that are HTTP errors),
    then answer with SSE: each choice's chunks carry its index (and its tokens' log-probabilities when
    ``render`` is given)."""
    it = outputs.__aiter__()
    first = await anext(it, None)
    renders = {i: render() for i in range(outputs.n)} if render is not None else {}

    def chunk(index: int, text: str | None, reason: str | None, role: bool = False,
              lps: tuple[TokenLogprob, ...] = ()) -> str:
        body: dict[str, Any]
        r = renders.get(index)
        if chat:
            delta = s.ChatMessageOut(content=text) if not role else s.ChatMessageOut(content="")
            logprobs = r.chat_body(lps) if r is not None and lps else None
            body = s.ChatCompletionChunk(id=rid, model=model, choices=[s.ChatDeltaChoice(
                index=index, delta=delta, finish_reason=reason, logprobs=logprobs)]).model_dump(exclude_none=False)
        else:
            cl = r.completion_body(lps) if r is not None and lps else None
            body = s.CompletionResponse(id=rid, model=model, choices=[s.CompletionChoice(
                index=index, text=text or "", finish_reason=reason, logprobs=cl)]).model_dump(exclude={"usage"})
        return f"data: {json.dumps(body)}\n\n"

    async def events() -> AsyncIterator[str]:
        seen: dict[int, RequestOutput] = {}
        for i in range(outputs.n):
            if chat:
                yield chunk(i, None, None, role=True)
            elif prefix:
                yield chunk(i, prefix, None)
        item = first
        pending: asyncio.Future[tuple[int, RequestOutput] | None] | None = None
        try:
            while item is not None:
                i, out = item
                seen[i] = out
                reason = finish_reason(out.finish_reason) if out.finished else None
                if out.text_delta or reason or (i in renders and out.logprobs):
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
                    "created": int(time.time()), "choices": [], "usage": _usage(seen).model_dump()}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
