"""The contract between the store (bookkeeping) and the Mover (bytes), and what placement passes to both.

Read this file first: every movement of KV bytes, in any direction, runs in three phases.

1. **prepare** -- the store, under its lock (``store.table.BlockTable.lock``), never touching a tier's bytes:
   it chooses victims (``BlockTable.choose_victims``), reserves destination slots (a copy that is not
   ``ready`` is invisible to readers), pins the sources (a pinned block is never evicted, moved or
   overwritten), and plans reads (``ReadBook.plan_reads``) and resizes (``ResizeBook.check_budgets``, ``cap``,
   ``prepare_compaction``). The result is plain data: ``Move`` records, ``Victims``, a ``ReadPlan``.
2. **run** -- the Mover (``kvcache.mover``), with no lock held, on any thread: the only code that calls a
   tier's ``read``, ``write``, ``discard`` or ``resize``. It runs the prepared records and nothing else.
3. **complete** -- the store, under its lock again: publishes the copies that arrived
   (``BlockTable.complete``, ``publish_writes``, ``ReadBook.settle_reads``, ``ResizeBook.complete_compaction``),
   releases the reservations that did not, unpins, and drops what a demotion moved. A dropped copy's slot is
   queued (``take_freed``) until the Mover has discarded it from its tier, then released (``release_freed``),
   so a slot is never rewritten while its old record could be replayed.

Which tier, which victim, demote or drop, how many at once: none of that is the store's or the Mover's
choice. Placement (``kvcache.placement``) decides: what a read earns and what to prefetch as ``CopyPlan``s the
Mover carries out, and a full tier's victims as an ``Eviction`` (below) passed in when the store is built,
which the store applies while it prepares.

Thread rule: a *published* copy in a memory tier is dropped only by the thread bound with
``BlockTable.bind_owner`` (the engine's), because the decode loop reads memory-tier slots without the lock.
Background jobs (``mover.transfer.TransferQueue``) only publish into slots the owner reserved for them, and
work the SSD tier.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # annotations only: the store imports this module, so it imports nothing of the store's
    from kvdrive.runtime.kvcache.store.budgets import TierName
    from kvdrive.runtime.kvcache.store.keys import BlockKey
    from kvdrive.runtime.kvcache.store.tiers.base import Tier


@dataclass(frozen=True)
class Copy:
    """One tier's copy of a block: its slot, and whether its bytes are written (readers skip it until then)."""

    slot: int
    ready: bool


@dataclass
class Block:
    """One layer of one page, as the store's table knows it (mutated under the store lock only)."""

    key: BlockKey
    pid: int
    copies: dict[TierName, Copy] = field(default_factory=dict)
    pins: int = 0
    needed: bool = True
    persistent: bool = False
    last_use: int = 0


@dataclass(frozen=True)
class Move:
    """Prepared: one block's bytes from a slot of one tier to a reserved slot of another (or the same)."""

    block: Block
    src: TierName
    src_slot: int
    dst: TierName
    dst_slot: int
    demote: bool  # drop the source copy once the destination copy is published


class Fate(Enum):
    """What becomes of a victim of a full tier."""

    DROP = "drop"  # a clean copy sits below: nothing is lost
    DEMOTE = "demote"  # its bytes move to a tier below
    RECOMPUTE = "recompute"  # dropped although no copy is left: nobody needs it, it is recomputed if asked again
    KEEP = "keep"  # it stays: a running sequence needs it and it has nowhere to go


@dataclass(frozen=True)
class Victims:
    """Prepared: one eviction pass over a full tier: the victims to demote (to the first of ``targets`` with
    room), how many were dropped at once, and the tier's free slots before the pass."""

    demote: list[Block]
    targets: list[TierName]
    dropped: int
    free_before: int


@dataclass(frozen=True)
class CopyPlan:
    """Placement's decision (``Placer.promotion``, ``Placer.prefetch_plan``): give each of ``keys`` a copy in
    ``dst``. ``rows``: where each key sits in what the caller passed (for bytes already read). The Mover carries
    it out (``Mover.admit``, ``Mover.prepare_promote``)."""

    dst: TierName
    keys: tuple[BlockKey, ...]
    rows: tuple[int, ...] = ()


ReadPlan = dict["TierName", list[tuple[int, int]]]  # prepared: tier -> (key index, slot) of the copies it serves


class Eviction(Protocol):
    """Placement's choices for a full tier, passed to the store when it is built
    (``kvcache.placement.eviction.TierEviction``)."""

    def ranks(self, tier: TierName) -> bool:
        """Whether ``coldest`` ranks ``tier``'s residents (then a pass frees just what is asked)."""
        ...

    def coldest(self, tier: TierName, k: int) -> list[tuple[int, int]]:
        """The ``k`` coldest residents of a ranked memory tier as (page id, layer), coldest first."""
        ...

    def order(self, tier: TierName, cands: list[Block]) -> list[Block]:
        """Candidates (least recently used first) re-sorted coldest first."""
        ...

    def batch(self, tier: TierName, capacity: int, has_below: bool) -> int:
        """Slots one eviction pass of an unranked tier aims to free (one sort serves many evictions)."""
        ...

    def targets(self, tier: TierName, tiers: Mapping[TierName, Tier]) -> list[TierName]:
        """The tiers a victim of ``tier`` may go down to, nearest first."""
        ...

    def fate(self, targets: list[TierName], ready: Collection[TierName], needed: bool, room_below: bool) -> Fate:
        """A victim's fate, given the tiers it may go to, the tiers holding a ready copy of it, whether a running
        sequence needs it, and whether a slot below can still be had."""
        ...

    def replaces(self, fastest: Tier) -> bool:
        """Whether a put of a stored content-addressed page replaces its copies (whose fastest copy lies in
        ``fastest``) with the fresh bytes."""
        ...
