"""Dense page ids and the tensor mirror of where each block sits in the memory tiers.

Every page (a content digest, all layers) that the store holds or a sequence references gets a dense
integer id, reused once nothing holds it. For each memory tier, ``slot[tier]`` is an int64 tensor
``[L, Pcap + 1]`` on the compute device (the last column, ``scratch``, is always -1: padded entries of a
batch point there): the slot of block (page id, layer)'s *ready* copy in that tier, or -1;
``owner[tier]`` is its inverse, slot -> block id (page id * L + layer) or -1, from which placement ranks
a tier's residents with one ``topk``. When both memory pools live in one host mapping (``HostArena``, CPU
compute), ``row`` is the merged table the decode loop gathers with: the block's device slot, else its DRAM
slot offset by ``dram_base``, else -1.
The decode hot path reads these tensors without the store lock: a value is written only after the
copy it names is complete, and a published memory slot is unpublished and freed only on the thread that
owns the hot path (see ``Residency``), so a slot read here names that block's bytes until the engine
itself frees it. Mutations run under the store lock.
"""

from __future__ import annotations

import torch

from kvdrive.runtime.kvcache.budgets import TierName

MEMORY_TIERS: tuple[TierName, ...] = ("gpu", "dram")


class BlockIndex:
    def __init__(self, num_layers: int, device: torch.device | str, capacity: int = 256) -> None:
        self.num_layers = num_layers
        self.device = torch.device(device)
        self.capacity = max(1, capacity)
        self._pid: dict[bytes, int] = {}
        self.digests: list[bytes | None] = []  # page id -> digest
        self._holds: list[int] = []  # page id -> holders (its blocks in the store + sequence references)
        self._free: list[int] = []
        self.freed: list[int] = []  # ids freed since the last ``drain_freed`` (their scores must reset)
        self.slot: dict[TierName, torch.Tensor] = {t: self._table(self.capacity) for t in MEMORY_TIERS}
        self.owner: dict[TierName, torch.Tensor] = {t: self._owners(0) for t in MEMORY_TIERS}
        self.dram_base: int | None = None  # set when the pools share one host mapping
        self.row = self._table(self.capacity)

    def __len__(self) -> int:
        """Page ids in use."""
        return len(self._pid)

    @property
    def scratch(self) -> int:
        """A page id that is never used: padded entries of a batch point to it (its slots are always -1)."""
        return self.capacity

    def find(self, digest: bytes) -> int | None:
        return self._pid.get(digest)

    def acquire(self, digest: bytes) -> int:
        """The id of ``digest`` (a new one if it has none), with one more holder."""
        pid = self._pid.get(digest)
        if pid is None:
            if self._free:
                pid = self._free.pop()
                self.digests[pid] = digest
                self._holds[pid] = 0
            else:
                pid = len(self.digests)
                self.digests.append(digest)
                self._holds.append(0)
                if pid >= self.capacity:
                    self._grow(2 * self.capacity)
            self._pid[digest] = pid
        self._holds[pid] += 1
        return pid

    def reserve(self, n: int) -> None:
        """Make room for ``n`` page ids in use without growing again (growth moves the tensors: done
        between steps, never while a forward pass reads them)."""
        if n > self.capacity:
            cap = self.capacity
            while cap < n:
                cap *= 2
            self._grow(cap)

    def release(self, pid: int) -> None:
        """One holder fewer; the id is free for reuse when none is left."""
        self._holds[pid] -= 1
        if self._holds[pid] == 0:
            digest = self.digests[pid]
            assert digest is not None
            del self._pid[digest]
            self.digests[pid] = None
            for t in MEMORY_TIERS:
                self.slot[t][:, pid] = -1
            self.row[:, pid] = -1
            self._free.append(pid)
            self.freed.append(pid)

    def drain_freed(self) -> list[int]:
        """Page ids freed since the last call."""
        out, self.freed = self.freed, []
        return out

    def place(self, tier: TierName, pid: int, layer: int, slot: int) -> None:
        """Block (pid, layer) has a ready copy in memory tier ``tier`` at ``slot``."""
        own = self.owner[tier]
        if slot >= own.shape[0]:
            grown = self._owners(max(2 * own.shape[0], slot + 1))
            grown[: own.shape[0]] = own
            self.owner[tier] = own = grown
        own[slot] = pid * self.num_layers + layer
        self.slot[tier][layer, pid] = slot
        self._refresh_row(pid, layer)

    def unplace(self, tier: TierName, pid: int, layer: int, slot: int) -> None:
        """Block (pid, layer) no longer has a copy in ``tier`` (it was at ``slot``)."""
        self.slot[tier][layer, pid] = -1
        self.owner[tier][slot] = -1
        self._refresh_row(pid, layer)

    def _refresh_row(self, pid: int, layer: int) -> None:
        if self.dram_base is None:
            return
        g = int(self.slot["gpu"][layer, pid])
        if g < 0:
            d = int(self.slot["dram"][layer, pid])
            g = d + self.dram_base if d >= 0 else -1
        self.row[layer, pid] = g

    def set_dram_base(self, base: int) -> None:
        """The DRAM pool now starts at row ``base`` of the shared mapping: rebuild the merged table."""
        self.dram_base = base
        g, d = self.slot["gpu"], self.slot["dram"]
        self.row.copy_(torch.where(g >= 0, g, torch.where(d >= 0, d + base, -1)))

    def residents(self, tier: TierName) -> tuple[torch.Tensor, torch.Tensor]:
        """(layers, page ids) of the blocks with a ready copy in ``tier``: [n] int64 each."""
        own = self.owner[tier]
        bid = own[own >= 0]
        return bid % self.num_layers, bid // self.num_layers

    def _table(self, capacity: int) -> torch.Tensor:
        with torch.inference_mode(False):  # long-lived: writable from any thread and mode
            return torch.full((self.num_layers, capacity + 1), -1, dtype=torch.int64, device=self.device)

    def _owners(self, slots: int) -> torch.Tensor:
        with torch.inference_mode(False):
            return torch.full((slots,), -1, dtype=torch.int64, device=self.device)

    def _grow(self, capacity: int) -> None:
        for t in MEMORY_TIERS:
            old = self.slot[t]
            new = self._table(capacity)
            new[:, : self.capacity] = old[:, : self.capacity]
            self.slot[t] = new
        row = self._table(capacity)
        row[:, : self.capacity] = self.row[:, : self.capacity]
        self.row = row
        self.capacity = capacity
