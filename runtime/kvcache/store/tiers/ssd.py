"""The SSD tier: preallocated slab files, O_DIRECT aligned I/O, per-block CRCs.

Owns the bytes on the NVMe volume: slab files ``slab-NNNNN.kv`` of ``slab_slots`` slots each (their geometry
and sizes are ``ssd_slabs.SlabFiles``), adjacent slots coalesced into one preadv/pwritev per piece
(``ssd_io``: the caller runs the first piece, a pool the others; aligned caller memory is read into / written
from directly), a CRC32 of every slot (``checksum``) recorded when its write completes and verified on every
read (a mismatch is a miss, never served), and the persisted index of content-addressed blocks
(``ssd_index``). The on-disk total (slabs + index files) never exceeds the byte budget. Faults (ENOSPC, EIO,
read-only) are logged, counted in ``faults`` and surface as TierIOError / a miss; the tier keeps serving what
it can.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from kvdrive.runtime.kvcache.store.budgets import TierName
from kvdrive.runtime.kvcache.store.compression import BlockCodec, IdentityCodec
from kvdrive.runtime.kvcache.store.faults import FaultLog
from kvdrive.runtime.kvcache.store.keys import BlockKey
from kvdrive.runtime.kvcache.store.tiers.aligned import AlignedBuffer, AlignedBufferPool
from kvdrive.runtime.kvcache.store.tiers.base import SlotAllocator, TierIOError
from kvdrive.runtime.kvcache.store.tiers.checksum import slot_crcs
from kvdrive.runtime.kvcache.store.tiers.rows import copy_rows, gather_rows, scatter_rows
from kvdrive.runtime.kvcache.store.tiers.ssd_index import REC_BYTES, IndexEntry, SsdIndex, meta_reserve_bytes
from kvdrive.runtime.kvcache.store.tiers.ssd_io import (
    IOV_MAX,
    Borrowed,
    Piece,
    PieceRunner,
    PosixIO,
    iovecs,
    plan,
)
from kvdrive.runtime.kvcache.store.tiers.ssd_slabs import SlabFiles

log = logging.getLogger(__name__)

__all__ = ["PosixIO", "SsdTier"]
SAMPLE_PER_SLAB = 64  # indexed blocks of each slab read back at startup before the slab is trusted


MIN_JOURNAL_CAP = 256 << 10


def journal_cap_for(slots: int) -> int:
    """The index journal's cap for a tier of ``slots``: half a snapshot's records, at least 256 KiB. A
    compaction writes a record for every live slot, so a journal of a fixed size made a large tier compact
    ever more often; and while a snapshot is being written the next journal must take what arrives meanwhile:
    a 16 GiB tier's snapshot is ~1M records, and a fixed 256 KiB (~5K records, less than one 8K-token
    prompt's pages over 24 layers) filled before it was done ("journal full"), leaving pages unpersisted."""
    return max(MIN_JOURNAL_CAP, slots * REC_BYTES // 2 // REC_BYTES * REC_BYTES)


class SsdTier:
    name: TierName = "ssd"

    def __init__(self, directory: str, block_bytes: int, budget_bytes: int, codec: BlockCodec | None = None,
                 io_threads: int = 4, slab_bytes: int = 64 << 20, max_io_bytes: int = 1 << 20,
                 io: PosixIO | None = None, durable: bool = False, journal_cap: int | None = None) -> None:
        self.dir = directory
        self.block_bytes = block_bytes
        self.codec: BlockCodec = codec or IdentityCodec(block_bytes)
        self.io = io or PosixIO()
        self.durable = durable
        self.journal_cap = journal_cap or MIN_JOURNAL_CAP  # sized to the budget below, unless given
        self.page_reads = self.page_writes = self.bytes_read = self.bytes_written = 0
        self.errors = self.corrupt = 0
        self.forgotten_at_start = 0  # index entries the startup check did not trust
        self.fault_log = FaultLog(log, "ssd")  # counts by kind (errno name, "crc"), rate-limited log lines
        self.allocator = SlotAllocator(0)
        self.available = False
        self.slabs = SlabFiles(directory, self.io, self.journal_cap, self.codec.payload_bytes)
        self.max_io_slots = 1
        self._crc: dict[int, int] = {}  # slot -> CRC32 of the slot's bytes, set when its write completed
        self._lock = threading.Lock()  # the CRCs, the counters and the slab files (a read takes it briefly)
        # the index and its journal appends: apart from ``_lock``, so that a read never waits for a record's write
        self._index_lock = threading.Lock()
        self._bufs = AlignedBufferPool()
        self._runner = PieceRunner(io_threads)
        # the index's snapshots (two fsyncs) are written here, never under this tier's or the store's lock
        self._compactor = ThreadPoolExecutor(1, thread_name_prefix="kvdrive-ssd-index")
        self._flush_queued = False  # a flush of the index's pending DEL records is queued on that thread
        self.index: SsdIndex | None = None
        try:
            os.makedirs(directory, exist_ok=True)
            self.slabs.configure(self.codec.payload_bytes, slab_bytes)
            if journal_cap is None:
                self.journal_cap = self.slabs.journal_cap = journal_cap_for(budget_bytes // self.slot_bytes)
            self.max_io_slots = max(1, min(IOV_MAX, max_io_bytes // self.slot_bytes))
            geometry = {"block_bytes": block_bytes, "codec": self.codec.name, "slot_bytes": self.slot_bytes,
                        "slab_slots": self.slab_slots}
            self.index = SsdIndex(directory, geometry, journal_cap=self.journal_cap, durable=durable,
                                  on_fault=self._fault, background=self._compactor.submit)
            self.available = True
            self.resize(self.slots_for_budget(budget_bytes))
            self._recover()
        except OSError as exc:
            self._fault(exc, f"opening {directory}")
            log.error("ssd tier unavailable (%s): serving from gpu and dram only", exc)
        log.info("ssd tier %s: %d slots of %d bytes (codec %s, %s, align %d)", directory, self.allocator.capacity,
                 self.slot_bytes, self.codec.name, "O_DIRECT" if self.direct else "buffered", self.slabs.align)

    @property
    def faults(self) -> dict[str, int]:
        """Faults since start by kind: an errno name (EIO, ENOSPC, ...) or "crc" (a block failed its checksum)."""
        return dict(self.fault_log.counts)

    def degraded(self) -> str | None:
        """Why this tier is degraded (unavailable, or a recent fault), or None."""
        if not self.available:
            return f"ssd tier unavailable ({self.dir}): serving from gpu and dram only"
        return self.fault_log.degraded()

    def failing(self) -> bool:
        """Unavailable, or a block read or write failed with an I/O error within the fault window."""
        return not self.available or self.fault_log.failing()

    @property
    def backing(self) -> str:
        return f"posix-{'odirect' if self.direct else 'buffered'}:{self.dir}"

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot on disk: a block's payload padded to the filesystem's alignment."""
        return self.slabs.slot_bytes

    @property
    def slab_slots(self) -> int:
        return self.slabs.slab_slots

    @property
    def direct(self) -> bool:
        """Whether the slabs are opened O_DIRECT (the filesystem allows it)."""
        return self.slabs.direct

    # --- setup -------------------------------------------------------------------------------
    def slots_for_budget(self, budget_bytes: int) -> int:
        fixed = meta_reserve_bytes(0, self.journal_cap)
        return max(0, (budget_bytes - fixed) // (self.slot_bytes + 2 * REC_BYTES))

    def resize(self, slots: int) -> int:
        """Size the slab files for ``slots`` (used slots must be below); returns the slots now usable."""
        usable = self.size_files(slots)
        with self._lock:
            for slot in self.allocator.used_at_or_above(usable):  # only at startup: forget them
                self.allocator.release(slot)
            self.allocator.resize(usable)
        return usable

    def size_files(self, slots: int) -> int:
        """Create, grow or cut the slab files for ``slots`` (disk I/O, under this tier's lock only) and return
        the slots they hold; the allocator is left as it is (``resize`` sets it; a store growing the tier
        sets it under its own lock, after this)."""
        if not self.available:
            return 0
        with self._lock:
            return self.slabs.size(slots, self._fault)

    def _recover(self) -> None:
        """Startup: the index checked against the slabs before any block is trusted. Entries beyond the
        budget, or in a slab that was missing (created empty now) or shorter than they need, are forgotten;
        then a sample of each slab's entries is read and checked, and a slab whose sample fails has every
        entry checked (a replaced or damaged file); entries that fail are forgotten."""
        assert self.index is not None
        cap, ss = self.allocator.capacity, self.slab_slots
        beyond = [s for s in self.index.entries if s >= cap]
        missing = [s for s in self.index.entries if s < cap and not self.slabs.found_holds(s)]
        for slot in beyond + missing:
            self.index.delete(slot)
        if missing:
            log.warning("ssd tier %s: %d indexed blocks lie in missing or truncated slab files; forgotten", self.dir,
                        len(missing))
        for slot, entry in self.index.entries.items():
            self._crc[slot] = entry.crc
        by_slab: dict[int, list[int]] = {}
        for slot in sorted(self.index.entries):
            by_slab.setdefault(slot // ss, []).append(slot)
        bad: list[int] = []
        for slab, slots in by_slab.items():
            step = max(1, len(slots) // SAMPLE_PER_SLAB)
            sample = slots[::step]
            checked = dict(zip(sample, self._verify(sample), strict=True))
            if all(checked.values()):
                continue
            rest = [s for s in slots if s not in checked]  # each block read (and counted) once
            checked.update(zip(rest, self._verify(rest), strict=True))
            failed = [s for s in slots if not checked[s]]
            log.warning("ssd tier %s: slab %d failed its sampled check; %d of %d blocks corrupt, forgotten", self.dir,
                        slab, len(failed), len(slots))
            bad += failed
        for slot in bad:
            self.index.delete(slot)
            self._crc.pop(slot, None)
        self.allocator.take_many(list(self.index.entries))
        self.forgotten_at_start = len(beyond) + len(missing) + len(bad)
        self.index.flush_deletes()  # what startup forgot is recorded before anything else

    def _verify(self, slots: list[int]) -> list[bool]:
        """Whether each slot's bytes match its CRC (read in chunks, into a scratch buffer)."""
        ok: list[bool] = []
        chunk = max(1, self.max_io_slots)
        out = torch.empty((chunk, self.block_bytes), dtype=torch.uint8)
        for i in range(0, len(slots), chunk):
            part = slots[i : i + chunk]
            ok += self.read(part, out[: len(part)])
        return ok

    def recovered(self) -> list[tuple[int, BlockKey]]:
        """Persisted blocks found at startup: (slot, key); the store registers them."""
        return [(s, e.key) for s, e in sorted(self.index.entries.items())] if self.index else []

    # --- faults ------------------------------------------------------------------------------
    def _fault(self, exc: OSError, what: str, block_io: bool = False) -> None:
        name = errno.errorcode.get(exc.errno or 0, "EUNKNOWN")
        with_lock = self._lock.acquire(blocking=False)
        try:
            self.errors += 1
        finally:
            if with_lock:
                self._lock.release()
        self.fault_log.record(name, "ssd tier %s: %s failed: %s (%s)", self.dir, what, exc, name, block_io=block_io)

    # --- I/O ---------------------------------------------------------------------------------
    def _pieces(self, slots: list[int]) -> list[Piece]:
        return plan(slots, self.slab_slots, self.max_io_slots)

    def _do(self, piece: Piece, buf: AlignedBuffer | Borrowed, write: bool,
            dest: torch.Tensor | None = None) -> list[int]:
        """Run one piece; returns the CRC of each of its slots, computed in this thread right after
        the read (before the write), so that it overlaps the other pieces' I/O. A read also copies
        the piece's slots from the staging buffer to ``dest`` when given (overlapped the same way)."""
        sb, pos = self.slot_bytes, piece.pos
        iov = iovecs(buf.mv, pos, sb)
        off, n = piece.row * sb, len(pos) * sb
        fd = self.slabs.fds[piece.slab]
        if write:
            crcs = self._crcs(buf.mv, pos)
            done = self.io.pwritev(fd, iov, off)
            if self.durable:
                os.fdatasync(fd)
        else:
            done = self.io.preadv(fd, iov, off)
            crcs = self._crcs(buf.mv, pos)
        if done != n:
            raise OSError(errno.EIO, f"short {'write' if write else 'read'}: {done} of {n} bytes")
        if dest is not None:
            rows = buf.tensor[: dest.shape[0] * sb].view(-1, sb)
            # a pool thread does not inherit the caller's inference mode; the destination may be an
            # inference tensor (allocated inside the model's forward)
            if isinstance(pos, range):
                copy_rows(dest[pos.start : pos.stop], rows[pos.start : pos.stop])
            else:
                scatter_rows(dest, list(pos), gather_rows(rows, list(pos)))
        return crcs

    def _crcs(self, mv: memoryview, pos: Sequence[int]) -> list[int]:
        sb = self.slot_bytes
        if isinstance(pos, range):
            return slot_crcs(mv, pos.start * sb, len(pos), sb)
        return [c for p in pos for c in slot_crcs(mv, p * sb, 1, sb)]

    def write(self, slots: list[int], blocks: torch.Tensor, keys: list[BlockKey], persist: list[bool]) -> None:
        """Store blocks [n, block_bytes]; each slot becomes readable (and persisted) only when done."""
        if not slots:
            return
        if not self.available:
            raise TierIOError(errno.EROFS, "ssd tier unavailable")
        if self.index is not None and self.index.pending_deletes():  # a freed slot's DEL record goes out before
            self._flush_deletes()  # any new bytes land in a slot (a reused one would read as corrupt after a crash)
        n, sb, pb = len(slots), self.slot_bytes, self.codec.payload_bytes
        if self._zero_copy(blocks):  # write straight from the caller's aligned memory
            buf: AlignedBuffer | Borrowed = Borrowed(blocks)
        else:
            payload = self.codec.encode(blocks.cpu())  # [n, payload_bytes]
            buf = self._bufs.acquire(n * sb)
            staged = buf.tensor[: n * sb].view(n, sb)
            copy_rows(staged[:, :pb], payload)
            if sb > pb:
                staged.numpy()[:, pb:] = 0
        try:
            pieces = self._pieces(slots)
            results = self._runner.run(lambda pc: self._do(pc, buf, True), pieces)
        finally:
            if isinstance(buf, AlignedBuffer):
                self._bufs.release(buf)
        crcs: list[int] = [0] * n
        failure: OSError | None = None
        for pc, res in zip(pieces, results, strict=True):
            if isinstance(res, OSError):
                failure = res
            else:
                _scatter(crcs, pc.pos, res)
        if failure is not None:
            self._fault(failure, f"writing {n} blocks", block_io=True)
            raise TierIOError(failure.errno, f"ssd write failed: {failure}")
        with self._lock:
            for p, slot in enumerate(slots):
                self._crc[slot] = crcs[p]
            self.page_writes += n
            self.bytes_written += n * sb
        records = [(slot, IndexEntry(keys[p], crcs[p])) for p, slot in enumerate(slots) if persist[p]]
        if records:
            with self._index_lock:  # one journal write for the batch
                assert self.index is not None
                self.index.put(records)

    def _zero_copy(self, t: torch.Tensor) -> bool:
        """Whether ``t`` can be the I/O buffer itself: aligned contiguous CPU bytes, stored as they are."""
        return (t.device.type == "cpu" and t.dtype == torch.uint8 and t.is_contiguous()
                and self.slot_bytes == self.codec.payload_bytes == self.block_bytes
                and t.data_ptr() % self.slabs.align == 0)

    def read(self, slots: list[int], out: torch.Tensor) -> list[bool]:
        """Load blocks into out [n, block_bytes]; False for a block that is unreadable or fails its CRC
        (its row of ``out`` then holds unspecified bytes: never use it)."""
        n, sb, pb = len(slots), self.slot_bytes, self.codec.payload_bytes
        if n == 0:
            return []
        with self._lock:
            expect = [self._crc.get(s) for s in slots]
        direct = self._zero_copy(out)  # zero-copy: read straight into the caller's memory
        buf: AlignedBuffer | Borrowed = Borrowed(out) if direct else self._bufs.acquire(n * sb)
        # stored as they are into CPU memory: each piece copies its own rows out of the staging buffer
        dest = (out if not direct and sb == pb == self.block_bytes and out.device.type == "cpu"
                and out.dtype == torch.uint8 else None)
        got: list[int | None] = [None] * n
        try:
            pieces = self._pieces(slots)
            results = self._runner.run(lambda pc: self._do(pc, buf, False, dest), pieces)
            for pc, res in zip(pieces, results, strict=True):
                if isinstance(res, OSError):
                    self._fault(res, f"reading {len(pc.pos)} blocks at slot {slots[pc.pos[0]]}", block_io=True)
                else:
                    _scatter(got, pc.pos, res)
            if not direct and dest is None:
                out.copy_(self.codec.decode(buf.tensor[: n * sb].view(n, sb)[:, :pb]))
        finally:
            if isinstance(buf, AlignedBuffer):
                self._bufs.release(buf)
        if got == expect and None not in got:  # all verified (one C-level comparison)
            ok = [True] * n
        else:
            ok = [g is not None and g == e for g, e in zip(got, expect, strict=True)]
            for p, (g, e) in enumerate(zip(got, expect, strict=True)):
                if g is not None and e is not None and g != e:
                    self.corrupt += 1
                    self.errors += 1
                    self.fault_log.record("crc", "ssd tier %s: block in slot %d failed its CRC; treated as a miss",
                                          self.dir, slots[p], level=logging.WARNING)
        self.page_reads += sum(ok)
        self.bytes_read += n * sb
        return ok

    def discard(self, slot: int) -> None:
        """Free a slot's block: no I/O here (the Mover calls this before the slot is released); the index's DEL
        record is appended on the index thread, or by the next ``write`` before its data, so a slot is never
        rewritten while its old entry could still be replayed."""
        with self._lock:
            self._crc.pop(slot, None)
        with self._index_lock:
            if self.index is not None and self.index.delete(slot) and not self._flush_queued:
                self._flush_queued = True
                self._compactor.submit(self._flush_deletes)

    def _flush_deletes(self) -> None:
        with self._index_lock:
            self._flush_queued = False
            if self.index is not None:
                self.index.flush_deletes()

    @property
    def disk_bytes(self) -> int:
        """Bytes the tier's files occupy on disk now (allocated blocks)."""
        return self.slabs.disk_bytes()

    def close(self) -> None:
        self._runner.shutdown()
        self._compactor.shutdown(wait=True)
        self.slabs.close()
        if self.index is not None:
            self.index.close()


def _scatter(dst: list, pos: Sequence[int], values: list[int]) -> None:
    """dst[pos[i]] = values[i] (a slice assignment when ``pos`` is a range)."""
    if isinstance(pos, range):
        dst[pos.start : pos.stop] = values
    else:
        for p, v in zip(pos, values, strict=True):
            dst[p] = v
