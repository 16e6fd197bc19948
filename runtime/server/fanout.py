"""The choices of one request (``n`` samples of each of its prompts) as one stream of (choice index,
output), each prompt computed once.

Choice ``i * n + j`` is prompt i's sample j. Each prompt's sample 0 runs first (the prompts of a batch
together). When its first token comes, its prompt's full pages are stored, and that prompt's other samples
start: each finds those pages stored and references them (no copy, no recompute), computing only the
prompt's last, partial page itself (fewer than ``page_size`` tokens) before it samples on its own. Leaving
early (a client gone, an error) cancels every sample still running, which aborts it in the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from kvdrive.runtime.engine import RequestOutput

Item = tuple[int, RequestOutput]


class Fanout:
    def __init__(self, start: Callable[[int], AsyncIterator[RequestOutput]], n: int, prompts: int = 1) -> None:
        """``start(c)``: the outputs of choice c (a request to the engine, made when called)."""
        self._start, self.per_prompt, self.prompts = start, n, prompts
        self.n = n * prompts  # choices in all
        self._gen = self._items()

    def __aiter__(self) -> AsyncIterator[Item]:
        return self._gen

    async def aclose(self) -> None:
        await self._gen.aclose()

    async def _items(self) -> AsyncIterator[Item]:
        q: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(c: int) -> None:
            try:
                async for out in self._start(c):
                    await q.put((c, out))
                await q.put((c, None))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                await q.put((c, exc))

        n = self.per_prompt
        tasks = [asyncio.ensure_future(pump(p * n)) for p in range(self.prompts)]
        waiting = set(range(self.prompts)) if n > 1 else set()  # prompts whose other samples have not started
        ended = 0
        try:
            while ended < len(tasks):
                c, item = await q.get()
                if item is None:
                    ended += 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                p = c // n
                if c % n == 0 and p in waiting and (item.new_token_ids or item.finished):
                    waiting.discard(p)
                    tasks += [asyncio.ensure_future(pump(p * n + j)) for j in range(1, n)]
                yield c, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
