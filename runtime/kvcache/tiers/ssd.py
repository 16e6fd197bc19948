"""The SSD tier: preallocated slab files, O_DIRECT aligned I/O from a thread pool, per-block CRCs.

Owns the bytes on the NVMe volume: slab files ``slab-NNNNN.kv`` of ``slab_slots`` slots each
(preallocated with posix_fallocate, so a full disk shows up when the budget is set, not mid-write),
adjacent slots coalesced into one preadv/pwritev (split into pieces run in parallel), a CRC32 of
every slot recorded when its write completes and verified on every read (a mismatch is a miss, never
served), and the persisted index of content-addressed blocks (``ssd_index``). The on-disk total
(slabs + index files) never exceeds the byte budget. Faults (ENOSPC, EIO, read-only) are logged,
counted in ``faults`` and surface as TierIOError / a miss; the tier keeps serving what it can.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvdrive.runtime.kvcache.budgets import TierName
from kvdrive.runtime.kvcache.compression import BlockCodec, IdentityCodec
from kvdrive.runtime.kvcache.keys import BlockKey
from kvdrive.runtime.kvcache.tiers.aligned import AlignedBuffer, AlignedBufferPool
from kvdrive.runtime.kvcache.tiers.base import SlotAllocator, TierIOError
from kvdrive.runtime.kvcache.tiers.ssd_index import REC_BYTES, IndexEntry, SsdIndex, meta_reserve_bytes

log = logging.getLogger(__name__)


class PosixIO:
    """The system calls the tier uses; tests substitute one that injects faults."""

    def preadv(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        return os.preadv(fd, bufs, offset)

    def pwritev(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        return os.pwritev(fd, bufs, offset)

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        os.posix_fallocate(fd, offset, length)


@dataclass(frozen=True)
class _Piece:
    """One I/O call: ``rows`` consecutive slots of one slab; ``pos`` their places in the batch."""

    slab: int
    row: int
    pos: tuple[int, ...]


class _Borrowed:
    """A caller's aligned CPU tensor used as the I/O buffer (same ``mv`` as AlignedBuffer)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.mv = memoryview(t.numpy()).cast("B")


class SsdTier:
    name: TierName = "ssd"

    def __init__(self, directory: str, block_bytes: int, budget_bytes: int, codec: BlockCodec | None = None,
                 io_threads: int = 4, slab_bytes: int = 64 << 20, max_io_bytes: int = 1 << 20,
                 io: PosixIO | None = None, durable: bool = False, journal_cap: int = 256 << 10) -> None:
        self.dir = directory
        self.block_bytes = block_bytes
        self.codec: BlockCodec = codec or IdentityCodec(block_bytes)
        self.io = io or PosixIO()
        self.durable = durable
        self.journal_cap = journal_cap
        self.page_reads = self.page_writes = self.bytes_read = self.bytes_written = 0
        self.errors = self.corrupt = 0
        self.faults: dict[str, int] = {}
        self.allocator = SlotAllocator(0)
        self.available = False
        self.direct = False
        self.align = 4096
        self.slot_bytes = -(-self.codec.payload_bytes // 4096) * 4096
        self.slab_slots = 1
        self.max_io_slots = 1
        self._crc: dict[int, int] = {}  # slot -> CRC32 of the slot's bytes, set when its write completed
        self._fds: list[int] = []
        self._lock = threading.Lock()
        self._bufs = AlignedBufferPool()
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvdrive-ssd")
        self.index: SsdIndex | None = None
        self._budget = budget_bytes
        try:
            os.makedirs(directory, exist_ok=True)
            self.align, self.direct = self._probe()
            self.slot_bytes = -(-self.codec.payload_bytes // self.align) * self.align
            self.slab_slots = max(1, slab_bytes // self.slot_bytes)
            self.max_io_slots = max(1, max_io_bytes // self.slot_bytes)
            geometry = {"block_bytes": block_bytes, "codec": self.codec.name, "slot_bytes": self.slot_bytes,
                        "slab_slots": self.slab_slots}
            self.index = SsdIndex(directory, geometry, journal_cap=journal_cap, durable=durable)
            self.available = True
            self.resize(self.slots_for_budget(budget_bytes))
            self._recover()
        except OSError as exc:
            self._fault(exc, f"opening {directory}")
            log.error("ssd tier unavailable (%s): serving from gpu and dram only", exc)
        log.info("ssd tier %s: %d slots of %d bytes (codec %s, %s, align %d)", directory, self.allocator.capacity,
                 self.slot_bytes, self.codec.name, "O_DIRECT" if self.direct else "buffered", self.align)

    @property
    def backing(self) -> str:
        return f"posix-{'odirect' if self.direct else 'buffered'}:{self.dir}"

    # --- setup -------------------------------------------------------------------------------
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

    def slots_for_budget(self, budget_bytes: int) -> int:
        fixed = meta_reserve_bytes(0, self.journal_cap)
        return max(0, (budget_bytes - fixed) // (self.slot_bytes + 2 * REC_BYTES))

    def _slab_path(self, i: int) -> str:
        return os.path.join(self.dir, f"slab-{i:05d}.kv")

    def _open(self, i: int) -> int:
        flags = os.O_CREAT | os.O_RDWR | (os.O_DIRECT if self.direct else 0)
        return os.open(self._slab_path(i), flags, 0o600)

    def resize(self, slots: int) -> int:
        """Size the slab files for ``slots`` (used slots must be below); returns the slots now usable."""
        if not self.available:
            return 0
        ss = self.slab_slots
        want = [min(ss, slots - i * ss) for i in range(-(-slots // ss))]
        usable, nslabs = 0, 0
        with self._lock:
            for i, rows in enumerate(want):
                cur = 0
                try:
                    if i >= len(self._fds):
                        self._fds.append(self._open(i))
                    fd, size = self._fds[i], rows * self.slot_bytes
                    cur = os.fstat(fd).st_size
                    if cur > size:
                        os.ftruncate(fd, size)
                    elif cur < size:
                        self.io.fallocate(fd, 0, size)
                except OSError as exc:
                    self._fault(exc, f"sizing slab {i} to {rows} slots")
                    if i < len(self._fds):  # keep what the slab had, plus what still fits on the disk
                        got = self._fit(self._fds[i], cur, rows)
                        if got:
                            usable, nslabs = usable + got, i + 1
                            log.warning("ssd tier: slab %d holds %d of %d slots (disk full)", i, got, rows)
                    break
                usable, nslabs = usable + rows, i + 1
            for i in range(len(self._fds) - 1, nslabs - 1, -1):
                os.close(self._fds.pop(i))
                os.unlink(self._slab_path(i))
            for name in os.listdir(self.dir):  # stale slabs of a bigger budget before a restart
                if name.startswith("slab-") and int(name[5:10]) >= nslabs:
                    os.unlink(os.path.join(self.dir, name))
            for slot in self.allocator.used_at_or_above(usable):  # only at startup: forget them
                self.allocator.release(slot)
            self.allocator.resize(usable)
        return usable

    def _fit(self, fd: int, cur: int, rows: int) -> int:
        """After ENOSPC: grow the slab to what the filesystem still has room for; returns its slots."""
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

    def _recover(self) -> None:
        assert self.index is not None
        cap = self.allocator.capacity
        for slot in [s for s in self.index.entries if s >= cap]:
            self.index.delete(slot)
        for slot, entry in self.index.entries.items():
            self.allocator.take(slot)
            self._crc[slot] = entry.crc

    def recovered(self) -> list[tuple[int, BlockKey]]:
        """Persisted blocks found at startup: (slot, key); the store registers them."""
        return [(s, e.key) for s, e in sorted(self.index.entries.items())] if self.index else []

    # --- faults ------------------------------------------------------------------------------
    def _fault(self, exc: OSError, what: str) -> None:
        name = errno.errorcode.get(exc.errno or 0, "EUNKNOWN")
        with_lock = self._lock.acquire(blocking=False)
        try:
            self.errors += 1
            self.faults[name] = self.faults.get(name, 0) + 1
        finally:
            if with_lock:
                self._lock.release()
        log.error("ssd tier %s: %s failed: %s (%s)", self.dir, what, exc, name)

    # --- I/O ---------------------------------------------------------------------------------
    def _pieces(self, slots: list[int]) -> list[_Piece]:
        order = sorted(range(len(slots)), key=lambda p: slots[p])
        pieces: list[_Piece] = []
        run: list[int] = []
        for p in order:
            s = slots[p]
            if run and (s == slots[run[-1]] + 1 and s // self.slab_slots == slots[run[0]] // self.slab_slots
                        and len(run) < self.max_io_slots):
                run.append(p)
                continue
            if run:
                pieces.append(_Piece(slots[run[0]] // self.slab_slots, slots[run[0]] % self.slab_slots, tuple(run)))
            run = [p]
        if run:
            pieces.append(_Piece(slots[run[0]] // self.slab_slots, slots[run[0]] % self.slab_slots, tuple(run)))
        return pieces

    def _iov(self, buf: AlignedBuffer | _Borrowed, pos: tuple[int, ...]) -> list[memoryview]:
        sb = self.slot_bytes
        return [buf.mv[p * sb : (p + 1) * sb] for p in pos]

    def _do(self, piece: _Piece, buf: AlignedBuffer | _Borrowed, write: bool) -> list[int]:
        """Run one piece; returns the CRC of each of its slots (computed in this worker thread)."""
        iov = self._iov(buf, piece.pos)
        off, n = piece.row * self.slot_bytes, len(piece.pos) * self.slot_bytes
        fd = self._fds[piece.slab]
        if write:
            crcs = [zlib.crc32(v) for v in iov]
            done = self.io.pwritev(fd, iov, off)
            if self.durable:
                os.fdatasync(fd)
        else:
            done = self.io.preadv(fd, iov, off)
            crcs = [zlib.crc32(v) for v in iov]
        if done != n:
            raise OSError(errno.EIO, f"short {'write' if write else 'read'}: {done} of {n} bytes")
        return crcs

    def write(self, slots: list[int], blocks: torch.Tensor, keys: list[BlockKey], persist: list[bool]) -> None:
        """Store blocks [n, block_bytes]; each slot becomes readable (and persisted) only when done."""
        if not slots:
            return
        if not self.available:
            raise TierIOError(errno.EROFS, "ssd tier unavailable")
        n, sb, pb = len(slots), self.slot_bytes, self.codec.payload_bytes
        payload = self.codec.encode(blocks.cpu())  # [n, payload_bytes]
        buf = self._bufs.acquire(n * sb)
        try:
            staged = buf.tensor[: n * sb].view(n, sb)
            staged[:, :pb].copy_(payload)
            if sb > pb:
                staged[:, pb:].zero_()
            pieces = self._pieces(slots)
            futs = [self._pool.submit(self._do, pc, buf, True) for pc in pieces]
            failure: OSError | None = None
            crcs: dict[int, int] = {}
            for pc, f in zip(pieces, futs, strict=True):
                try:
                    crcs.update(zip(pc.pos, f.result(), strict=True))
                except OSError as exc:
                    failure = exc
        finally:
            self._bufs.release(buf)
        if failure is not None:
            self._fault(failure, f"writing {n} blocks")
            raise TierIOError(failure.errno, f"ssd write failed: {failure}")
        with self._lock:
            assert self.index is not None
            for p, slot in enumerate(slots):
                self._crc[slot] = crcs[p]
                if persist[p]:
                    self.index.put(slot, IndexEntry(keys[p], crcs[p]))
            self.page_writes += n
            self.bytes_written += n * sb

    def read(self, slots: list[int], out: torch.Tensor) -> list[bool]:
        """Load blocks into out [n, block_bytes]; False for a block that is unreadable or fails its CRC."""
        n, sb, pb = len(slots), self.slot_bytes, self.codec.payload_bytes
        if n == 0:
            return []
        with self._lock:
            expect = [self._crc.get(s) for s in slots]
        ok = [e is not None for e in expect]
        direct = (out.device.type == "cpu" and out.is_contiguous() and sb == pb == self.block_bytes
                  and out.data_ptr() % self.align == 0)  # zero-copy: read straight into the caller's memory
        buf = _Borrowed(out) if direct else self._bufs.acquire(n * sb)
        try:
            pieces = self._pieces(slots)
            futs = [self._pool.submit(self._do, pc, buf, False) for pc in pieces]
            for pc, f in zip(pieces, futs, strict=True):
                try:
                    for p, crc in zip(pc.pos, f.result(), strict=True):
                        if ok[p] and crc != expect[p]:
                            ok[p] = False
                            self.corrupt += 1
                            self.errors += 1
                            log.warning("ssd tier: block in slot %d failed its CRC; treated as a miss", slots[p])
                except OSError as exc:
                    self._fault(exc, f"reading {len(pc.pos)} blocks at slot {slots[pc.pos[0]]}")
                    for p in pc.pos:
                        ok[p] = False
            if not direct:
                out.copy_(self.codec.decode(buf.tensor[: n * sb].view(n, sb)[:, :pb]))
        finally:
            if not direct:
                self._bufs.release(buf)  # type: ignore[arg-type]
        self.page_reads += sum(ok)
        self.bytes_read += n * sb
        return ok

    def discard(self, slot: int) -> None:
        with self._lock:
            self._crc.pop(slot, None)
            if self.index is not None:
                self.index.delete(slot)

    def sync(self) -> None:
        """Make every completed write and index record durable against power loss."""
        for fd in self._fds:
            os.fdatasync(fd)
        if self.index is not None:
            self.index.sync()

    @property
    def disk_bytes(self) -> int:
        """Bytes the tier's files occupy on disk now (allocated blocks)."""
        total = 0
        for name in os.listdir(self.dir):
            st = os.stat(os.path.join(self.dir, name))
            total += max(st.st_size, st.st_blocks * 512)
        return total

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        if self.index is not None:
            self.index.close()
