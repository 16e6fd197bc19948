"""The transfer queue: queued jobs of the ``Mover``, run off the engine thread by priority.

Owns *when* bytes move (the store owns *where* they are, placement decides *which*, the ``Mover`` moves
them). Jobs run on a small pool of worker threads in priority order: prefetch > write-back, FIFO within a
priority (a step's demand reads run first of all, in the engine thread: ``kvcache/step_reads.py``). A
prefetch arrives as moves the Mover already *prepared* on the engine thread (destination slots reserved,
sources pinned); a worker runs and completes them, so no worker ever evicts from a memory tier. A write-back
submitted again while still queued (same keys and destination) is merged into the queued one. Every job
completes its handle, with a result or the exception (logged and counted); workers never die
silently: a dead worker is replaced on the next submit and counted. On CUDA each worker runs its
jobs on its own stream and synchronizes it before completing (device <-> pinned DRAM copies overlap
compute on the default stream).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch

from kvdrive.runtime.kvcache.contract import Move
from kvdrive.runtime.kvcache.mover.mover import Mover
from kvdrive.runtime.kvcache.store.budgets import TierName
from kvdrive.runtime.kvcache.store.keys import BlockKey

log = logging.getLogger(__name__)


class Priority(IntEnum):
    PREFETCH = 0  # predicted pages for the next layer / step
    WRITEBACK = 1  # demotion and persistence


class TransferHandle:
    """Completion of one job: ``wait()`` returns its result or raises its error."""

    def __init__(self, priority: Priority) -> None:
        self.priority = priority
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done.wait(timeout):
            raise TimeoutError(f"transfer ({self.priority.name}) not done after {timeout}s")
        if self._error is not None:
            raise self._error
        return self._result

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._done.set()


@dataclass(order=True)
class _Job:
    priority: int
    seq: int
    fn: Callable[[], Any] = field(compare=False)
    handle: TransferHandle = field(compare=False)
    dedupe: tuple[Any, ...] | None = field(compare=False, default=None)


class TransferQueue:
    def __init__(self, mover: Mover, workers: int = 2) -> None:
        self.mover = mover
        self.cuda = mover.runner.device.type == "cuda"
        self._heap: list[_Job] = []
        self._queued: dict[tuple[Any, ...], _Job] = {}
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._closed = False
        self.submitted = {p.name: 0 for p in Priority}
        self.completed = {p.name: 0 for p in Priority}
        self.failed = {p.name: 0 for p in Priority}
        self.busy_seconds = {p.name: 0.0 for p in Priority}  # worker time spent in jobs
        self.worker_restarts = 0
        self._running = 0
        self._threads: list[threading.Thread] = []
        for i in range(workers):
            self._threads.append(self._spawn(i))

    # --- submission --------------------------------------------------------------------------
    def submit(self, fn: Callable[[], Any], priority: Priority, dedupe: tuple[Any, ...] | None = None) -> TransferHandle:
        with self._cv:
            if self._closed:
                raise RuntimeError("transfer engine is closed")
            self._ensure_workers()
            old = self._queued.get(dedupe) if dedupe is not None else None
            if old is not None:  # the same job is still queued: it does this one's work
                return old.handle
            job = _Job(int(priority), next(self._seq), fn, TransferHandle(priority), dedupe)
            if dedupe is not None:
                self._queued[dedupe] = job
            heapq.heappush(self._heap, job)
            self.submitted[priority.name] += 1
            self._cv.notify_all()
            return job.handle

    def run(self, moves: list[Move], priority: Priority = Priority.PREFETCH) -> TransferHandle:
        """Run prepared moves and publish them; the handle yields how many arrived."""
        mover = self.mover
        return self.submit(lambda: mover.complete_moves(moves, mover.run_moves(moves)), priority)

    def replicate(self, keys: list[BlockKey], dst: TierName = "ssd") -> TransferHandle:
        """Write-back: give blocks a ``dst`` copy (e.g. persistence on SSD) keeping theirs; yields the count."""
        return self.submit(lambda: self.mover.replicate(keys, dst), Priority.WRITEBACK,
                           dedupe=("replicate", tuple(keys), dst))

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until no job is queued or running; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._heap or self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    # --- workers -----------------------------------------------------------------------------
    def _spawn(self, i: int) -> threading.Thread:
        t = threading.Thread(target=self._worker, name=f"kvdrive-transfer-{i}", daemon=True)
        t.start()
        return t

    def _ensure_workers(self) -> None:
        for i, t in enumerate(self._threads):
            if not t.is_alive():
                log.error("transfer worker %s had died; restarted", t.name)
                self.worker_restarts += 1
                self._threads[i] = self._spawn(i)

    def _worker(self) -> None:
        stream = torch.cuda.Stream() if self.cuda else None
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if not self._heap:
                    return
                job = heapq.heappop(self._heap)
                if job.dedupe is not None:
                    self._queued.pop(job.dedupe, None)
                self._running += 1
            name = Priority(job.priority).name
            started = time.perf_counter()
            try:
                # jobs write into buffers the engine allocated inside the model's forward (inference
                # tensors); in inference mode they may, and the long-lived pools are normal tensors
                with torch.inference_mode():
                    result = self._run(job, stream)
            except Exception as exc:  # the job fails, the worker lives on
                log.exception("transfer job (%s) failed", name)
                job.handle._finish(error=exc)
                with self._cv:
                    self.failed[name] += 1
                    self._running -= 1
                    self._cv.notify_all()
                continue
            except BaseException:
                with self._cv:
                    self._running -= 1
                    self._cv.notify_all()
                raise
            job.handle._finish(result)
            with self._cv:
                self.completed[name] += 1
                self.busy_seconds[name] += time.perf_counter() - started
                self._running -= 1
                self._cv.notify_all()

    @staticmethod
    def _run(job: _Job, stream: torch.cuda.Stream | None) -> Any:
        if stream is None:
            return job.fn()
        with torch.cuda.stream(stream):
            result = job.fn()
        stream.synchronize()
        return result

    def close(self) -> None:
        """Finish queued jobs, then stop the workers."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()
