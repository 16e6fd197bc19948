"""What a KV-event stream tells consumers: which tiers hold each page, as it changes, with the page's tokens.

``PageEvents`` is the recorder between the block table and whoever publishes KV events (vLLM's ``kv_events``
wire: ``kvdrive.runtime.server.kv_event_publisher``). The block table calls ``changed`` under its lock whenever a
page's layer-0 block gains a readable copy in a tier or loses one (the same page identity the router's
``/v1/kvdrive/prefixes`` list uses: a page counts where its first layer's block is); the engine calls
``describe`` when a sequence seals a page, naming its parent page and tokens. The publisher's thread takes
the changes in order (``take``, which waits on a condition, so a change reaches the wire within a few
milliseconds) as frozen ``PageChange`` records carrying the tokens they need.

A page's tokens are kept while some tier holds it (a later copy to another tier is announced with them
too) and dropped when a batch of changes ends with it on no tier. Pages recovered from the SSD tier at start have no known
tokens: they are announced with none. Nothing here touches a tier or a tensor.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from kvdrive.runtime.kvcache.store.budgets import TierName

# described pages that never reached a tier (a failed step) are purged once the map is this much bigger
# than the pages held
SPARE_DESCRIPTIONS = 4096


@dataclass(frozen=True)
class PageInfo:
    parent: bytes | None  # the previous page's digest; None for a sequence's first page
    tokens: tuple[int, ...]  # the page's tokens (page_size of them)


@dataclass(frozen=True)
class PageChange:
    digest: bytes
    tier: TierName
    stored: bool  # True: the tier now holds the page; False: it no longer does
    info: PageInfo | None  # with ``stored``: the page's parent and tokens, when known


class PageEvents:
    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._changes: list[tuple[bytes, TierName, bool]] = []
        self._info: dict[bytes, PageInfo] = {}
        self._held: dict[bytes, set[TierName]] = {}  # page -> the tiers holding it (as announced)

    # --- producers --------------------------------------------------------------------------------------
    def describe(self, pages: Iterable[tuple[bytes, bytes | None, tuple[int, ...]]]) -> None:
        """Sealed pages' (digest, parent digest or None, tokens), before their blocks are stored."""
        with self._cv:
            for digest, parent, tokens in pages:
                self._info[digest] = PageInfo(parent, tokens)
            if len(self._info) > len(self._held) + SPARE_DESCRIPTIONS:
                self._info = {d: i for d, i in self._info.items() if d in self._held}

    def changed(self, digest: bytes, tier: TierName, stored: bool) -> None:
        """Page ``digest``'s layer-0 block gained (``stored``) or lost a readable copy in ``tier``. Called
        under the block table's lock, so changes arrive in the table's order; it only appends."""
        with self._cv:
            self._changes.append((digest, tier, stored))
            self._cv.notify()

    def seed(self, pages: Iterable[tuple[bytes, TierName]]) -> None:
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
            emptied: list[bytes] = []
            for digest, tier, stored in changes:
                held = self._held.setdefault(digest, set())
                if stored:
                    if tier in held:  # already announced there (re-published in place)
                        continue
                    held.add(tier)
                    out.append(PageChange(digest, tier, True, self._info.get(digest)))
                    continue
                if tier not in held:
                    if not held:
                        del self._held[digest]
                    continue
                held.discard(tier)
                if not held:  # its last tier: forget the page (its tokens at the end of the batch)
                    del self._held[digest]
                    emptied.append(digest)
                out.append(PageChange(digest, tier, False, None))
            for digest in emptied:
                if digest not in self._held:
                    self._info.pop(digest, None)
            return out

    def wake(self) -> None:
        """Wake a ``take`` waiting (the publisher is stopping)."""
        with self._cv:
            self._cv.notify_all()
