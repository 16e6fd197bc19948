"""Running prepared moves, making room in a full tier, and discarding freed slots: the Mover's runner part.

Every call here follows prepare (the store, under its lock) -> run (here, no lock) -> complete (the store).
A full tier frees slots in passes: the store drops the victims placement's rules drop and returns those to
demote; the tier below makes room first, then their bytes are copied here. A dropped copy's slot is
discarded from its tier (the SSD tier queues its index's DEL record) and only then released, so a slot is
never rewritten while its old record could still be replayed.
"""

from __future__ import annotations

import torch

from kvdrive.runtime.kvcache.contract import Move
from kvdrive.runtime.kvcache.store.budgets import TierName
from kvdrive.runtime.kvcache.store.table import BlockTable
from kvdrive.runtime.kvcache.store.tiers.base import Tier, TierIOError

ROOM_ATTEMPTS = 4  # passes of make-room before giving up (other threads may take freed slots meanwhile)
IO_ALIGN = 4096  # row 0 of a buffer on a CPU device is page aligned (O_DIRECT reads land in place)


class MoveRunner:
    def __init__(self, table: BlockTable, tiers: dict[TierName, Tier], device: torch.device) -> None:
        """``table``: the store's bookkeeping (prepare / complete); ``tiers``: the tiers whose bytes move here;
        ``device``: where moved bytes are staged."""
        self.table = table
        self.tiers = tiers
        self.device = device
        self.block_bytes = table.block_bytes

    def buffer(self, n: int, device: torch.device) -> torch.Tensor:
        """[n, block_bytes] uint8 on ``device``; on a CPU device the first row is IO_ALIGN-aligned."""
        bb = self.block_bytes
        if device.type != "cpu":
            return torch.empty((n, bb), dtype=torch.uint8, device=device)
        raw = torch.empty(n * bb + IO_ALIGN, dtype=torch.uint8)
        off = -raw.data_ptr() % IO_ALIGN
        return raw[off : off + n * bb].view(n, bb)

    # --- freed slots -----------------------------------------------------------------------------
    def settle_freed(self) -> None:
        """Discard every slot dropped since the last call from its tier (the SSD tier queues its index's DEL
        record), then hand the slots back to the allocators. No lock held while the tiers are told."""
        freed = self.table.take_freed()
        if not freed:
            return
        try:
            for tier, slot in freed:
                self.tiers[tier].discard(slot)
        finally:
            self.table.release_freed(freed)

    # --- making room -----------------------------------------------------------------------------
    def make_room(self, tier: TierName, n: int, batch: bool = True) -> bool:
        """Free slots until ``tier`` has ``n`` free. Each pass: the store drops the victims placement's rules
        drop and returns those to demote; the tier below makes room first, then their copies run here.
        ``batch``: free at least a batch of slots (one sort serves many evictions). Returns whether ``n``
        slots are free."""
        table = self.table
        stalled = False  # the last pass freed nothing: its victims were needed blocks with nowhere to go
        for _ in range(ROOM_ATTEMPTS):
            victims = table.choose_victims(tier, n, batch, stalled)
            self.settle_freed()
            if victims is None:
                return True
            if victims.demote:
                self.make_room(victims.targets[0], len(victims.demote))
                moves = table.prepare_demotions(tier, victims)
                self.settle_freed()
                if moves:
                    self.complete_moves(moves, self.run_moves(moves))
            free = table.free_slots(tier)
            if free >= n:
                return True
            if not victims.demote and not victims.dropped:
                return False  # nothing evictable
            stalled = free <= victims.free_before
        return table.free_slots(tier) >= n

    # --- moving bytes ----------------------------------------------------------------------------
    def run_moves(self, moves: list[Move]) -> list[bool]:
        """Copy each prepared move's bytes (no lock: sources are pinned, destinations reserved). Grouped by
        (src, dst) tiers: one read and one write per group. Any thread."""
        tiers = self.tiers
        ok = [False] * len(moves)
        groups: dict[tuple[TierName, TierName], list[int]] = {}
        for i, m in enumerate(moves):
            groups.setdefault((m.src, m.dst), []).append(i)
        for (src, dst), idx in groups.items():
            buf = self.buffer(len(idx), self.device)  # aligned: the SSD tier reads into it in place
            read = tiers[src].read([moves[i].src_slot for i in idx], buf)
            good = [p for p, r in enumerate(read) if r]
            if not good:
                continue
            rows = buf if len(good) == len(idx) else buf[good]
            try:
                tiers[dst].write([moves[idx[p]].dst_slot for p in good], rows,
                                 [moves[idx[p]].block.key for p in good],
                                 [moves[idx[p]].block.persistent for p in good])
            except TierIOError:
                continue
            for p in good:
                ok[idx[p]] = True
        return ok

    def complete_moves(self, moves: list[Move], ok: list[bool]) -> int:
        """Publish the moves that arrived (and drop what they demoted); returns how many."""
        self.table.complete(moves, ok)
        self.settle_freed()
        return sum(ok)

