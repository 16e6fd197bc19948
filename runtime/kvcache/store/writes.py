"""The bookkeeping of writing blocks: what a put writes, the slots it reserves, and promotions' reservations.

The store's write part, over the shared ``BlockTable``: the *prepare* and *complete* halves (``kvcache.contract``)
of ``Mover.put`` / ``Mover.admit`` (which keys a put writes, a slot reserved per key and its block pinned, the
copies published or given up) and of ``Mover.prepare_promote`` (the blocks to promote pinned, a slot reserved
below for each as a ``Move``). It never moves a byte.
"""

from __future__ import annotations

from kvdrive.runtime.kvcache.contract import Block, Move
from kvdrive.runtime.kvcache.store.budgets import TierName
from kvdrive.runtime.kvcache.store.keys import BlockKey
from kvdrive.runtime.kvcache.store.layout import CacheFullError
from kvdrive.runtime.kvcache.store.table import BlockTable


class WriteBook:
    def __init__(self, table: BlockTable) -> None:
        self.table = table
        self.tiers = table.tiers

    # --- puts and admissions: the bookkeeping of ``Mover.put`` / ``Mover.admit`` -----------------------
    def rows_to_write(self, keys: list[BlockKey], needed: bool, persistent: bool) -> list[int]:
        """Which of ``keys`` a put writes: a persistent (content-addressed) key already stored is only touched,
        unless placement (``Eviction.replaces``) says its fastest tier's copy must be replaced by the fresh bytes; any
        other stored key has its copies dropped (its new bytes replace them)."""
        rows: list[int] = []
        with self.table.lock:
            for i, key in enumerate(keys):
                b = self.table.blocks.get(key)
                fastest = self.table.fastest(b) if b is not None else None
                if b is not None and persistent and b.persistent and fastest \
                        and not self.table.eviction.replaces(self.tiers[fastest]):
                    self.table.mark_needed(b, b.needed or needed)
                    self.table.touch(b)
                    continue
                if b is not None:
                    if b.pins:
                        raise RuntimeError(f"{key} is pinned (being read); cannot overwrite it")
                    for t in list(b.copies):
                        self.table.drop(b, t)
                rows.append(i)
        return rows

    def tiers_below(self, tier: TierName) -> list[TierName]:
        """Where blocks of ``tier`` may go down to, nearest first: placement's demotion targets (present, with
        slots, not failing)."""
        return self.table.eviction.targets(tier, self.table.tiers)

    def any_pinned(self) -> bool:
        with self.table.lock:
            return bool(self.table.pinned)

    def rows_to_admit(self, keys: list[BlockKey], tier: TierName) -> list[int]:
        """Which of ``keys`` are stored and have no ``tier`` copy yet."""
        with self.table.lock:
            return [i for i, k in enumerate(keys) if k in self.table.blocks and tier not in self.table.blocks[k].copies]

    def count_admitted(self, src: list[TierName | None], tier: TierName) -> None:
        with self.table.lock:
            for origin in src:
                if origin is not None:
                    self.table.count_transfer(origin, tier, 1)

    def reserve_writes(self, keys: list[BlockKey], rows: list[int], tier: TierName, needed: bool, persistent: bool,
                       strict: bool) -> list[tuple[int, Block, int]]:
        """Reserve a ``tier`` slot for each key (new blocks are created with ``needed`` and ``persistent``) and
        pin its block: (row, block, slot) per reservation. ``strict``: all or nothing (CacheFullError, nothing
        reserved); else keys gone meanwhile or past the last free slot are skipped."""
        todo: list[tuple[int, Block, int]] = []
        with self.table.lock:
            for key, row in zip(keys, rows, strict=True):
                b = self.table.blocks.get(key)
                if b is None:
                    if not strict:
                        continue  # gone meanwhile: nothing to admit
                    b = self.table.new_block(key, needed, persistent)
                elif tier in b.copies:
                    continue
                slot = self.table.reserve_slot(b, tier)
                if slot is None:
                    if strict:
                        self.abort_writes(todo, tier)
                        if not b.copies:
                            self.table.forget(b)
                        raise CacheFullError(f"{tier} tier: no slot for {key}: every block is pinned or needed")
                    break
                self.table.pin(b)
                self.table.touch(b)
                todo.append((row, b, slot))
        return todo

    def publish_writes(self, todo: list[tuple[int, Block, int]], tier: TierName) -> None:
        with self.table.lock:
            for _, b, slot in todo:
                self.table.unpin(b)
                self.table.publish(b, tier, slot)

    def abort_writes(self, todo: list[tuple[int, Block, int]], tier: TierName) -> None:
        """Give up reserved (never published) copies."""
        with self.table.lock:
            for _, b, _ in todo:
                self.table.unpin(b)
                self.table.drop(b, tier)

    # --- promotion: the bookkeeping of ``Mover.prepare_promote`` -------------------------------------
    def pin_for_promotion(self, keys: list[BlockKey], tier: TierName) -> list[Block]:
        """The stored blocks of ``keys`` without a ``tier`` copy, pinned (making room never evicts them)."""
        with self.table.lock:
            want = [b for k in keys if (b := self.table.blocks.get(k)) is not None and tier not in b.copies
                    and self.table.fastest(b) is not None]
            for b in want:
                self.table.pin(b)
            return want

    def reserve_promotions(self, want: list[Block], tier: TierName) -> list[Move]:
        """A reserved ``tier`` slot for each pinned block of ``pin_for_promotion``, as moves from its fastest
        copy (each keeps its pin until ``complete``); the blocks that got none are unpinned."""
        moves: list[Move] = []
        with self.table.lock:
            for b in want:
                src = self.table.fastest(b)
                slot = self.table.reserve_slot(b, tier) if src is not None and tier not in b.copies \
                    and b.key in self.table.blocks else None
                if src is None or slot is None:
                    self.table.unpin(b)  # not promoted: released now
                    continue
                moves.append(Move(b, src, b.copies[src].slot, tier, slot, demote=False))
        return moves
