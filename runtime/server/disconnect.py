"""A client's disconnect ends its wait: ``until_disconnect`` cancels the work (its request is then aborted in
the engine) and raises ``ClientGone``, which the app answers with nginx's 499 (nobody reads it)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Receive

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready; its request was aborted."""


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """``work``, cancelled the moment the client disconnects (``receive``: the request's ASGI channel; its
    request is then aborted in the engine, freeing its slot and pages at the next step). Starlette notices a
    disconnect by itself only while it streams a response; this covers the wait before that: a prefill, or a
    whole non-streamed answer."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            raise ClientGone() from None
        raise
    finally:
        watcher.cancel()
