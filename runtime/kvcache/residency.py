"""Which tiers hold a copy of each block, and how a full tier makes room (the store's bookkeeping half).

``Residency`` owns the block table (block -> copies per tier), the slot owners, pins, the ``needed``
flag, the dense page ids (``BlockIndex``) and eviction. Every byte movement follows one protocol:

- *prepare*, under the lock: choose victims, reserve destination slots (a copy that is not ``ready``
  is invisible to readers), pin the sources;
- *run*, without the lock: the tiers read and write;
- *complete*, under the lock: publish the new copies, unpin, drop what was demoted.

No tier I/O ever runs under the lock. Eviction takes victims in ``victim_order`` (placement's decision)
or least-recently-used order, and frees slots in batches so one sort serves many evictions. A victim is
demoted to the next tier down that has room (the hierarchy gpu -> dram -> ssd is kept even when a
deeper clean copy exists), dropped when a clean copy already sits right below, and dropped as
recomputable only when no running sequence needs it. Live budget changes (grow, shrink with demotion,
compaction) are ``LiveResize`` (``live_resize.py``), on this table. The data half (put/fetch/promote) is
``TieredKVStore``.

Thread rule: a *published* copy in a memory tier is dropped (its slot freed) only by the thread bound
with ``bind_owner`` (the engine's), because the decode loop reads memory-tier slots without the lock.
Background jobs only publish into slots the owner reserved for them, and work the SSD tier.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvdrive.runtime.kvcache.block_index import MEMORY_TIERS, BlockIndex
from kvdrive.runtime.kvcache.budgets import TIER_ORDER, TierBudgets, TierName
from kvdrive.runtime.kvcache.keys import BlockKey
from kvdrive.runtime.kvcache.tiers.base import Tier, TierIOError

log = logging.getLogger(__name__)

EVICT_BATCH_FRACTION = 8  # a full tier with a tier below frees capacity/8 slots at once (demotions: nothing lost)
LAST_TIER_EVICT_FRACTION = 64  # the last tier drops what it evicts: capacity/64 at once
ROOM_ATTEMPTS = 4  # passes of make-room before giving up (other threads may take freed slots meanwhile)


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
        # per tier, kept as copies come and go and ``needed`` flips (what usage() reports, without a walk):
        self._copies_in: dict[TierName, int] = {}  # blocks with a copy (ready or reserved) in the tier
        self._needed_in: dict[TierName, int] = {}  # ... of them needed by a running sequence
        self._owner: dict[tuple[TierName, int], BlockKey] = {}
        self._clock = 0
        self._owner_thread: int | None = None
        self.transfer_bytes: dict[tuple[str, str], int] = {}
        self.dropped = 0

    def bind_owner(self) -> None:
        """The calling thread runs the decode loop: only it may drop published memory-tier copies."""
        self._owner_thread = threading.get_ident()

    # --- block table (lock held) -----------------------------------------------------------------
    def _fastest(self, b: Block) -> TierName | None:
        return next((t for t in TIER_ORDER if t in b.copies and b.copies[t].ready), None)

    def _touch(self, b: Block) -> None:
        self._clock += 1
        b.last_use = self._clock

    def _lower(self, tier: TierName) -> list[TierName]:
        return [t for t in TIER_ORDER[TIER_ORDER.index(tier) + 1 :] if t in self.tiers]

    def _new_block(self, key: BlockKey, needed: bool, persistent: bool) -> Block:
        b = Block(key, self.index.acquire(key.digest), needed=needed, persistent=persistent)
        self._blocks[key] = b
        return b

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

    def _drop(self, b: Block, tier: TierName) -> None:
        c = b.copies.pop(tier)
        self._copies_in[tier] -= 1
        self._needed_in[tier] -= b.needed
        if c.ready and tier in MEMORY_TIERS:
            if self._owner_thread is not None and threading.get_ident() != self._owner_thread:
                raise RuntimeError(f"a published {tier} copy of {b.key} dropped off the owner thread")
            self.index.unplace(tier, b.pid, b.key.layer, c.slot)
        t = self.tiers[tier]
        t.discard(c.slot)
        t.allocator.release(c.slot)
        del self._owner[(tier, c.slot)]
        if not b.copies:
            del self._blocks[b.key]
            self.index.release(b.pid)

    def _count(self, src: str, dst: str, n: int) -> None:
        k = (src, dst)
        self.transfer_bytes[k] = self.transfer_bytes.get(k, 0) + n * self.block_bytes

    # --- victims (lock held) ---------------------------------------------------------------------
    def _evict_batch(self, tier: TierName) -> int:
        """Slots one eviction pass frees: a pass walks and sorts the whole tier, so it frees many slots
        at once where victims are demoted (kept below), few in the last tier where they are dropped."""
        frac = EVICT_BATCH_FRACTION if self._lower(tier) else LAST_TIER_EVICT_FRACTION
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

    # --- making room -----------------------------------------------------------------------------
    def _make_room(self, tier: TierName, n: int, batch: bool = True) -> bool:
        """Free slots until ``tier`` has ``n`` free (lock not held on entry). Victims with a clean copy
        right below are dropped at once; the others are demoted (the tier below makes room first, the
        copies run outside the lock); unneeded victims with nowhere to go are dropped as recomputable.
        ``batch``: free at least a batch of slots (one sort serves many evictions). Returns whether
        ``n`` slots are free."""
        alloc = self.tiers[tier].allocator
        stalled = False  # the last pass freed nothing: its victims were needed blocks with nowhere to go
        for _ in range(ROOM_ATTEMPTS):
            with self._lock:
                free_before = alloc.free_count
                short = n - alloc.free_count
                if short <= 0:
                    return True
                # a tier walked in Python frees a batch per pass (one sort serves many evictions); a memory tier
                # ranked by placement's tensors frees just what is asked (no copies made before they are needed)
                ranked = self.coldest_of is not None and tier in MEMORY_TIERS
                want = max(short, self._evict_batch(tier)) if batch and not ranked else short
                # a failing tier (recent I/O faults) takes no demotions: its writes fail, and a victim that
                # waits for one would hold its slot forever; unneeded victims are dropped instead
                lower = [t for t in self._lower(tier) if self.tiers[t].allocator.capacity > 0
                         and not self.tiers[t].failing()]
                demote: list[Block] = []
                freed = 0
                seen: set[int] = set()
                for cands in (self._candidates(tier, want), None):  # the ranked few, then (if short) the tier
                    for b in cands if cands is not None else self._candidates(tier):
                        if freed + len(demote) >= want:
                            break
                        if id(b) in seen or b.key not in self._blocks or tier not in b.copies:
                            continue
                        if stalled and b.needed and not any(t in b.copies and b.copies[t].ready for t in lower):
                            continue  # cannot move now (the tiers below are full of needed blocks): skip it
                        seen.add(id(b))
                        if lower and lower[0] in b.copies and b.copies[lower[0]].ready:
                            self._drop(b, tier)  # a clean copy sits right below
                            freed += 1
                        elif lower:
                            demote.append(b)
                        elif not b.needed:
                            self._drop(b, tier)
                            self.dropped += 1
                            freed += 1
                    if freed + len(demote) >= want or not ranked:
                        break
            if demote:
                self._make_room(lower[0], len(demote))
                moves = self._prepare_demotions(tier, demote, lower)
                if moves:
                    self._complete(moves, self._run_moves(moves))
            with self._lock:
                if alloc.free_count >= n:
                    return True
                if not demote and not freed:
                    return False  # nothing evictable
                stalled = alloc.free_count <= free_before
        with self._lock:
            return alloc.free_count >= n

    def _prepare_demotions(self, tier: TierName, victims: list[Block], lower: list[TierName]) -> list[Move]:
        """Reserve a slot below each victim still evictable; victims that cannot move but have a clean
        copy deeper, or that nobody needs, are dropped instead."""
        moves: list[Move] = []
        with self._lock:
            for b in victims:
                c = b.copies.get(tier)
                if b.key not in self._blocks or c is None or not c.ready or b.pins:
                    continue  # changed since it was chosen
                dst, slot = None, None
                for t in lower:  # the next tier down that has room
                    if t not in b.copies:
                        slot = self._reserve(b, t)
                        if slot is not None:
                            dst = t
                            break
                if dst is not None and slot is not None:
                    b.pins += 1
                    moves.append(Move(b, tier, c.slot, dst, slot, demote=True))
                    continue
                backed = any(t in b.copies and b.copies[t].ready for t in lower)
                if backed or not b.needed:
                    if not backed:
                        self.dropped += 1
                        log.debug("dropped %s from %s (recomputable)", b.key, tier)
                    self._drop(b, tier)
        return moves

    # --- moving bytes ----------------------------------------------------------------------------
    def _run_moves(self, moves: list[Move]) -> list[bool]:
        """Copy each move's bytes (no lock: sources are pinned, destinations reserved). Grouped by
        (src, dst) tiers: one read and one write per group."""
        ok = [False] * len(moves)
        groups: dict[tuple[TierName, TierName], list[int]] = {}
        for i, m in enumerate(moves):
            groups.setdefault((m.src, m.dst), []).append(i)
        for (src, dst), idx in groups.items():
            buf = self._buffer(len(idx), self.device)  # aligned: the SSD tier reads into it in place
            read = self.tiers[src].read([moves[i].src_slot for i in idx], buf)
            good = [p for p, r in enumerate(read) if r]
            if not good:
                continue
            rows = buf if len(good) == len(idx) else buf[good]
            try:
                self.tiers[dst].write([moves[idx[p]].dst_slot for p in good], rows,
                                      [moves[idx[p]].block.key for p in good],
                                      [moves[idx[p]].block.persistent for p in good])
            except TierIOError:
                continue
            for p in good:
                ok[idx[p]] = True
        return ok

    def _complete(self, moves: list[Move], ok: list[bool]) -> None:
        """Publish the copies that arrived, release the reservations that did not, unpin, and drop the
        demoted sources."""
        with self._lock:
            for m, good in zip(moves, ok, strict=True):
                b = m.block
                b.pins -= 1
                if good:
                    self._publish(b, m.dst, m.dst_slot)
                    self._count(m.src, m.dst, 1)
                    if m.demote and m.src in b.copies and b.copies[m.src].slot == m.src_slot:
                        self._drop(b, m.src)
                elif m.dst in b.copies and b.copies[m.dst].slot == m.dst_slot:
                    self._drop(b, m.dst)  # a reservation never published: safe from any thread
