"""The DRAM tier: a host pool backed by hugetlbfs when a mount with free pages is given, else
anonymous mmap with MADV_HUGEPAGE; registered as pinned memory (cudaHostRegister) when CUDA is present.

Chunks are separate mappings so that a shrink returns memory to the system. A hugetlbfs chunk is a
file created and unlinked at once in the mount (nothing is left behind after a crash).
"""

from __future__ import annotations

import logging
import mmap
import os
import uuid
from dataclasses import dataclass

import torch

from kvdrive.runtime.kvcache.budgets import TierName
from kvdrive.runtime.kvcache.tiers.memory import ChunkedMemoryTier

log = logging.getLogger(__name__)

DRAM_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class _Mapping:
    mm: mmap.mmap
    kind: str  # "hugetlbfs" | "anon-thp" | "anon"
    pinned: bool


def hugetlbfs_page_size(mount: str) -> int:
    """The huge page size of a hugetlbfs mount (its statvfs block size)."""
    return os.statvfs(mount).f_bsize


class DramTier(ChunkedMemoryTier):
    name: TierName = "dram"

    def __init__(self, block_bytes: int, slots: int, hugetlbfs_dir: str | None = None,
                 pin: bool | None = None, chunk_bytes: int = DRAM_CHUNK_BYTES) -> None:
        self.hugetlbfs_dir = hugetlbfs_dir
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._huge = hugetlbfs_page_size(hugetlbfs_dir) if hugetlbfs_dir else 0
        self.chunks_by_kind: dict[str, int] = {"hugetlbfs": 0, "anon-thp": 0, "anon": 0}
        super().__init__(block_bytes, slots, max(chunk_bytes, self._huge))
        log.info("dram tier: %d slots of %d bytes, backing %s", self.allocator.capacity, block_bytes, self.backing)

    @property
    def backing(self) -> str:
        kinds = [k for k, n in self.chunks_by_kind.items() if n]
        text = "+".join(kinds) if kinds else ("hugetlbfs" if self.hugetlbfs_dir else "anon-thp")
        if "hugetlbfs" in kinds:
            text = text.replace("hugetlbfs", f"hugetlbfs:{self.hugetlbfs_dir}")
        return text + ("+pinned" if self.pin else "")

    def _map(self, nbytes: int) -> tuple[mmap.mmap, str]:
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
                log.warning("dram tier: hugetlbfs %s has no room for %d bytes (%s); using anonymous memory",
                            self.hugetlbfs_dir, length, exc)
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
            return mm, "anon-thp"
        except (OSError, AttributeError):
            return mm, "anon"

    def _new_chunk(self, rows: int) -> tuple[torch.Tensor, _Mapping]:
        nbytes = rows * self.slot_bytes
        mm, kind = self._map(nbytes)
        t = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes).view(rows, self.slot_bytes)
        pinned = False
        if self.pin and torch.cuda.is_available():
            rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
            pinned = int(rc) == 0
            if not pinned:
                log.warning("dram tier: cudaHostRegister failed (%s); chunk is pageable", rc)
        self.chunks_by_kind[kind] += 1
        return t, _Mapping(mm, kind, pinned)

    def _drop_chunk(self, handle: _Mapping) -> None:
        if handle.pinned:
            torch.cuda.cudart().cudaHostUnregister(torch.frombuffer(handle.mm, dtype=torch.uint8).data_ptr())
        self.chunks_by_kind[handle.kind] -= 1
        # the mapping is unmapped when the last tensor view of it is freed
