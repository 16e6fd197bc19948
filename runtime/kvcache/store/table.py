"""The block table: which tiers hold a copy of each block, and the bookkeeping half of every byte movement.

``BlockTable`` owns the table (block -> copies per tier), the slot owners, pins, the ``needed`` flag, the
dense page ids (``BlockIndex``) and the bookkeeping of eviction: the *prepare* and *complete* phases of
``kvcache.contract`` for puts, promotions and demotions. It never moves a byte. Its primitives (``pin``,
``reserve_slot``, ``publish``, ``drop``, ...) are called with ``lock`` held, by the table itself and by the
store's other parts (``ReadBook``, ``ResizeBook``, ``BlockStore``), which share this one table.

Eviction takes victims least recently used first, re-sorted by placement's order (``Eviction.order``), or
from placement's ranking of a memory tier (``Eviction.coldest``); what becomes of each victim (dropped,
demoted and to which tier, kept) and how many a pass frees are placement's ``Eviction`` too: this table
applies them.
"""

from __future__ import annotations

import logging
import threading

from kvdrive.runtime.kvcache.contract import Block, Copy, Eviction, Fate, Move, Victims
from kvdrive.runtime.kvcache.store.block_index import MEMORY_TIERS, BlockIndex
from kvdrive.runtime.kvcache.store.budgets import TIER_ORDER, TierName
from kvdrive.runtime.kvcache.store.keys import BlockKey
from kvdrive.runtime.kvcache.store.page_events import PageEvents
from kvdrive.runtime.kvcache.store.tiers.base import Tier

log = logging.getLogger(__name__)


class BlockTable:
    def __init__(self, tiers: dict[TierName, Tier], index: BlockIndex, eviction: Eviction, block_bytes: int) -> None:
        """``eviction``: placement's choices for a full tier (``contract.Eviction``)."""
        self.tiers = tiers
        self.index = index
        self.eviction = eviction
        self.block_bytes = block_bytes
        self.lock = threading.RLock()
        self.blocks: dict[BlockKey, Block] = {}
        # kept as copies come and go, ``needed`` flips and pins change (what usage() and a budget check read,
        # without a walk over the blocks):
        self.copies_in: dict[TierName, int] = {}  # blocks with a copy (ready or reserved) in the tier
        self.needed_in: dict[TierName, int] = {}  # ... of them needed by a running sequence
        self.needed_blocks = 0  # blocks needed by a running sequence
        self.pinned: dict[int, Block] = {}  # id(block) -> block, for every pinned block
        self.owner: dict[tuple[TierName, int], BlockKey] = {}
        self.freed: list[tuple[TierName, int]] = []  # dropped copies' slots, not yet discarded and released
        self._clock = 0
        self._owner_thread: int | None = None
        self.transfer_bytes: dict[tuple[str, str], int] = {}
        self.dropped = 0
        self.page_events: PageEvents | None = None  # told when a page's layer-0 block gains or loses a tier

    def bind_owner(self) -> None:
        """The calling thread runs the decode loop: only it may drop published memory-tier copies."""
        self._owner_thread = threading.get_ident()

    # --- block table (lock held) -----------------------------------------------------------------
    def fastest(self, b: Block) -> TierName | None:
        return next((t for t in TIER_ORDER if t in b.copies and b.copies[t].ready), None)

    def touch(self, b: Block) -> None:
        self._clock += 1
        b.last_use = self._clock

    def pin(self, b: Block) -> None:
        b.pins += 1
        self.pinned[id(b)] = b

    def unpin(self, b: Block) -> None:
        b.pins -= 1
        if not b.pins:
            self.pinned.pop(id(b), None)

    def new_block(self, key: BlockKey, needed: bool, persistent: bool) -> Block:
        b = Block(key, self.index.acquire(key.digest), needed=needed, persistent=persistent)
        self.blocks[key] = b
        self.needed_blocks += needed
        return b

    def forget(self, b: Block) -> None:
        """A block without copies leaves the table (lock held)."""
        del self.blocks[b.key]
        self.needed_blocks -= b.needed
        self.index.release(b.pid)

    def set_copy(self, b: Block, tier: TierName, copy: Copy) -> None:
        """Every copy of a block is set here (and removed in ``_drop``): the per-tier counts follow."""
        if tier not in b.copies:
            self.copies_in[tier] = self.copies_in.get(tier, 0) + 1
            self.needed_in[tier] = self.needed_in.get(tier, 0) + b.needed
        b.copies[tier] = copy

    def mark_needed(self, b: Block, needed: bool) -> None:
        if b.needed != needed:
            for tier in b.copies:
                self.needed_in[tier] += 1 if needed else -1
            self.needed_blocks += 1 if needed else -1
            b.needed = needed

    def reserve_slot(self, b: Block, tier: TierName) -> int | None:
        """A free slot of ``tier`` for a not-yet-readable copy of ``b`` (no eviction)."""
        slot = self.tiers[tier].allocator.alloc()
        if slot is not None:
            self.owner[(tier, slot)] = b.key
            self.set_copy(b, tier, Copy(slot, False))
        return slot

    def publish(self, b: Block, tier: TierName, slot: int) -> None:
        old = b.copies.get(tier)
        if old is not None and old.ready and old.slot != slot and tier in MEMORY_TIERS:  # moved within the tier
            self.index.unplace(tier, b.pid, b.key.layer, old.slot)
        self.set_copy(b, tier, Copy(slot, True))
        if tier in MEMORY_TIERS:
            self.index.place(tier, b.pid, b.key.layer, slot)
        if self.page_events is not None and b.key.layer == 0 and (old is None or not old.ready):
            self.page_events.changed(b.key.digest, tier, True)

    def drop(self, b: Block, tier: TierName) -> None:
        """Remove ``b``'s copy in ``tier``; its slot waits in ``_freed`` for the Mover to discard and release."""
        c = b.copies.pop(tier)
        self.copies_in[tier] -= 1
        self.needed_in[tier] -= b.needed
        if c.ready and tier in MEMORY_TIERS:
            if self._owner_thread is not None and threading.get_ident() != self._owner_thread:
                raise RuntimeError(f"a published {tier} copy of {b.key} dropped off the owner thread")
            self.index.unplace(tier, b.pid, b.key.layer, c.slot)
        del self.owner[(tier, c.slot)]
        self.freed.append((tier, c.slot))
        if self.page_events is not None and b.key.layer == 0 and c.ready:
            self.page_events.changed(b.key.digest, tier, False)
        if not b.copies:
            self.forget(b)

    def count_transfer(self, src: str, dst: str, n: int) -> None:
        k = (src, dst)
        self.transfer_bytes[k] = self.transfer_bytes.get(k, 0) + n * self.block_bytes

    # --- freed slots -----------------------------------------------------------------------------
    def take_freed(self) -> list[tuple[TierName, int]]:
        """The (tier, slot) of every copy dropped since the last call: the caller discards each from its tier
        (no lock held), then hands them to ``release_freed``."""
        with self.lock:
            freed, self.freed = self.freed, []
            return freed

    def release_freed(self, freed: list[tuple[TierName, int]]) -> None:
        """Discarded slots go back to their tiers' allocators."""
        if freed:
            with self.lock:
                for tier, slot in freed:
                    self.tiers[tier].allocator.release(slot)

    def free_slots(self, tier: TierName) -> int:
        with self.lock:
            return self.tiers[tier].allocator.free_count

    # --- victims (lock held) ---------------------------------------------------------------------
    def _candidates(self, tier: TierName, want: int | None = None) -> list[Block]:
        """Unpinned blocks with a ready copy in ``tier``, in eviction order (at least ``want`` of them when
        that many exist). A memory tier asks placement for its coldest residents (a ``topk`` over tensors:
        work in proportion to ``want``); otherwise the tier's slots are walked and sorted."""
        if want is not None and tier in MEMORY_TIERS and self.eviction.ranks(tier):
            ranked = self.eviction.coldest(tier, 2 * want + 16)
            digests, blocks = self.index.digests, self.blocks
            out = []
            for pid, layer in ranked:
                d = digests[pid]
                b = blocks.get(BlockKey(d, layer)) if d is not None else None
                if b is not None and b.pins == 0 and tier in b.copies and b.copies[tier].ready:
                    out.append(b)
            if len(out) >= want:
                return out
        cap = self.tiers[tier].allocator.capacity
        blocks = self.blocks
        if cap < len(blocks):  # walk the tier's slots, not every block of every tier
            owner = self.owner
            held = (blocks.get(k) for k in (owner.get((tier, s)) for s in range(cap)) if k is not None)
            cands = [b for b in held if b is not None and b.pins == 0 and tier in b.copies and b.copies[tier].ready]
        else:
            cands = [b for b in blocks.values() if b.pins == 0 and tier in b.copies and b.copies[tier].ready]
        cands.sort(key=lambda b: b.last_use)  # LRU; placement's order re-sorts stably (ties stay LRU)
        return self.eviction.order(tier, cands) if cands else cands

    def choose_victims(self, tier: TierName, n: int, batch: bool = True, stalled: bool = False) -> Victims | None:
        """One eviction pass toward ``n`` free slots of ``tier``: victims that placement's rules drop are dropped now,
        those it demotes are returned (the tier below makes room, then ``prepare_demotions``). None when ``n``
        slots are already free. ``batch``: aim for a batch of slots (one sort serves many evictions).
        ``stalled``: the last pass freed nothing, so needed victims with no copy below are skipped."""
        with self.lock:
            alloc = self.tiers[tier].allocator
            free_before = alloc.free_count
            short = n - free_before
            if short <= 0:
                return None
            # a tier walked in Python frees a batch per pass (one sort serves many evictions); a memory tier
            # ranked by placement's tensors frees just what is asked (no copies made before they are needed)
            rules = self.eviction
            ranked = tier in MEMORY_TIERS and rules.ranks(tier)
            lower = rules.targets(tier, self.tiers)
            want = max(short, rules.batch(tier, alloc.capacity, bool(lower))) if batch and not ranked else short
            demote: list[Block] = []
            dropped = 0
            seen: set[int] = set()
            for cands in (self._candidates(tier, want), None):  # the ranked few, then (if short) the tier
                for b in cands if cands is not None else self._candidates(tier):
                    if dropped + len(demote) >= want:
                        break
                    if id(b) in seen or b.key not in self.blocks or tier not in b.copies:
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
                        self.drop(b, tier)
                        dropped += 1
                if dropped + len(demote) >= want or not ranked:
                    break
            return Victims(demote, lower, dropped, free_before)

    def prepare_demotions(self, tier: TierName, victims: Victims) -> list[Move]:
        """Reserve a slot below each victim still evictable (the nearest target with room); a victim that gets
        none meets ``rules`` again, without room below (dropped if a clean copy is deeper or nobody needs it)."""
        moves: list[Move] = []
        with self.lock:
            for b in victims.demote:
                c = b.copies.get(tier)
                if b.key not in self.blocks or c is None or not c.ready or b.pins:
                    continue  # changed since it was chosen
                dst, slot = None, None
                for t in victims.targets:
                    if t not in b.copies:
                        slot = self.reserve_slot(b, t)
                        if slot is not None:
                            dst = t
                            break
                if dst is not None and slot is not None:
                    self.pin(b)
                    moves.append(Move(b, tier, c.slot, dst, slot, demote=True))
                    continue
                ready = [t for t in b.copies if b.copies[t].ready]
                fate = self.eviction.fate(victims.targets, ready, b.needed, room_below=False)
                if fate in (Fate.DROP, Fate.RECOMPUTE):
                    if fate is Fate.RECOMPUTE:
                        self.dropped += 1
                        log.debug("dropped %s from %s (recomputable)", b.key, tier)
                    self.drop(b, tier)
        return moves

    def complete(self, moves: list[Move], ok: list[bool]) -> None:
        """Publish the copies that arrived, release the reservations that did not, unpin, and drop the
        demoted sources."""
        with self.lock:
            for m, good in zip(moves, ok, strict=True):
                b = m.block
                self.unpin(b)
                if good:
                    self.publish(b, m.dst, m.dst_slot)
                    self.count_transfer(m.src, m.dst, 1)
                    if m.demote and m.src in b.copies and b.copies[m.src].slot == m.src_slot:
                        self.drop(b, m.src)
                elif m.dst in b.copies and b.copies[m.dst].slot == m.dst_slot:
                    self.drop(b, m.dst)  # a reservation never published: safe from any thread
