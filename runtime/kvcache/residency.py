"""Which tiers hold a copy of each block: the block table, and the bookkeeping half of every byte movement.

``Residency`` owns the block table (block -> copies per tier), the slot owners, pins, the ``needed``
flag, the dense page ids (``BlockIndex``) and the bookkeeping of eviction. It never moves a byte and never
calls a tier's ``read``, ``write``, ``discard`` or ``resize``: ``kvdrive.runtime.pipeline.Mover`` runs every
movement as

- *prepare*, under the lock (here): choose victims, reserve destination slots (a copy that is not
  ``ready`` is invisible to readers), pin the sources;
- *run*, without the lock (the Mover): the tiers read and write;
- *complete*, under the lock (here): publish the new copies, unpin, drop what was demoted.

A dropped copy's slot is not handed out again at once: it is queued (``take_freed``) until the Mover has
told the tier (``discard``: the SSD tier forgets its index entry) outside the lock, then released
(``release_freed``), so that a slot is never rewritten before its old record is gone.

Eviction takes victims in ``victim_order`` (placement's order) or least-recently-used order, and frees
slots in batches so one sort serves many evictions. What becomes of each victim (dropped, demoted and to
which tier, kept) is the ``VictimRules`` placement passes in; this table applies it.

Thread rule: a *published* copy in a memory tier is dropped only by the thread bound with ``bind_owner``
(the engine's), because the decode loop reads memory-tier slots without the lock. Background jobs only
publish into slots the owner reserved for them, and work the SSD tier.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import torch

from kvdrive.runtime.kvcache.block_index import MEMORY_TIERS, BlockIndex
from kvdrive.runtime.kvcache.budgets import TIER_ORDER, TierBudgets, TierName
from kvdrive.runtime.kvcache.keys import BlockKey
from kvdrive.runtime.kvcache.page_events import PageEvents
from kvdrive.runtime.kvcache.tiers.base import Tier

log = logging.getLogger(__name__)

EVICT_BATCH_FRACTION = 8  # a full tier with a tier below frees capacity/8 slots at once (demotions: nothing lost)
LAST_TIER_EVICT_FRACTION = 64  # the last tier drops what it evicts: capacity/64 at once


@dataclass(frozen=True)
class Copy:
    slot: int
    ready: bool


@dataclass
class Block:
    key: BlockKey
    pid: int
    copies: dict[TierName, Copy] = field(default_factory=dict)
    pins: int = 0
    needed: bool = True
    persistent: bool = False
    last_use: int = 0


@dataclass(frozen=True)
class Move:
    """One block's bytes from a slot of one tier to a reserved slot of another."""

    block: Block
    src: TierName
    src_slot: int
    dst: TierName
    dst_slot: int
    demote: bool  # drop the source copy once the destination copy is published


VictimOrder = Callable[[TierName, list[Block]], list[Block]]  # candidates -> coldest first
ColdestOf = Callable[[TierName, int], list[tuple[int, int]]]  # memory tier, k -> k coldest (page id, layer)


class Fate(Enum):
    """What becomes of a victim of a full tier."""

    DROP = "drop"  # a clean copy sits below: nothing is lost
    DEMOTE = "demote"  # its bytes move to a tier below
    RECOMPUTE = "recompute"  # dropped although no copy is left: nobody needs it, it is recomputed if asked again
    KEEP = "keep"  # it stays: a running sequence needs it and it has nowhere to go


class VictimRules(Protocol):
    """Placement's rules for the victims of a full tier (``kvdrive.runtime.placement.demotion``)."""

    def targets(self, tier: TierName, tiers: dict[TierName, Tier]) -> list[TierName]:
        """The tiers a victim of ``tier`` may go down to, nearest first."""
        ...

    def fate(self, targets: list[TierName], ready: Collection[TierName], needed: bool, room_below: bool) -> Fate:
        """A victim's fate, given the tiers it may go to, the tiers holding a ready copy of it, whether a running
        sequence needs it, and whether a slot below can still be had."""
        ...


@dataclass(frozen=True)
class Victims:
    """One eviction pass over a full tier: the victims to demote (their fate), and the tier's free slots
    before the pass."""

    demote: list[Block]
    targets: list[TierName]
    dropped: int
    free_before: int


class Residency:
    tiers: dict[TierName, Tier]
    budgets: TierBudgets
    block_bytes: int
    device: torch.device

    def __init__(self, victim_order: VictimOrder | None, index: BlockIndex) -> None:
        self.victim_order = victim_order
        self.coldest_of: ColdestOf | None = None  # placement's ranking of a memory tier, from its tensors
        self.index = index
        self._lock = threading.RLock()
        self._blocks: dict[BlockKey, Block] = {}
        # kept as copies come and go, ``needed`` flips and pins change (what usage() and a budget check read,
        # without a walk over the blocks):
        self._copies_in: dict[TierName, int] = {}  # blocks with a copy (ready or reserved) in the tier
        self._needed_in: dict[TierName, int] = {}  # ... of them needed by a running sequence
        self._needed_blocks = 0  # blocks needed by a running sequence
        self._pinned: dict[int, Block] = {}  # id(block) -> block, for every pinned block
        self._owner: dict[tuple[TierName, int], BlockKey] = {}
        self._freed: list[tuple[TierName, int]] = []  # dropped copies' slots, not yet discarded and released
        self._clock = 0
        self._owner_thread: int | None = None
        self.transfer_bytes: dict[tuple[str, str], int] = {}
        self.dropped = 0
        self.page_events: PageEvents | None = None  # told when a page's layer-0 block gains or loses a tier

    def bind_owner(self) -> None:
        """The calling thread runs the decode loop: only it may drop published memory-tier copies."""
        self._owner_thread = threading.get_ident()

    # --- block table (lock held) -----------------------------------------------------------------
    def _fastest(self, b: Block) -> TierName | None:
        return next((t for t in TIER_ORDER if t in b.copies and b.copies[t].ready), None)

    def _touch(self, b: Block) -> None:
        self._clock += 1
        b.last_use = self._clock

    def _pin(self, b: Block) -> None:
        b.pins += 1
        self._pinned[id(b)] = b

    def _unpin(self, b: Block) -> None:
        b.pins -= 1
        if not b.pins:
            self._pinned.pop(id(b), None)

    def _new_block(self, key: BlockKey, needed: bool, persistent: bool) -> Block:
        b = Block(key, self.index.acquire(key.digest), needed=needed, persistent=persistent)
        self._blocks[key] = b
        self._needed_blocks += needed
        return b

    def _forget(self, b: Block) -> None:
        """A block without copies leaves the table (lock held)."""
        del self._blocks[b.key]
        self._needed_blocks -= b.needed
        self.index.release(b.pid)

    def _set_copy(self, b: Block, tier: TierName, copy: Copy) -> None:
        """Every copy of a block is set here (and removed in ``_drop``): the per-tier counts follow."""
        if tier not in b.copies:
            self._copies_in[tier] = self._copies_in.get(tier, 0) + 1
            self._needed_in[tier] = self._needed_in.get(tier, 0) + b.needed
        b.copies[tier] = copy

    def _set_needed(self, b: Block, needed: bool) -> None:
        if b.needed != needed:
            for tier in b.copies:
                self._needed_in[tier] += 1 if needed else -1
            self._needed_blocks += 1 if needed else -1
            b.needed = needed

    def _reserve(self, b: Block, tier: TierName) -> int | None:
        """A free slot of ``tier`` for a not-yet-readable copy of ``b`` (no eviction)."""
        slot = self.tiers[tier].allocator.alloc()
        if slot is not None:
            self._owner[(tier, slot)] = b.key
            self._set_copy(b, tier, Copy(slot, False))
        return slot

    def _publish(self, b: Block, tier: TierName, slot: int) -> None:
        old = b.copies.get(tier)
        if old is not None and old.ready and old.slot != slot and tier in MEMORY_TIERS:  # moved within the tier
            self.index.unplace(tier, b.pid, b.key.layer, old.slot)
        self._set_copy(b, tier, Copy(slot, True))
        if tier in MEMORY_TIERS:
            self.index.place(tier, b.pid, b.key.layer, slot)
        if self.page_events is not None and b.key.layer == 0 and (old is None or not old.ready):
            self.page_events.changed(b.key.digest, tier, True)

    def _drop(self, b: Block, tier: TierName) -> None:
        """Remove ``b``'s copy in ``tier``; its slot waits in ``_freed`` for the Mover to discard and release."""
        c = b.copies.pop(tier)
        self._copies_in[tier] -= 1
        self._needed_in[tier] -= b.needed
        if c.ready and tier in MEMORY_TIERS:
            if self._owner_thread is not None and threading.get_ident() != self._owner_thread:
                raise RuntimeError(f"a published {tier} copy of {b.key} dropped off the owner thread")
            self.index.unplace(tier, b.pid, b.key.layer, c.slot)
        del self._owner[(tier, c.slot)]
        self._freed.append((tier, c.slot))
        if self.page_events is not None and b.key.layer == 0 and c.ready:
            self.page_events.changed(b.key.digest, tier, False)
        if not b.copies:
            self._forget(b)

    def _count(self, src: str, dst: str, n: int) -> None:
        k = (src, dst)
        self.transfer_bytes[k] = self.transfer_bytes.get(k, 0) + n * self.block_bytes

    # --- freed slots -----------------------------------------------------------------------------
    def take_freed(self) -> list[tuple[TierName, int]]:
        """The (tier, slot) of every copy dropped since the last call: the caller discards each from its tier
        (no lock held), then hands them to ``release_freed``."""
        with self._lock:
            freed, self._freed = self._freed, []
            return freed

    def release_freed(self, freed: list[tuple[TierName, int]]) -> None:
        """Discarded slots go back to their tiers' allocators."""
        if freed:
            with self._lock:
                for tier, slot in freed:
                    self.tiers[tier].allocator.release(slot)

    def free_slots(self, tier: TierName) -> int:
        with self._lock:
            return self.tiers[tier].allocator.free_count

    # --- victims (lock held) ---------------------------------------------------------------------
    def _evict_batch(self, tier: TierName, rules: VictimRules) -> int:
        """Slots one eviction pass frees: a pass walks and sorts the whole tier, so it frees many slots
        at once where victims are demoted (kept below), few in the last tier where they are dropped."""
        frac = EVICT_BATCH_FRACTION if rules.targets(tier, self.tiers) else LAST_TIER_EVICT_FRACTION
        return max(1, self.tiers[tier].allocator.capacity // frac)

    def _candidates(self, tier: TierName, want: int | None = None) -> list[Block]:
        """Unpinned blocks with a ready copy in ``tier``, in eviction order (at least ``want`` of them when
        that many exist). A memory tier asks placement for its coldest residents (a ``topk`` over tensors:
        work in proportion to ``want``); otherwise the tier's slots are walked and sorted."""
        if want is not None and self.coldest_of is not None and tier in MEMORY_TIERS:
            ranked = self.coldest_of(tier, 2 * want + 16)
            digests, blocks = self.index.digests, self._blocks
            out = []
            for pid, layer in ranked:
                d = digests[pid]
                b = blocks.get(BlockKey(d, layer)) if d is not None else None
                if b is not None and b.pins == 0 and tier in b.copies and b.copies[tier].ready:
                    out.append(b)
            if len(out) >= want:
                return out
        cap = self.tiers[tier].allocator.capacity
        blocks = self._blocks
        if cap < len(blocks):  # walk the tier's slots, not every block of every tier
            owner = self._owner
            held = (blocks.get(k) for k in (owner.get((tier, s)) for s in range(cap)) if k is not None)
            cands = [b for b in held if b is not None and b.pins == 0 and tier in b.copies and b.copies[tier].ready]
        else:
            cands = [b for b in blocks.values() if b.pins == 0 and tier in b.copies and b.copies[tier].ready]
        cands.sort(key=lambda b: b.last_use)  # LRU; a victim order re-sorts stably (ties stay LRU)
        return cands if self.victim_order is None or not cands else self.victim_order(tier, cands)

    def choose_victims(self, tier: TierName, n: int, rules: VictimRules, batch: bool = True,
                       stalled: bool = False) -> Victims | None:
        """One eviction pass toward ``n`` free slots of ``tier``: victims that ``rules`` drop are dropped now,
        those it demotes are returned (the tier below makes room, then ``prepare_demotions``). None when ``n``
        slots are already free. ``batch``: aim for a batch of slots (one sort serves many evictions).
        ``stalled``: the last pass freed nothing, so needed victims with no copy below are skipped."""
        with self._lock:
            alloc = self.tiers[tier].allocator
            free_before = alloc.free_count
            short = n - free_before
            if short <= 0:
                return None
            # a tier walked in Python frees a batch per pass (one sort serves many evictions); a memory tier
            # ranked by placement's tensors frees just what is asked (no copies made before they are needed)
            ranked = self.coldest_of is not None and tier in MEMORY_TIERS
            want = max(short, self._evict_batch(tier, rules)) if batch and not ranked else short
            lower = rules.targets(tier, self.tiers)
            demote: list[Block] = []
            dropped = 0
            seen: set[int] = set()
            for cands in (self._candidates(tier, want), None):  # the ranked few, then (if short) the tier
                for b in cands if cands is not None else self._candidates(tier):
                    if dropped + len(demote) >= want:
                        break
                    if id(b) in seen or b.key not in self._blocks or tier not in b.copies:
                        continue
                    ready = [t for t in b.copies if b.copies[t].ready]
                    if stalled and b.needed and not any(t in ready for t in lower):
                        continue  # cannot move now (the tiers below are full of needed blocks): skip it
                    seen.add(id(b))
                    fate = rules.fate(lower, ready, b.needed, room_below=bool(lower))
                    if fate is Fate.DEMOTE:
                        demote.append(b)
                    elif fate is not Fate.KEEP:
                        self.dropped += fate is Fate.RECOMPUTE
                        self._drop(b, tier)
                        dropped += 1
                if dropped + len(demote) >= want or not ranked:
                    break
            return Victims(demote, lower, dropped, free_before)

    def prepare_demotions(self, tier: TierName, victims: Victims, rules: VictimRules) -> list[Move]:
        """Reserve a slot below each victim still evictable (the nearest target with room); a victim that gets
        none meets ``rules`` again, without room below (dropped if a clean copy is deeper or nobody needs it)."""
        moves: list[Move] = []
        with self._lock:
            for b in victims.demote:
                c = b.copies.get(tier)
                if b.key not in self._blocks or c is None or not c.ready or b.pins:
                    continue  # changed since it was chosen
                dst, slot = None, None
                for t in victims.targets:
                    if t not in b.copies:
                        slot = self._reserve(b, t)
                        if slot is not None:
                            dst = t
                            break
                if dst is not None and slot is not None:
                    self._pin(b)
                    moves.append(Move(b, tier, c.slot, dst, slot, demote=True))
                    continue
                ready = [t for t in b.copies if b.copies[t].ready]
                fate = rules.fate(victims.targets, ready, b.needed, room_below=False)
                if fate in (Fate.DROP, Fate.RECOMPUTE):
                    if fate is Fate.RECOMPUTE:
                        self.dropped += 1
                        log.debug("dropped %s from %s (recomputable)", b.key, tier)
                    self._drop(b, tier)
        return moves

    def complete(self, moves: list[Move], ok: list[bool]) -> None:
        """Publish the copies that arrived, release the reservations that did not, unpin, and drop the
        demoted sources."""
        with self._lock:
            for m, good in zip(moves, ok, strict=True):
                b = m.block
                self._unpin(b)
                if good:
                    self._publish(b, m.dst, m.dst_slot)
                    self._count(m.src, m.dst, 1)
                    if m.demote and m.src in b.copies and b.copies[m.src].slot == m.src_slot:
                        self._drop(b, m.src)
                elif m.dst in b.copies and b.copies[m.dst].slot == m.dst_slot:
                    self._drop(b, m.dst)  # a reservation never published: safe from any thread
