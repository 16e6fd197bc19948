"""The SSD tier's on-disk index of persisted (content-addressed) blocks: snapshot + journal.

Owns crash safety of the index. Files in the tier directory:
- ``meta.json``: geometry (slot bytes, codec, block bytes); a mismatch discards the old index, so a
  layout change can never restore wrong bytes.
- ``index.snap``: a snapshot written to a temp file, fsynced and renamed (atomic), naming the journal
  generation that follows it.
- ``journal.<gen>``: fixed-size records appended after a block's data write completed. Every record
  carries its own CRC; replay stops at the first bad record (a torn tail after kill -9) and
  truncates it.
Compaction runs in two phases so that no caller waits for its fsyncs: under the tier's lock the live
entries are copied and appends move to the next generation's journal (a file created, nothing synced);
then, on a background thread, the snapshot naming that generation is written, fsynced and renamed and the
old journal removed. Startup replays the snapshot's journal and every later one in order, so a crash
between the phases loses nothing: a later journal holds exactly what came after the copy, and applying
records to a snapshot taken at or after their time gives the same entries (each record sets one slot).
Until the old journal is gone the new one stays under ``journal_cap``, so the journals never take more
than the two caps ``meta_reserve_bytes`` counts.
Ordering: data write completes -> PUT record appended -> the block is visible after a restart.
Freeing a slot does no I/O (its caller may hold the store's lock): the slot leaves ``entries`` at once and
its DEL record is appended by ``flush_deletes``, which the tier runs on its index thread and before it
writes any block's data (so no slot is rewritten while its old entry could still be replayed), and which
every later record waits for (a PUT appends the pending DELs before itself, so replay sees them in
order). A crash before a DEL is out brings its block back whole: its slot was not written since. Were a
slot ever overwritten without its DEL record, the block's data CRC (in the record, verified on every
read and sampled at startup) would read it as corrupt, never as the old block.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from kvdrive.runtime.kvcache.store.keys import BlockKey

log = logging.getLogger(__name__)

_REC = struct.Struct("<4sBxHIIQ16sI")  # magic, op, layer, slot, data crc, seq, digest, flags
REC_BYTES = _REC.size + 4  # + record crc
PUT_BATCH = 64  # PUT records appended in one write (a journal near its cap still takes part of a batch)
_MAGIC = b"KVJ1"
_SNAP = struct.Struct("<8sQQ")  # magic, generation, count
_SNAP_MAGIC = b"KVSNAP01"
OP_PUT, OP_DEL = 1, 2


@dataclass(frozen=True)
class IndexEntry:
    key: BlockKey
    crc: int


def _pack(op: int, slot: int, entry: IndexEntry | None, seq: int) -> bytes:
    key = entry.key if entry else BlockKey(b"\0" * 16, 0)
    body = _REC.pack(_MAGIC, op, key.layer, slot, entry.crc if entry else 0, seq, key.digest, 0)
    return body + struct.pack("<I", zlib.crc32(body))


def _unpack(raw: bytes) -> tuple[int, int, IndexEntry, int] | None:
    body, (crc,) = raw[: _REC.size], struct.unpack("<I", raw[_REC.size :])
    if zlib.crc32(body) != crc:
        return None
    magic, op, layer, slot, dcrc, seq, digest, _ = _REC.unpack(body)
    if magic != _MAGIC or op not in (OP_PUT, OP_DEL):
        return None
    return op, slot, IndexEntry(BlockKey(digest, layer), dcrc), seq


@dataclass(frozen=True)
class _Compaction:
    """A compaction between its phases: the generation the snapshot names and the entries it holds (a copy
    taken under the tier's index lock at the switch, or at a retry)."""

    gen: int
    entries: dict[int, IndexEntry]
    seq: int


class SsdIndex:
    """slot -> IndexEntry of persisted blocks, mirrored to disk. Not thread-safe: the tier's index lock guards it (the
    second phase of a compaction runs on ``background`` without it, touching only files)."""

    def __init__(self, directory: str, geometry: dict[str, object], journal_cap: int = 1 << 20,
                 durable: bool = False, on_fault: Callable[[OSError, str], None] | None = None,
                 background: Callable[[Callable[[], None]], object] | None = None) -> None:
        """``on_fault(exc, what)``: a failed journal append is reported there (the tier counts it and
        rate-limits its log line); without it, logged here. ``background(fn)``: runs a compaction's
        snapshot write off the caller's thread (None: in it)."""
        self.dir = directory
        self._on_fault = on_fault
        self.journal_cap = journal_cap
        self.durable = durable
        self.entries: dict[int, IndexEntry] = {}
        self._dels: list[int] = []  # slots freed whose DEL record is not yet appended, in order
        self.errors = 0
        self.torn_records = 0
        self._seq = 0
        self._gen = 0
        self._fd = -1
        self._background = background
        self._pending: _Compaction | None = None  # switched, snapshot not yet in place
        self._writing = False  # the pending snapshot is being written now
        self._old_fd: int | None = None  # the journal the pending snapshot replaces (closed once, when it is in)
        self._check_geometry(geometry)
        self._load()

    # --- startup -----------------------------------------------------------------------------
    def _path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def _check_geometry(self, geometry: dict[str, object]) -> None:
        path = self._path("meta.json")
        try:
            with open(path) as f:
                old = json.load(f)
        except FileNotFoundError:
            old = None
        except (OSError, ValueError) as exc:
            log.warning("ssd index: unreadable %s (%s); starting empty", path, exc)
            old = {}
        if old != geometry:
            if old is not None:
                log.warning("ssd index: geometry changed (%s -> %s); discarding persisted blocks", old, geometry)
            for name in os.listdir(self.dir):
                if name.startswith(("journal.", "index.snap")):
                    os.unlink(self._path(name))
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(geometry, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)

    def _load(self) -> None:
        try:
            with open(self._path("index.snap"), "rb") as f:
                data = f.read()
            magic, gen, count = _SNAP.unpack_from(data)
            end = _SNAP.size + count * REC_BYTES
            (tail,) = struct.unpack_from("<I", data, end)
            if magic != _SNAP_MAGIC or zlib.crc32(data[:end]) != tail:
                raise ValueError("bad snapshot checksum")
            self._gen = gen
            for off in range(_SNAP.size, end, REC_BYTES):
                rec = _unpack(data[off : off + REC_BYTES])
                if rec is not None:
                    self._apply(*rec)
        except FileNotFoundError:
            pass
        except (OSError, ValueError, struct.error) as exc:
            self.errors += 1
            log.error("ssd index: snapshot unreadable (%s); starting empty", exc)
            self.entries.clear()
        # the snapshot's journal, then any later one (a compaction that had not put its snapshot in place);
        # earlier ones are stale
        gens = self._journal_gens()
        for g in gens:
            if g < self._gen:
                os.unlink(self._path(f"journal.{g}"))
        chain = [self._gen, *(g for g in gens if g > self._gen)]
        good = 0
        for g in chain:
            good = self._replay(self._path(f"journal.{g}"))
        self._gen = chain[-1]
        self._fd = os.open(self._path(f"journal.{self._gen}"), os.O_CREAT | os.O_WRONLY, 0o600)
        os.ftruncate(self._fd, good)
        os.lseek(self._fd, good, os.SEEK_SET)
        if len(chain) > 1:  # a compaction was cut short: one snapshot of all of it now (startup may wait)
            self.compact()
        log.info("ssd index: %d persisted blocks recovered (generation %d)", len(self.entries), self._gen)

    def _journal_gens(self) -> list[int]:
        """The generations of the journals in the directory, ascending."""
        return sorted(int(g) for n in os.listdir(self.dir)
                      if n.startswith("journal.") and (g := n.removeprefix("journal.")).isdigit())

    def _replay(self, jpath: str) -> int:
        """Apply a journal's records up to the first bad one; returns the bytes of the whole, valid records
        (the caller cuts the journal it appends to there; an earlier one goes with the next snapshot)."""
        good = 0
        try:
            with open(jpath, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return 0
        for off in range(0, len(data) - REC_BYTES + 1, REC_BYTES):
            rec = _unpack(data[off : off + REC_BYTES])
            if rec is None:
                break
            self._apply(*rec)
            good = off + REC_BYTES
        if good != len(data):
            self.torn_records += 1
            log.warning("ssd index: journal %s has a torn tail at byte %d of %d; cut there", jpath, good, len(data))
        return good

    def _apply(self, op: int, slot: int, entry: IndexEntry, seq: int) -> None:
        self._seq = max(self._seq, seq)
        if op == OP_PUT:
            self.entries[slot] = entry
        else:
            self.entries.pop(slot, None)

    # --- updates -----------------------------------------------------------------------------
    def put(self, records: list[tuple[int, IndexEntry]]) -> bool:
        """Record completed block writes (slot, entry), PUT_BATCH records a journal write. False (logged,
        counted) when some could not be written: those blocks stay usable, not persisted."""
        self.flush_deletes()
        ok = True
        for i in range(0, len(records), PUT_BATCH):
            part = records[i : i + PUT_BATCH]
            for slot, entry in part:
                self.entries[slot] = entry
            ok = self._append(b"".join(_pack(OP_PUT, slot, entry, self._next()) for slot, entry in part)) and ok
        return ok

    def delete(self, slot: int) -> bool:
        """Forget a slot; True when it was indexed, its DEL record then pending (no I/O here)."""
        if self.entries.pop(slot, None) is None:
            return False
        self._dels.append(slot)
        return True

    def pending_deletes(self) -> int:
        """DEL records not yet appended."""
        return len(self._dels)

    def flush_deletes(self) -> bool:
        """Append the pending DEL records, in one write. False (logged, counted) when that failed: their
        blocks then come back after a restart, whole or failing their CRC."""
        if not self._dels:
            return True
        recs = b"".join(_pack(OP_DEL, slot, None, self._next()) for slot in self._dels)
        self._dels = []
        return self._append(recs)

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _append(self, rec: bytes) -> bool:
        try:
            # while the previous journal awaits its snapshot this one stays under the cap: the two caps hold
            limit = self.journal_cap if self._pending is not None else 2 * self.journal_cap
            if os.lseek(self._fd, 0, os.SEEK_CUR) + len(rec) > limit:
                raise OSError(errno.ENOSPC, "journal full: its compaction has not finished or is failing")
            if os.write(self._fd, rec) != len(rec):
                raise OSError("short journal write")
            if self.durable:
                os.fdatasync(self._fd)
            if os.lseek(self._fd, 0, os.SEEK_CUR) > self.journal_cap:
                self._compact_later()
            return True
        except OSError as exc:
            self._report(exc, "journal append (the block stays usable, not persisted)")
            try:  # drop a partial record so the journal stays a whole number of records
                pos = os.lseek(self._fd, 0, os.SEEK_CUR)
                os.ftruncate(self._fd, pos - pos % REC_BYTES)
                os.lseek(self._fd, pos - pos % REC_BYTES, os.SEEK_SET)
            except OSError:
                pass
            return False

    def _report(self, exc: OSError, what: str) -> None:
        self.errors += 1
        if self._on_fault is not None:
            self._on_fault(exc, what)
        else:
            log.error("ssd index: %s failed (%s)", what, exc)

    def _compact_later(self) -> None:
        """Start a compaction, or retry a snapshot that failed; the snapshot is written on ``background``."""
        if self._writing:
            return
        pending = self._begin()
        if self._background is None:
            self._write_snapshot(pending)
        else:
            self._background(lambda: self._write_snapshot(pending))

    def compact(self) -> None:
        """Snapshot the live entries and start the next generation's journal, both in this thread."""
        self._write_snapshot(self._begin())

    def _begin(self) -> _Compaction:
        """The snapshot to write now: a new compaction (phase 1 runs here), or the failed one's retry."""
        self._pending = self._switch() if self._pending is None else self._fresh(self._pending)
        self._writing = True
        return self._pending

    def _fresh(self, job: _Compaction) -> _Compaction:
        """A retried snapshot takes the entries as they are now: any state at or after the switch is a valid
        base for the new journal (and it carries frees whose records could not be appended)."""
        return dataclasses.replace(job, entries=dict(self.entries), seq=self._seq)

    def _switch(self) -> _Compaction:
        """Phase 1 (the caller holds the tier's lock): copy the entries, move appends to a new journal."""
        gen = self._gen + 1
        newj = os.open(self._path(f"journal.{gen}"), os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        job = _Compaction(gen, dict(self.entries), self._seq)
        self._old_fd, self._fd, self._gen = self._fd, newj, gen
        return job

    def _write_snapshot(self, job: _Compaction) -> None:
        """Phase 2 (no lock needed: files only): the snapshot naming ``job.gen``, atomically in place, then
        every older journal removed. A failure keeps ``job`` pending for the next append to retry."""
        try:
            body = _SNAP.pack(_SNAP_MAGIC, job.gen, len(job.entries)) + b"".join(
                _pack(OP_PUT, s, e, job.seq) for s, e in sorted(job.entries.items()))
            tmp = self._path("index.snap.tmp")
            fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
            try:
                os.write(fd, body + struct.pack("<I", zlib.crc32(body)))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self._path("index.snap"))
            dfd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            for g in self._journal_gens():
                if g < job.gen:
                    os.unlink(self._path(f"journal.{g}"))
        except OSError as exc:
            self._report(exc, "index snapshot (the journal keeps every record; retried)")
            self._writing = False
            return
        old, self._old_fd = self._old_fd, None
        if old is not None:
            try:
                os.close(old)
            except OSError:  # the descriptor is released all the same
                pass
        self._pending = None
        self._writing = False

    def close(self) -> None:
        """After the background runner finished (the tier shuts it down first)."""
        if self._fd >= 0:
            self.flush_deletes()
        if self._old_fd is not None:  # a snapshot that kept failing: the journals replay at the next start
            os.close(self._old_fd)
            self._old_fd = None
        self._pending = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def meta_reserve_bytes(slots: int, journal_cap: int) -> int:
    """Disk bytes the index may use at most: two snapshots (during compaction), the journal, meta.json."""
    return 2 * (_SNAP.size + 4 + slots * REC_BYTES) + 2 * journal_cap + 4 * 4096
