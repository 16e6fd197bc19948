"""Which replica holds which prefix pages, as far as the router knows.

Two sources, both hints (a replica checks every page it reuses, so a wrong entry costs a prefill, never a
wrong token):
- each replica's own list of the pages its tiers hold (``GET /v1/kvdrive/prefixes``), polled: it replaces
  what the router knew of that replica, so pages it evicted are forgotten at the next poll;
- the pages of each prompt the router sent to a replica that accepted it, counted at once: a repeat that
  arrives before the replica has computed them still finds them. They are *pinned* while the request is in
  flight (queued or computing on the replica, whose polls cannot list pages it has not computed yet: a poll
  dropping them made repeats of a document arriving in that window, 25-60 s for a cold 2-3K-token document
  on the benchmark's fleet, go to other replicas and compute it again). When the request ends they count
  as learned then, and last ``recent_seconds`` unless a poll that started after that confirms them.
A replica that restarted (a new instance id), left or failed is forgotten.

A replica that publishes KV events (``kv_event_feed``) is followed change by change instead: a page counts while
some tier (medium) holds it, and a ``BlockRemoved`` on its last tier forgets it at once. Events that start from
the replica's ``AllBlocksCleared`` are its exact state and replace what a poll found; a page only a poll found
(its tiers unknown: events joined late) is forgotten at its first ``BlockRemoved``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvdrive.runtime.protocol.kv_event_wire import fold


class PrefixIndex:
    def __init__(self, recent_seconds: float = 10.0) -> None:
        self.recent_seconds = recent_seconds
        self._polled: dict[str, frozenset[bytes]] = {}
        self._recent: dict[str, dict[bytes, float]] = {}  # replica -> digest -> when it was learned
        self._pinned: dict[str, dict[bytes, int]] = {}  # replica -> digest -> requests in flight with it
        # replica -> page (its digest's low 64 bits, as KV events name it: ``fold``) -> media holding it
        self._evented: dict[str, dict[int, set[str]]] = {}

    def replace(self, replica: str, digests: Iterable[bytes], polled_at: float) -> None:
        """What a poll that started at ``polled_at`` found on ``replica``."""
        self._polled[replica] = frozenset(digests)
        recent = self._recent.get(replica, {})
        self._recent[replica] = {d: t for d, t in recent.items() if t >= polled_at}  # newer than the poll

    def learn(self, replica: str, digests: Sequence[bytes], now: float) -> None:
        self._recent.setdefault(replica, {}).update(dict.fromkeys(digests, now))

    def pin(self, replica: str, digests: Sequence[bytes]) -> None:
        """A request with these pages is in flight on ``replica``: they count until ``unpin``."""
        pinned = self._pinned.setdefault(replica, {})
        for d in digests:
            pinned[d] = pinned.get(d, 0) + 1

    def unpin(self, replica: str, digests: Sequence[bytes], now: float, learned: bool = True) -> None:
        """That request ended: ``learned`` (the replica took it, so it holds its pages) they count as
        learned ``now``; otherwise (refused, failed before answering) only the pin goes."""
        pinned = self._pinned.get(replica)
        if pinned is None:  # the replica was forgotten meanwhile
            return
        for d in digests:
            left = pinned.get(d, 0) - 1
            if left > 0:
                pinned[d] = left
            else:
                pinned.pop(d, None)
        if learned:
            self.learn(replica, digests, now)

    def events_cleared(self, replica: str) -> None:
        """The replica's events start over (``AllBlocksCleared``): from here they are its exact state."""
        self._evented[replica] = {}
        self._polled[replica] = frozenset()

    def events_stored(self, replica: str, hashes: Sequence[int | bytes], medium: str) -> None:
        held = self._evented.setdefault(replica, {})
        for h in hashes:
            held.setdefault(fold(h), set()).add(medium)

    def events_removed(self, replica: str, hashes: Sequence[int | bytes], medium: str) -> None:
        """Pages gone from one medium; those on no other are gone from the replica."""
        held = self._evented.get(replica, {})
        gone = set()
        for h in map(fold, hashes):
            media = held.get(h)
            if media is not None:
                media.discard(medium)
                if media:
                    continue
                del held[h]
            gone.add(h)
        polled = self._polled.get(replica)
        if polled and gone:
            self._polled[replica] = frozenset(d for d in polled if fold(d) not in gone)

    def forget(self, replica: str) -> None:
        self._polled.pop(replica, None)
        self._evented.pop(replica, None)
        self._recent.pop(replica, None)
        self._pinned.pop(replica, None)

    def expire(self, now: float) -> None:
        for replica, recent in self._recent.items():
            self._recent[replica] = {d: t for d, t in recent.items() if now - t <= self.recent_seconds}

    def matched(self, replica: str, digests: Sequence[bytes]) -> int:
        """How many of the prompt's leading pages ``replica`` holds (stops at the first it lacks)."""
        polled, recent = self._polled.get(replica, frozenset()), self._recent.get(replica, {})
        pinned, evented = self._pinned.get(replica, {}), self._evented.get(replica, {})
        n = 0
        for d in digests:
            if d not in polled and d not in recent and d not in pinned and fold(d) not in evented:
                break
            n += 1
        return n

    def pages(self, replica: str) -> int:
        known = self._polled.get(replica, frozenset()) | self._recent.get(replica, {}).keys() \
            | self._pinned.get(replica, {}).keys()
        evented = self._evented.get(replica, {})
        if not evented:
            return len(known)
        folded = {fold(d) for d in known}
        return len(known) + sum(1 for h in evented if h not in folded)
