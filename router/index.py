"""Which replica holds which prefix pages, as far as the router knows.

Two sources, both hints (a replica checks every page it reuses, so a wrong entry costs a prefill, never a
wrong token):
- each replica's own list of the pages its tiers hold (``GET /v1/kvdrive/prefixes``), polled: it replaces
  what the router knew of that replica, so pages it evicted are forgotten at the next poll;
- the pages of each prompt the router sent to a replica that accepted it, learned at once: a repeat that
  arrives before the next poll still finds them. An entry learned this way lasts ``recent_seconds`` unless
  a poll that started after it confirms it.
A replica that restarted (a new instance id), left or failed is forgotten.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self, recent_seconds: float = 10.0) -> None:
        self.recent_seconds = recent_seconds
        self._polled: dict[str, frozenset[bytes]] = {}
        self._recent: dict[str, dict[bytes, float]] = {}  # replica -> digest -> when it was learned

    def replace(self, replica: str, digests: Iterable[bytes], polled_at: float) -> None:
        """What a poll that started at ``polled_at`` found on ``replica``."""
        self._polled[replica] = frozenset(digests)
        recent = self._recent.get(replica, {})
        self._recent[replica] = {d: t for d, t in recent.items() if t >= polled_at}  # newer than the poll

    def learn(self, replica: str, digests: Sequence[bytes], now: float) -> None:
        self._recent.setdefault(replica, {}).update(dict.fromkeys(digests, now))

    def forget(self, replica: str) -> None:
        self._polled.pop(replica, None)
        self._recent.pop(replica, None)

    def expire(self, now: float) -> None:
        for replica, recent in self._recent.items():
            self._recent[replica] = {d: t for d, t in recent.items() if now - t <= self.recent_seconds}

    def matched(self, replica: str, digests: Sequence[bytes]) -> int:
        """How many of the prompt's leading pages ``replica`` holds (stops at the first it lacks)."""
        polled, recent = self._polled.get(replica, frozenset()), self._recent.get(replica, {})
        n = 0
        for d in digests:
            if d not in polled and d not in recent:
                break
            n += 1
        return n

    def pages(self, replica: str) -> int:
        return len(self._polled.get(replica, frozenset()) | self._recent.get(replica, {}).keys())
