"""The DRAM tier: a host pool backed by hugetlbfs when a mount with free pages is given, else
anonymous mmap with MADV_HUGEPAGE; registered as pinned memory (cudaHostRegister) when CUDA is present.

The pool is one mapping, replaced (and the old one unmapped) when the budget changes, so a shrink
returns memory to the system. A hugetlbfs pool is a file created and unlinked at once in the mount
(nothing is left behind after a crash). There the zero row counts in the budget (``slots_for_budget``),
so a budget of N huge pages fits a mount of N pages exactly, as a pod's hugepages are reserved. Once on
hugetlbfs, a new mapping that does not fit beside the old one is an error, not a quiet move to
anonymous memory: a shrink then keeps the old pages, cut down (``MemoryPoolTier.resize``).
"""

from __future__ import annotations

import logging
import mmap
import os
import uuid
from dataclasses import dataclass

import torch

from kvdrive.runtime.kvcache.store.budgets import TierName
from kvdrive.runtime.kvcache.store.tiers.memory import MemoryPoolTier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Mapping:
    mm: mmap.mmap
    kind: str  # "hugetlbfs" | "anon-thp" | "anon"
    pinned: bool
    ptr: int


def hugetlbfs_page_size(mount: str) -> int:
    """The huge page size of a hugetlbfs mount (its statvfs block size)."""
    return os.statvfs(mount).f_bsize


class DramTier(MemoryPoolTier):
    name: TierName = "dram"

    def __init__(self, block_bytes: int, slots: int, hugetlbfs_dir: str | None = None,
                 pin: bool | None = None) -> None:
        self.hugetlbfs_dir = hugetlbfs_dir
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._huge = hugetlbfs_page_size(hugetlbfs_dir) if hugetlbfs_dir else 0
        self.kind = "hugetlbfs" if hugetlbfs_dir else "anon-thp"
        super().__init__(block_bytes, slots)
        log.info("dram tier: %d slots of %d bytes, backing %s", self.allocator.capacity, block_bytes, self.backing)

    @staticmethod
    def slots_for_budget(budget: int, slot_bytes: int, hugetlbfs: bool) -> int:
        """Slots a budget of ``budget`` bytes holds; on hugetlbfs the pool's zero row is part of it."""
        return max(0, budget // slot_bytes - (1 if hugetlbfs else 0))

    @property
    def backing(self) -> str:
        text = f"hugetlbfs:{self.hugetlbfs_dir}" if self.kind == "hugetlbfs" else self.kind
        return text + ("+pinned" if self.pin else "")

    def _map(self, nbytes: int) -> tuple[mmap.mmap, str]:
        on_hugepages = self._handle is not None and self._handle.kind == "hugetlbfs"
        if self.hugetlbfs_dir:
            length = -(-nbytes // self._huge) * self._huge
            path = os.path.join(self.hugetlbfs_dir, f"kvdrive-{uuid.uuid4().hex}")
            try:
                fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
                try:
                    os.unlink(path)
                    os.ftruncate(fd, length)
                    return mmap.mmap(fd, length, flags=mmap.MAP_SHARED), "hugetlbfs"
                finally:
                    os.close(fd)
            except OSError as exc:
                if on_hugepages:  # stay on the hugepages this tier has rather than leave them
                    raise
                log.warning("dram tier: hugetlbfs %s has no room for %d bytes (%s); using anonymous memory",
                            self.hugetlbfs_dir, length, exc)
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
            return mm, "anon-thp"
        except (OSError, AttributeError):
            return mm, "anon"

    def _new_pool(self, rows: int) -> tuple[torch.Tensor, _Mapping]:
        nbytes = rows * self.slot_bytes
        mm, kind = self._map(nbytes)
        t = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes).view(rows, self.slot_bytes)
        pinned = False
        if self.pin and torch.cuda.is_available():
            rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
            pinned = int(rc) == 0
            if not pinned:
                log.warning("dram tier: cudaHostRegister failed (%s); the pool is pageable", rc)
        self.kind = kind
        return t, _Mapping(mm, kind, pinned, t.data_ptr())

    def _drop_pool(self, handle: _Mapping) -> None:
        if handle.pinned:
            torch.cuda.cudart().cudaHostUnregister(handle.ptr)
        # the mapping is unmapped when the last tensor view of it is freed
