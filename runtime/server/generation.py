"""A request's choices run on the engine: one engine request per choice (``fanout.py``: each prompt computed
once), its token latencies observed, the engine's refusals as HTTP errors (429 with Retry-After when the queue
is full, 400 for a prompt too long, 503 when a request fails in the engine)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kvdrive.runtime.engine import PromptTooLongError, QueueFullError, RequestOutput, SamplingParams
from kvdrive.runtime.engine import Request as EngineRequest
from kvdrive.runtime.server.errors import ApiError
from kvdrive.runtime.server.fanout import Fanout
from kvdrive.runtime.server.openai_params import sample_params


@dataclass(frozen=True)
class Generation:
    generate: Callable[[EngineRequest], AsyncIterator[RequestOutput]]  # the engine's (``AsyncEngine.generate``)
    ttft: Callable[[float], None]  # observes seconds from a request's arrival to its first token
    itl: Callable[[float], None]  # observes seconds between its consecutive tokens
    retry_after_seconds: int  # what a 429 tells the client to wait

    async def run(self, prompt_ids: list[int], params: SamplingParams,
                  salt: str | None) -> AsyncIterator[RequestOutput]:
        """One engine request's outputs, as they come."""
        request = EngineRequest(uuid.uuid4().hex, tuple(prompt_ids), params, time.perf_counter(), cache_salt=salt)
        arrived, last = request.arrival, None
        try:
            async for out in self.generate(request):
                now = time.perf_counter()
                if out.new_token_ids:
                    if last is None:
                        self.ttft(now - arrived)
                    else:
                        self.itl(now - last)
                    last = now
                if out.error:
                    raise ApiError(503, out.error, "server_error")
                yield out
        except QueueFullError as exc:
            raise ApiError(429, f"server busy: {exc}; retry later", "rate_limit_error",
                           headers={"Retry-After": str(self.retry_after_seconds)}) from exc
        except PromptTooLongError as exc:
            raise ApiError(400, str(exc), param="prompt") from exc

    def samples(self, prompts: list[list[int]], params: list[SamplingParams], salt: str | None, n: int) -> Fanout:
        """The ``n`` choices of each prompt (``fanout.py``: each prompt computed once); sample j of a prompt
        runs with ``sample_params(params, j)``."""
        def start(c: int) -> AsyncIterator[RequestOutput]:
            p, j = divmod(c, n)
            return self.run(prompts[p], sample_params(params[p], j), salt)
        return Fanout(start, n, len(prompts))
