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

A page announced in the shared medium (``SHARED_MEDIUM``: the fleet's shared tier, a store every replica can read)
is the fleet's, not the announcing replica's: every replica can reuse it (``match`` counts it for any replica
whose prompt reaches it, and says how many of the pages matched are only there, since reading them costs a
fetch that a local copy does not). It is scoped as every page is: its digest chains from the model's root (and a
tenant's salt), so only prompts hashed under the same root find it. Its presence rests on the replicas that
announced it: a ``BlockRemoved`` in the shared medium from any replica (it learned the page is gone from the
store) forgets it for all; a replica that leaves, restarts or starts its events over withdraws only its own
announcements, so a page another replica announced stays. The store evicts without telling anyone, so at most
``shared_pages`` are remembered, the oldest announced forgotten first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvdrive.runtime.protocol.kv_event_wire import SHARED_MEDIUM, fold

SHARED_PAGES = 1 << 19  # shared-tier pages remembered (the oldest announced are forgotten first)


@dataclass(frozen=True)
class Match:
    """What a replica can reuse of a prompt."""

    pages: int  # the longest run of the prompt's leading pages it holds or can read from the shared tier
    shared: int  # of those, the pages only the shared tier holds (it would fetch them)


class PrefixIndex:
    def __init__(self, recent_seconds: float = 10.0, shared_pages: int = SHARED_PAGES) -> None:
        self.recent_seconds = recent_seconds
        self.shared_pages = shared_pages
        self._polled: dict[str, frozenset[bytes]] = {}
        self._recent: dict[str, dict[bytes, float]] = {}  # replica -> digest -> when it was learned
        self._pinned: dict[str, dict[bytes, int]] = {}  # replica -> digest -> requests in flight with it
        # replica -> page (its digest's low 64 bits, as KV events name it: ``fold``) -> media holding it
        self._evented: dict[str, dict[int, set[str]]] = {}
        # page in the shared tier (folded, as above) -> the replicas whose announcements it rests on; oldest first
        self._shared: dict[int, set[str]] = {}

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
        """The replica's events start over (``AllBlocksCleared``): from here they are its exact state (its
        announcements of shared pages are withdrawn too: its new life announces what it publishes)."""
        self._evented[replica] = {}
        self._polled[replica] = frozenset()
        self._withdraw(replica)

    def events_stored(self, replica: str, hashes: Sequence[int | bytes], medium: str) -> None:
        if medium == SHARED_MEDIUM:
            self._shared_stored(replica, hashes)
            return
        held = self._evented.setdefault(replica, {})
        for h in hashes:
            held.setdefault(fold(h), set()).add(medium)

    def events_removed(self, replica: str, hashes: Sequence[int | bytes], medium: str) -> None:
        """Pages gone from one medium; those on no other are gone from the replica. Gone from the shared
        medium, they are gone for every replica."""
        if medium == SHARED_MEDIUM:
            for h in hashes:
                self._shared.pop(fold(h), None)
            return
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
        self._withdraw(replica)

    def _shared_stored(self, replica: str, hashes: Sequence[int | bytes]) -> None:
        for h in map(fold, hashes):
            announced = self._shared.pop(h, None) or set()  # announced again: now the newest
            announced.add(replica)
            self._shared[h] = announced
        while len(self._shared) > self.shared_pages:
            del self._shared[next(iter(self._shared))]

    def _withdraw(self, replica: str) -> None:
        """``replica``'s announcements of shared pages no longer count; pages no other replica announced go."""
        for h in [h for h, announced in self._shared.items() if replica in announced]:
            announced = self._shared[h]
            announced.discard(replica)
            if not announced:
                del self._shared[h]

    def expire(self, now: float) -> None:
        for replica, recent in self._recent.items():
            self._recent[replica] = {d: t for d, t in recent.items() if now - t <= self.recent_seconds}

    def match(self, replica: str, digests: Sequence[bytes]) -> Match:
        """How many of the prompt's leading pages ``replica`` can reuse (stops at the first that neither it nor
        the shared tier holds), and how many of those only the shared tier holds."""
        polled, recent = self._polled.get(replica, frozenset()), self._recent.get(replica, {})
        pinned, evented = self._pinned.get(replica, {}), self._evented.get(replica, {})
        n = shared = 0
        for d in digests:
            if d not in polled and d not in recent and d not in pinned:
                h = fold(d)
                if h not in evented:
                    if h not in self._shared:
                        break
                    shared += 1
            n += 1
        return Match(n, shared)

    def matched(self, replica: str, digests: Sequence[bytes]) -> int:
        """How many of the prompt's leading pages ``replica`` can reuse, on its tiers or the shared tier."""
        return self.match(replica, digests).pages

    def shared(self) -> int:
        """Pages the index knows in the fleet's shared tier."""
        return len(self._shared)

    def pages(self, replica: str) -> int:
        known = self._polled.get(replica, frozenset()) | self._recent.get(replica, {}).keys() \
            | self._pinned.get(replica, {}).keys()
        evented = self._evented.get(replica, {})
        if not evented:
            return len(known)
        folded = {fold(d) for d in known}
        return len(known) + sum(1 for h in evented if h not in folded)
