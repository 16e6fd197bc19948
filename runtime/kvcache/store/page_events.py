"""What a KV-event stream tells consumers: which tiers hold each page, as it changes, with the page's tokens.

``PageEvents`` is the recorder between the block table and whoever publishes KV events (vLLM's ``kv_events``
wire: ``kvdrive.runtime.server.kv_event_publisher``). The block table calls ``changed`` under its lock whenever a
page's layer-0 block gains a readable copy in a tier or loses one (the same page identity the router's
``/v1/kvdrive/prefixes`` list uses: a page counts where its first layer's block is); the engine calls
``describe`` when a sequence seals a page, naming its parent page and tokens. The publisher's thread takes
the changes in order (``take``, which waits on a condition, so a change reaches the wire within a few
milliseconds) as frozen ``PageChange`` records carrying the tokens they need.

Besides the store's tiers (``TierName``) a change may name the event tier ``"shared"``: the fleet's shared tier,
a store every replica can read, which the runtime tells ``changed(digest, "shared", True)`` after it published a
page's value there and ``changed(digest, "shared", False)`` when it learned that a page it had announced is gone
there (a fetch miss, a value that failed verification). It is not a ``TierName``: it has no budget here, and
the store behind it evicts without telling anyone. Its changes are announced and deduplicated like any tier's.

A page's tokens are kept while some local tier holds it (a later copy to another tier is announced with them
too) and dropped when a batch of changes ends with it on no local tier: the shared tier may hold far more pages
than this replica's tiers, for as long as its store keeps them, so it keeps no tokens alive. A page fetched back
from it is announced without tokens, as are pages recovered from the SSD tier at start. Since that store evicts
silently, the pages known only there are bounded: past ``shared_pages`` of them the oldest announced are
forgotten here, without an event (a later copy is announced again; a later removal of a forgotten page is not).
Nothing here touches a tier or a tensor.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from kvdrive.runtime.kvcache.store.budgets import TierName

EventTier = TierName | Literal["shared"]  # where a change happened: one of the store's tiers, or the shared tier
SHARED: EventTier = "shared"

# described pages that never reached a tier (a failed step) are purged once the map is this much bigger
# than the pages held
SPARE_DESCRIPTIONS = 4096
SHARED_PAGES = 1 << 17  # pages known only in the shared tier that are remembered (the oldest announced go first)


@dataclass(frozen=True)
class PageInfo:
    parent: bytes | None  # the previous page's digest; None for a sequence's first page
    tokens: tuple[int, ...]  # the page's tokens (page_size of them)


@dataclass(frozen=True)
class PageChange:
    digest: bytes
    tier: EventTier
    stored: bool  # True: the tier now holds the page; False: it no longer does
    info: PageInfo | None  # with ``stored``: the page's parent and tokens, when known


class PageEvents:
    def __init__(self, shared_pages: int = SHARED_PAGES) -> None:
        self.shared_pages = shared_pages
        self._cv = threading.Condition(threading.Lock())
        self._changes: list[tuple[bytes, EventTier, bool]] = []
        self._info: dict[bytes, PageInfo] = {}
        self._held: dict[bytes, set[EventTier]] = {}  # page -> the tiers holding it (as announced)
        self._shared_only: dict[bytes, None] = {}  # pages held (as announced) only in the shared tier, oldest first

    # --- producers --------------------------------------------------------------------------------------
    def describe(self, pages: Iterable[tuple[bytes, bytes | None, tuple[int, ...]]]) -> None:
        """Sealed pages' (digest, parent digest or None, tokens), before their blocks are stored."""
        with self._cv:
            for digest, parent, tokens in pages:
                self._info[digest] = PageInfo(parent, tokens)
            if len(self._info) > len(self._held) + SPARE_DESCRIPTIONS:
                self._info = {d: i for d, i in self._info.items() if d in self._held}

    def changed(self, digest: bytes, tier: EventTier, stored: bool) -> None:
        """Page ``digest``'s layer-0 block gained (``stored``) or lost a readable copy in ``tier`` (the block
        table calls it under its lock, so changes arrive in the table's order; the shared tier calls it with
        ``"shared"``). It only appends."""
        with self._cv:
            self._changes.append((digest, tier, stored))
            self._cv.notify()

    def seed(self, pages: Iterable[tuple[bytes, EventTier]]) -> None:
        """The pages the tiers hold when events are turned on (e.g. recovered from the SSD tier)."""
        with self._cv:
            self._changes.extend((d, t, True) for d, t in pages)
            self._cv.notify()

    # --- the publisher ------------------------------------------------------------------------------------
    def take(self, timeout: float) -> list[PageChange]:
        """Every change since the last call, oldest first; waits up to ``timeout`` seconds for one."""
        with self._cv:
            if not self._changes:
                self._cv.wait(timeout)
            changes, self._changes = self._changes, []
            out: list[PageChange] = []
            touched: dict[bytes, None] = {}  # the pages whose tiers changed, in order
            for digest, tier, stored in changes:
                held = self._held.setdefault(digest, set())
                if stored:
                    if tier in held:  # already announced there (re-published in place)
                        continue
                    held.add(tier)
                    out.append(PageChange(digest, tier, True, self._info.get(digest)))
                    touched[digest] = None
                    continue
                if tier not in held:
                    if not held:
                        del self._held[digest]
                    continue
                held.discard(tier)
                if not held:  # its last tier: forget the page (its tokens at the end of the batch)
                    del self._held[digest]
                out.append(PageChange(digest, tier, False, None))
                touched[digest] = None
            for digest in touched:  # how the batch left each page it changed
                held = self._held.get(digest)
                shared_only = held is not None and len(held) == 1 and SHARED in held
                if held is None or shared_only:  # on no local tier: its tokens go
                    self._info.pop(digest, None)
                self._shared_only.pop(digest, None)
                if shared_only:
                    self._shared_only[digest] = None  # the newest of them
            while len(self._shared_only) > self.shared_pages:  # the oldest announced go, without an event
                oldest = next(iter(self._shared_only))
                del self._shared_only[oldest]
                del self._held[oldest]
            return out

    def wake(self) -> None:
        """Wake a ``take`` waiting (the publisher is stopping)."""
        with self._cv:
            self._cv.notify_all()
