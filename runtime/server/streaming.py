"""A request's outputs as an HTTP answer: collected into one body, or streamed as server-sent events.

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
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from kvdrive.runtime.engine import RequestOutput
from kvdrive.runtime.engine.sampling import TokenLogprob
from kvdrive.runtime.server import schemas as s
from kvdrive.runtime.server.errors import ApiError
from kvdrive.runtime.server.logprobs import LogprobRenderer

KEEPALIVE = ": keep-alive\n\n"


def finish_reason(reason: str | None) -> str | None:
    return "stop" if reason in ("stop", "abort") else reason


@dataclass(frozen=True)
class Collected:
    """A whole answer: its text, why it ended, its usage, its tokens' log-probabilities when asked for."""

    text: str
    finish_reason: str | None
    usage: s.Usage
    logprobs: s.ChatLogprobs | s.CompletionLogprobs | None


async def collect(outputs: AsyncIterator[RequestOutput], render: LogprobRenderer | None = None) -> Collected:
    parts, reason, prompt, completion, cached = [], None, 0, 0, 0
    lps: list[TokenLogprob] = []
    async for out in outputs:
        parts.append(out.text_delta)
        lps += out.logprobs
        prompt, completion = out.prompt_tokens, out.completion_tokens
        cached = out.cached_tokens
        if out.finished:
            reason = finish_reason(out.finish_reason)
    return Collected("".join(parts), reason, s.Usage.of(prompt, completion, cached),
                     render.body(tuple(lps)) if render is not None else None)


async def stream(rid: str, outputs: AsyncIterator[RequestOutput], chat: bool, model: str, include_usage: bool,
                 prefix: str = "", keepalive_s: float = 5.0, render: LogprobRenderer | None = None) -> StreamingResponse:
    """Wait until the engine accepted the request (its first output: errors before that are HTTP errors),
    then answer with SSE (each chunk with its tokens' log-probabilities when ``render`` is given)."""
    it = outputs.__aiter__()
    first = await anext(it, None)

    def chunk(text: str | None, reason: str | None, role: bool = False,
              lps: tuple[TokenLogprob, ...] = ()) -> str:
        body: dict[str, Any]
        if chat:
            delta = s.ChatMessageOut(content=text) if not role else s.ChatMessageOut(content="")
            logprobs = render.chat_body(lps) if render is not None and lps else None
            body = s.ChatCompletionChunk(id=rid, model=model, choices=[
                s.ChatDeltaChoice(delta=delta, finish_reason=reason, logprobs=logprobs)]).model_dump(exclude_none=False)
        else:
            cl = render.completion_body(lps) if render is not None and lps else None
            body = s.CompletionResponse(id=rid, model=model, choices=[
                s.CompletionChoice(text=text or "", finish_reason=reason, logprobs=cl)]).model_dump(exclude={"usage"})
        return f"data: {json.dumps(body)}\n\n"

    async def events() -> AsyncIterator[str]:
        usage = None
        if chat:
            yield chunk(None, None, role=True)
        elif prefix:
            yield chunk(prefix, None)
        out = first
        pending: asyncio.Future[RequestOutput | None] | None = None
        try:
            while out is not None:
                usage = (out.prompt_tokens, out.completion_tokens, out.cached_tokens)
                reason = finish_reason(out.finish_reason) if out.finished else None
                if out.text_delta or reason or (render is not None and out.logprobs):
                    yield chunk(out.text_delta, reason, lps=out.logprobs)
                if out.finished:
                    break
                # the next output, read in a task of its own so that a keep-alive line goes out each time none
                # came for keepalive_s (waiting with a timeout on the read itself would cancel it: an abort)
                pending = asyncio.ensure_future(anext(it, None))
                while not (await asyncio.wait({pending}, timeout=keepalive_s))[0]:
                    yield KEEPALIVE
                out, pending = pending.result(), None
        except ApiError as exc:
            yield f"data: {json.dumps({'error': {'message': exc.message, 'type': exc.kind, 'code': exc.status}})}\n\n"
        finally:
            if pending is not None:  # the client left while a read was pending: cancelling it aborts the request
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending
            await outputs.aclose()  # type: ignore[attr-defined]  # client gone: aborts the request
        if include_usage and usage is not None:
            u = s.Usage.of(*usage)
            body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "model": model,
                    "created": int(time.time()), "choices": [], "usage": u.model_dump()}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
