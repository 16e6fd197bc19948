"""``n`` samples of one prompt as one stream of (choice index, output), the prompt computed once.

Sample 0 runs first. When its first token comes, its prompt's full pages are stored, and the other samples
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
    def __init__(self, start: Callable[[int], AsyncIterator[RequestOutput]], n: int) -> None:
        """``start(i)``: the outputs of sample i (a request to the engine, made when called)."""
        self._start, self.n = start, n
        self._gen = self._items()

    def __aiter__(self) -> AsyncIterator[Item]:
        return self._gen

    async def aclose(self) -> None:
        await self._gen.aclose()

    async def _items(self) -> AsyncIterator[Item]:
        q: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for out in self._start(i):
                    await q.put((i, out))
                await q.put((i, None))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                await q.put((i, exc))

        tasks = [asyncio.ensure_future(pump(0))]
        ended = 0
        try:
            while ended < len(tasks):
                i, item = await q.get()
                if item is None:
                    ended += 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                if i == 0 and len(tasks) == 1 and self.n > 1 and (item.new_token_ids or item.finished):
                    tasks += [asyncio.ensure_future(pump(j)) for j in range(1, self.n)]
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
