"""The SSD tier's on-disk index of persisted (content-addressed) blocks: snapshot + journal.

Owns crash safety of the index. Files in the tier directory:
- ``meta.json``: geometry (slot bytes, codec, block bytes); a mismatch discards the old index, so a
  layout change can never restore wrong bytes.
- ``index.snap``: a snapshot written to a temp file, fsynced and renamed (atomic), naming the journal
  generation that follows it.
- ``journal.<gen>``: fixed-size records appended after a block's data write completed. Every record
  carries its own CRC; replay stops at the first bad record (a torn tail after kill -9) and
  truncates it.
Ordering: data write completes -> PUT record appended -> the block is visible after a restart.
Freeing a slot appends a DEL record first. The block's own data CRC (in the record) is verified on
every read, so a slot overwritten without its DEL record reads as corrupt, never as the old block.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from kvdrive.runtime.kvcache.keys import BlockKey

log = logging.getLogger(__name__)

_REC = struct.Struct("<4sBxHIIQ16sI")  # magic, op, layer, slot, data crc, seq, digest, flags
REC_BYTES = _REC.size + 4  # + record crc
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


class SsdIndex:
    """slot -> IndexEntry of persisted blocks, mirrored to disk. Not thread-safe: the tier locks."""

    def __init__(self, directory: str, geometry: dict[str, object], journal_cap: int = 1 << 20,
                 durable: bool = False, on_fault: Callable[[OSError, str], None] | None = None) -> None:
        """``on_fault(exc, what)``: a failed journal append is reported there (the tier counts it and
        rate-limits its log line); without it, logged here."""
        self.dir = directory
        self._on_fault = on_fault
        self.journal_cap = journal_cap
        self.durable = durable
        self.entries: dict[int, IndexEntry] = {}
        self.errors = 0
        self.torn_records = 0
        self._seq = 0
        self._gen = 0
        self._fd = -1
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
        for name in os.listdir(self.dir):  # journals of other generations are stale
            if name.startswith("journal.") and name != f"journal.{self._gen}":
                os.unlink(self._path(name))
        jpath = self._path(f"journal.{self._gen}")
        good = 0
        try:
            with open(jpath, "rb") as f:
                data = f.read()
            for off in range(0, len(data) - REC_BYTES + 1, REC_BYTES):
                rec = _unpack(data[off : off + REC_BYTES])
                if rec is None:
                    break
                self._apply(*rec)
                good = off + REC_BYTES
            if good != len(data):
                self.torn_records += 1
                log.warning("ssd index: journal %s has a torn tail at byte %d of %d; truncated", jpath, good, len(data))
        except FileNotFoundError:
            pass
        self._fd = os.open(jpath, os.O_CREAT | os.O_WRONLY, 0o600)
        os.ftruncate(self._fd, good)
        os.lseek(self._fd, good, os.SEEK_SET)
        log.info("ssd index: %d persisted blocks recovered (generation %d)", len(self.entries), self._gen)

    def _apply(self, op: int, slot: int, entry: IndexEntry, seq: int) -> None:
        self._seq = max(self._seq, seq)
        if op == OP_PUT:
            self.entries[slot] = entry
        else:
            self.entries.pop(slot, None)

    # --- updates -----------------------------------------------------------------------------
    def put(self, slot: int, entry: IndexEntry) -> bool:
        """Record a completed block write. False (logged, counted) when the journal cannot be written."""
        self.entries[slot] = entry
        return self._append(_pack(OP_PUT, slot, entry, self._next()))

    def delete(self, slot: int) -> bool:
        if self.entries.pop(slot, None) is None:
            return True
        return self._append(_pack(OP_DEL, slot, None, self._next()))

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _append(self, rec: bytes) -> bool:
        try:
            if os.lseek(self._fd, 0, os.SEEK_CUR) + len(rec) > 2 * self.journal_cap:
                raise OSError(errno.ENOSPC, "journal at twice its cap (compaction failing)")
            if os.write(self._fd, rec) != len(rec):
                raise OSError("short journal write")
            if self.durable:
                os.fdatasync(self._fd)
            if os.lseek(self._fd, 0, os.SEEK_CUR) > self.journal_cap:
                self.compact()
            return True
        except OSError as exc:
            self.errors += 1
            if self._on_fault is not None:
                self._on_fault(exc, "journal append (the block stays usable, not persisted)")
            else:
                log.error("ssd index: journal append failed (%s); block stays usable but is not persisted", exc)
            try:  # drop a partial record so the journal stays a whole number of records
                pos = os.lseek(self._fd, 0, os.SEEK_CUR)
                os.ftruncate(self._fd, pos - pos % REC_BYTES)
                os.lseek(self._fd, pos - pos % REC_BYTES, os.SEEK_SET)
            except OSError:
                pass
            return False

    def compact(self) -> None:
        """Snapshot the live entries (atomic rename) and start an empty journal of the next generation."""
        gen = self._gen + 1
        body = _SNAP.pack(_SNAP_MAGIC, gen, len(self.entries)) + b"".join(
            _pack(OP_PUT, s, e, self._seq) for s, e in sorted(self.entries.items()))
        tmp = self._path("index.snap.tmp")
        fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        try:
            os.write(fd, body + struct.pack("<I", zlib.crc32(body)))
            os.fsync(fd)
        finally:
            os.close(fd)
        newj = os.open(self._path(f"journal.{gen}"), os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        os.replace(tmp, self._path("index.snap"))
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        os.close(self._fd)
        old, self._fd, self._gen = self._path(f"journal.{self._gen}"), newj, gen
        os.unlink(old)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def meta_reserve_bytes(slots: int, journal_cap: int) -> int:
    """Disk bytes the index may use at most: two snapshots (during compaction), the journal, meta.json."""
    return 2 * (_SNAP.size + 4 + slots * REC_BYTES) + 2 * journal_cap + 4 * 4096
