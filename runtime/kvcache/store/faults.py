"""Fault accounting of one tier: counted by kind, logged at a bounded rate, and a degraded state.

A failing disk fails the same way thousands of times a second. Each fault is counted (the metrics export
the counts), but the log gets at most one line per fault kind per ``interval`` seconds, saying how many
more of that kind happened since the last line. A tier is *degraded* while it has seen a fault within
the last ``window`` seconds; ``/readyz`` and ``kvdrive_tier_degraded`` report it. It is *failing* while a
block read or write failed with an I/O error (``block_io``; not a failed checksum) within that window: then
it cannot be counted on to take new blocks, and the scheduler plans without its capacity. A slab that could
not be sized (the tier takes what fits) or a failed journal append (blocks stay usable, not persisted)
leaves it degraded, not failing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class FaultPolicy:
    interval: float = 10.0  # seconds between two log lines of one fault kind
    window: float = 60.0  # a fault this recent makes the tier degraded


class FaultLog:
    """Thread-safe: tier I/O runs on several threads."""

    def __init__(self, logger: logging.Logger, tier: str, policy: FaultPolicy = FaultPolicy(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log, self.tier, self.policy, self._clock = logger, tier, policy, clock
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}  # kind -> faults since start
        self._logged_at: dict[str, float] = {}  # kind -> when its last line was written
        self._unlogged: dict[str, int] = {}  # kind -> faults since that line
        self._last: tuple[float, str] | None = None  # (when, kind) of the latest fault
        self._last_io: float | None = None  # when a block read or write last failed with an I/O error

    def record(self, kind: str, message: str, *args: object, level: int = logging.ERROR,
               block_io: bool = False) -> None:
        """Count one fault of ``kind``; log ``message % args`` unless this kind was logged recently.
        ``block_io``: a block read or write failed (the tier is failing while such a fault is recent)."""
        now = self._clock()
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self._last = (now, kind)
            if block_io:
                self._last_io = now
            since = self._logged_at.get(kind)
            if since is not None and now - since < self.policy.interval:
                self._unlogged[kind] = self._unlogged.get(kind, 0) + 1
                return
            more = self._unlogged.pop(kind, 0)
            self._logged_at[kind] = now
        suffix = f" (+{more} more {kind} faults in the last {now - since:.0f} s)" if more and since is not None else ""
        self._log.log(level, message + suffix, *args)

    def failing(self) -> bool:
        """Whether a block read or write failed with an I/O error (EIO, ...) within the window."""
        with self._lock:
            return self._last_io is not None and self._clock() - self._last_io <= self.policy.window

    def degraded(self) -> str | None:
        """Why the tier is degraded now (its latest fault, recent enough), or None."""
        with self._lock:
            if self._last is None or self._clock() - self._last[0] > self.policy.window:
                return None
            when, kind = self._last
            total = sum(self.counts.values())
        return f"{self.tier} tier: {kind} fault {self._clock() - when:.0f} s ago ({total} faults since start)"
