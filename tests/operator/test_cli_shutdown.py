"""`kvdrive-operator run`'s event loop at shutdown: Kopf's watch streams finalized out of order log no traceback,
every other error in closing an async generator still reaches asyncio's default handler."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import kopf
import pytest
from kopf._cogs.clients import watching

from kvdrive.operator.cli import quiet_watch_finalization


def _kopf_watch_stuck_at_an_event(monkeypatch: pytest.MonkeyPatch, loop: asyncio.AbstractEventLoop) -> list[Any]:
    """Starts Kopf's real ``infinite_watch`` up to its first event (the API side replaced by one event) and
    returns it with the ``streaming_block`` context manager it holds open."""
    opened: list[Any] = []
    real_block = watching.streaming_block

    def recording_block(**kwargs: Any) -> Any:
        cm = real_block(**kwargs)
        opened.append(cm)
        return cm

    async def one_event(**_: Any) -> AsyncIterator[Any]:
        yield {"type": "ADDED", "object": {}}
        await asyncio.Event().wait()

    monkeypatch.setattr(watching, "streaming_block", recording_block)
    monkeypatch.setattr(watching, "continuous_watch", one_event)
    resource = kopf.Resource("kvdrive.io", "v1alpha1", "kvdrivedeployments", namespaced=True)
    stream = watching.infinite_watch(settings=kopf.OperatorSettings(), resource=resource, namespace="ns")
    _first(loop, stream)
    return [stream, opened[0]]


def _first(loop: asyncio.AbstractEventLoop, stream: AsyncIterator[Any]) -> Any:
    """The stream's first item, taken inside the loop so the loop owns (and at shutdown closes) the stream."""
    async def take() -> Any:
        return await anext(stream)

    return loop.run_until_complete(take())


def _shut_down(loop: asyncio.AbstractEventLoop) -> None:
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


def test_kopf_watch_closed_after_its_context_manager_logs_no_error(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(quiet_watch_finalization)
    stream, block = _kopf_watch_stuck_at_an_event(monkeypatch, loop)
    # the order the loop may pick at shutdown: the context manager's generator first, then the watch
    loop.run_until_complete(block.gen.aclose())
    with caplog.at_level(logging.DEBUG):
        _shut_down(loop)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []
    assert any("finalized after its own context manager" in r.getMessage() for r in caplog.records)
    del stream


def test_the_same_race_without_the_handler_is_reported(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """What the handler exists for: the race is real on this Python, and asyncio logs it as an error."""
    loop = asyncio.new_event_loop()
    stream, block = _kopf_watch_stuck_at_an_event(monkeypatch, loop)
    loop.run_until_complete(block.gen.aclose())
    _shut_down(loop)
    assert any("didn't stop after athrow()" in str(r.exc_info[1]) for r in caplog.records
               if r.levelno >= logging.ERROR and r.exc_info)
    del stream


def test_other_errors_at_shutdown_still_reach_the_default_handler(caplog: pytest.LogCaptureFixture) -> None:
    opened: list[Any] = []

    @contextlib.asynccontextmanager
    async def block() -> AsyncIterator[None]:
        yield

    async def infinite_watch() -> AsyncIterator[int]:  # Kopf's name, not Kopf's code: not quieted
        cm = block()
        opened.append(cm)
        async with cm:
            yield 1

    async def broken() -> AsyncIterator[int]:
        try:
            yield 1
        finally:
            raise ValueError("broken at close")

    loop = asyncio.new_event_loop()
    loop.set_exception_handler(quiet_watch_finalization)
    lookalike, other = infinite_watch(), broken()
    _first(loop, lookalike)
    _first(loop, other)
    loop.run_until_complete(opened[0].gen.aclose())
    _shut_down(loop)
    reported = {type(r.exc_info[1]).__name__ for r in caplog.records if r.levelno >= logging.ERROR and r.exc_info}
    assert reported == {"RuntimeError", "ValueError"}
    del lookalike, other
