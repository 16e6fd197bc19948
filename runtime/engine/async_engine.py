"""Runs an ``LLMEngine`` in its own thread and serves it to asyncio code (the HTTP server).

Commands (add, abort, run a function) go through a queue to the engine thread, which owns the
engine exclusively; outputs come back to each request's asyncio queue. A request's first output, once
the engine accepted it, carries no token (a stream answers at once, before its prompt is computed). A failing step ends the
affected requests with an error and the thread keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from kvdrive.runtime.engine.llm_engine import LLMEngine
from kvdrive.runtime.engine.request import Request, RequestOutput
from kvdrive.runtime.kvcache.store.faults import FaultLog

log = logging.getLogger(__name__)

_Sink = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestOutput | BaseException]"]


SLOW_TURN_S = 2.0  # an engine turn longer than this is logged with what it did


class AsyncEngine:
    def __init__(self, engine: LLMEngine, observe_step: Callable[[float], None] | None = None) -> None:
        """``observe_step(seconds)``: called after each loop turn that ran a step, with the turn's time
        (the commands handled before it, e.g. an admin change, and the step): what decoders waited."""
        self.engine = engine
        self._observe = observe_step
        self._slow = FaultLog(log, "engine")  # slow turns: one log line per 10 s, with a count of the rest
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvdrive-engine", daemon=True)
        self.step_failures = 0

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def close(self) -> None:
        """After ``shutdown``: the engine finishes its write-backs and closes the KV tiers (``LLMEngine.close``)."""
        self.engine.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _send(self, kind: str, payload: Any) -> None:
        self._commands.put((kind, payload))
        self._wake.set()

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps; return its result."""
        fut: Future[Any] = Future()
        self._send("call", (fn, fut))
        return await asyncio.wrap_future(fut)

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Outputs of one request; aborts it when the consumer stops early (client gone)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._sinks[request.request_id] = (loop, q)
        self._send("add", request)
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._send("abort", request.request_id)
            else:
                self._sinks.pop(request.request_id, None)

    # --- engine thread ------------------------------------------------------------------------
    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        sink = self._sinks.get(request_id)
        if sink is None:
            return
        loop, q = sink
        if isinstance(item, BaseException) or item.finished:
            self._sinks.pop(request_id, None)
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the request's event loop is closed
            pass

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "add":
            try:
                self.engine.add_request(payload)
            except Exception as exc:  # validation errors go back to the caller
                self._deliver(payload.request_id, exc)
                return
            # accepted: an output with no token yet (a stream's response starts now, not at its first token)
            self._deliver(payload.request_id, RequestOutput(payload.request_id, (), "", len(payload.prompt_ids), 0))
        elif kind == "abort":
            out = self.engine.abort(payload)
            self._sinks.pop(payload, None)
            if out is not None:
                log.info("aborted %s after %d tokens (client went away)", payload, out.completion_tokens)
        elif kind == "call":
            fn, fut = payload
            try:
                fut.set_result(fn(self.engine))
            except Exception as exc:
                fut.set_exception(exc)

    def _run(self) -> None:
        """Turns until stopped. Nothing a turn raises ends the thread: /healthz reports a dead engine
        thread and the kubelet restarts the pod, dropping every request and the memory tiers, so an
        unexpected error fails the running requests instead (logged with its traceback)."""
        while not self._stop.is_set():
            try:
                self._turn()
            except Exception as exc:  # a command's or a step's: the one place a turn's failure is handled
                self._fail_running(exc)

    def _fail_running(self, exc: Exception) -> None:
        """End every request with an error naming ``exc`` (logged with its traceback); the thread lives on."""
        self.step_failures += 1
        log.exception("engine turn failed; ending the running requests")
        try:
            outputs = self.engine.fail_all(f"internal engine error: {exc}")
        except Exception:
            log.exception("ending the running requests failed too")
            return
        for out in outputs:
            self._deliver(out.request_id, out)

    def _turn(self) -> None:
        """Commands, then one engine step when there is work."""
        started = time.perf_counter()
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                break
            self._handle(kind, payload)
        commands = time.perf_counter() - started
        if not self.engine.has_work():
            self.engine.idle()
            self._wake.wait(0.5)
            self._wake.clear()
            return
        outputs = self.engine.step()
        for out in outputs:
            self._deliver(out.request_id, out)
        took = time.perf_counter() - started
        if self._observe is not None:
            self._observe(took)
        if took > SLOW_TURN_S:
            st = self.engine.last_step
            self._slow.record("slow-turn", "slow engine turn: %.2f s (commands %.2f s, scheduling %.2f s, "
                              "forward %.2f s: %d prompt tokens, %d decodes)", took, commands, st.schedule_s,
                              st.forward_s, st.prompt_tokens, st.decodes, level=logging.WARNING)
