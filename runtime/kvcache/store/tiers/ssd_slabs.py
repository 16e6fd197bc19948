"""The SSD tier's slab files: ``slab-NNNNN.kv`` of ``slab_slots`` slots each in the tier's directory.

Owns their geometry and their sizes on disk: the alignment and whether O_DIRECT works there (probed once),
preallocation with posix_fallocate (a full disk shows up when a budget is set, not mid-write), cutting
them back, and, after ENOSPC, fitting a slab to what the filesystem still has room for. It remembers
each slab's size when it was first opened, which the startup check trusts no indexed block beyond.
Callers serialize it (the tier's lock).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from kvdrive.runtime.kvcache.store.tiers.aligned import AlignedBuffer
from kvdrive.runtime.kvcache.store.tiers.ssd_index import meta_reserve_bytes
from kvdrive.runtime.kvcache.store.tiers.ssd_io import PosixIO

log = logging.getLogger(__name__)


class SlabFiles:
    def __init__(self, directory: str, io: PosixIO, journal_cap: int, payload_bytes: int) -> None:
        self.dir, self.io, self.journal_cap = directory, io, journal_cap
        self.fds: list[int] = []
        self.found: dict[int, int] = {}  # slab -> its size in bytes when first opened (-1: it did not exist)
        self.align, self.direct = 4096, False
        self.slot_bytes = -(-payload_bytes // 4096) * 4096
        self.slab_slots = 1

    def configure(self, payload_bytes: int, slab_bytes: int) -> None:
        """Probe the directory's filesystem and set the geometry (slots padded to its alignment)."""
        self.align, self.direct = self._probe()
        self.slot_bytes = -(-payload_bytes // self.align) * self.align
        self.slab_slots = max(1, slab_bytes // self.slot_bytes)

    def _probe(self) -> tuple[int, bool]:
        """(alignment, O_DIRECT works) for this directory's filesystem."""
        path = os.path.join(self.dir, ".probe")
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, 8192)
        finally:
            os.close(fd)
        buf = AlignedBuffer(4096)
        try:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                log.warning("ssd tier: O_DIRECT unsupported in %s; using buffered I/O (page cache)", self.dir)
                return 4096, False
            try:
                os.preadv(fd, [buf.mv[:512]], 512)
                return 512, True
            except OSError:
                return 4096, True
            finally:
                os.close(fd)
        finally:
            os.unlink(path)

    def path(self, i: int) -> str:
        return os.path.join(self.dir, f"slab-{i:05d}.kv")

    def _open(self, i: int) -> int:
        flags = os.O_CREAT | os.O_RDWR | (os.O_DIRECT if self.direct else 0)
        return os.open(self.path(i), flags, 0o600)

    def found_holds(self, slot: int) -> bool:
        """Whether ``slot`` lay inside its slab file as that file was found when first opened."""
        ss = self.slab_slots
        return self.found.get(slot // ss, -1) >= (slot % ss + 1) * self.slot_bytes

    def size(self, slots: int, on_fault: Callable[[OSError, str], None]) -> int:
        """Create, grow or cut the slab files for ``slots``; returns the slots they hold (fewer when the disk
        is full: ``on_fault`` hears why). Slabs past the last one used are removed, stale ones of an earlier,
        bigger budget too."""
        ss = self.slab_slots
        want = [min(ss, slots - i * ss) for i in range(-(-slots // ss))]
        usable, nslabs = 0, 0
        for i, rows in enumerate(want):
            cur = 0
            try:
                if i >= len(self.fds):
                    existed = os.path.exists(self.path(i))
                    self.fds.append(self._open(i))
                    self.found.setdefault(i, os.fstat(self.fds[i]).st_size if existed else -1)
                fd, size = self.fds[i], rows * self.slot_bytes
                cur = os.fstat(fd).st_size
                if cur > size:
                    os.ftruncate(fd, size)
                elif cur < size:
                    self.io.fallocate(fd, 0, size)
            except OSError as exc:
                on_fault(exc, f"sizing slab {i} to {rows} slots")
                if i < len(self.fds):  # keep what the slab had, plus what still fits on the disk
                    got = self._fit(self.fds[i], cur, rows)
                    if got:
                        usable, nslabs = usable + got, i + 1
                        log.warning("ssd tier: slab %d holds %d of %d slots (disk full)", i, got, rows)
                break
            usable, nslabs = usable + rows, i + 1
        for i in range(len(self.fds) - 1, nslabs - 1, -1):
            os.close(self.fds.pop(i))
            os.unlink(self.path(i))
        for name in os.listdir(self.dir):  # stale slabs of a bigger budget before a restart
            if name.startswith("slab-") and int(name[5:10]) >= nslabs:
                os.unlink(os.path.join(self.dir, name))
        return usable

    def _fit(self, fd: int, cur: int, rows: int) -> int:
        """After ENOSPC: grow the slab to what the filesystem still has room for; returns its slots. The
        failed attempt may have left blocks allocated (ext4 keeps what posix_fallocate got before it ran
        out): cut back to ``cur`` first, so that they count as free room."""
        try:
            os.ftruncate(fd, cur)
        except OSError:
            pass
        st = os.statvfs(self.dir)
        room = st.f_bavail * st.f_frsize - meta_reserve_bytes(rows, self.journal_cap)
        size = min(rows * self.slot_bytes, max(cur, cur + room) // self.slot_bytes * self.slot_bytes)
        try:
            if size > cur:
                self.io.fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
        except OSError:
            size = cur - cur % self.slot_bytes
            os.ftruncate(fd, size)
        return size // self.slot_bytes

    def disk_bytes(self) -> int:
        """Bytes the directory's files occupy on disk now (allocated blocks; the index's files too)."""
        total = 0
        for name in os.listdir(self.dir):
            try:
                st = os.stat(os.path.join(self.dir, name))
            except FileNotFoundError:  # removed meanwhile (an index snapshot put in place by its thread)
                continue
            total += max(st.st_size, st.st_blocks * 512)
        return total

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
