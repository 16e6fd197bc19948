"""A circuit breaker for one shard of the shared tier: a slow or dead shard degrades the tier, never stalls it.

Closed (calls go through) -> ``FAILURES`` failures in a row -> open (calls are refused at once: the pages
there are misses) for a cooldown that doubles on each failed probe up to ``MAX_COOLDOWN_S`` -> half-open
(one call is let through as a probe) -> closed again on its success. Thread-safe; the clock is passed in.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

FAILURES = 3  # failures in a row that open the breaker
COOLDOWN_S = 1.0  # first wait before a probe
MAX_COOLDOWN_S = 15.0


class Breaker:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at: float | None = None  # None: closed
        self._cooldown = COOLDOWN_S
        self._probing = False
        self.last_error = ""

    def allow(self) -> bool:
        """Whether a call may go to the shard now (closed, or the one probe of a half-open breaker)."""
        with self._lock:
            if self._opened_at is None:
                return True
            if self._probing or self._clock() - self._opened_at < self._cooldown:
                return False
            self._probing = True
            return True

    def success(self) -> None:
        with self._lock:
            self._failures, self._opened_at, self._probing, self._cooldown = 0, None, False, COOLDOWN_S

    def failure(self, error: str) -> None:
        with self._lock:
            self.last_error = error
            self._failures += 1
            if self._probing:  # the probe failed: stay open, wait longer
                self._probing = False
                self._opened_at = self._clock()
                self._cooldown = min(2 * self._cooldown, MAX_COOLDOWN_S)
            elif self._opened_at is None and self._failures >= FAILURES:
                self._opened_at = self._clock()

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._opened_at is not None

    def probe_due(self) -> bool:
        """Open, and its cooldown is over (a probe would be let through)."""
        with self._lock:
            return (self._opened_at is not None and not self._probing
                    and self._clock() - self._opened_at >= self._cooldown)
