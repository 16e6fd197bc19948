"""The bytes of sliding-window snapshots: named, checksummed blobs, crash-safe on disk or in host memory.

A snapshot (``kvcache.windows.snapshots``) is one blob per page boundary, named by that page's digest. Here it is
stored as a header (magic, CRC32 of the payload, payload bytes) and the payload: on disk (``<ssd-dir>/windows/``)
written to a temporary file, fsynced and renamed, so a crash leaves the old file or the new one, never half of
one (a leftover ``*.tmp`` is deleted when the directory is opened); in host memory when there is no SSD tier. A
blob is returned only whole and verified (size, magic, CRC); anything else is a miss. Without ``writable``
(the server does not persist) the directory's blobs are read and none are written or deleted.

No policy lives here: which snapshots to keep is placement's choice (``TierEviction.window_victims``), and the
Mover is the only caller of ``write`` / ``read`` / ``discard`` (``Mover.write_window`` ...).
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = b"KVDWIN01"
HEADER = struct.Struct("<8sIQ")  # magic, crc32 of the payload, payload bytes


class WindowFiles:
    def __init__(self, directory: Path | None, writable: bool = True) -> None:
        """``directory`` None: blobs in host memory."""
        self.directory = directory
        self.writable = writable or directory is None  # host memory: always (nothing outlives the process)
        self._memory: dict[str, bytes] = {}
        if directory is not None and writable:
            directory.mkdir(parents=True, exist_ok=True)
            for f in directory.glob("*.tmp"):  # a write that a crash interrupted
                f.unlink(missing_ok=True)

    @staticmethod
    def stored_bytes(payload_bytes: int) -> int:
        """What a blob of ``payload_bytes`` takes (its header included)."""
        return HEADER.size + payload_bytes

    def recovered(self) -> list[tuple[str, int]]:
        """(name, stored bytes) of every blob the directory holds, oldest first."""
        if self.directory is None or not self.directory.is_dir():
            return []
        return [(f.stem, f.stat().st_size) for f in sorted(self.directory.glob("*.win"), key=lambda f: f.stat().st_mtime)]

    def write(self, name: str, payload: bytes) -> bool:
        """Store ``payload`` under ``name`` (whole or not at all); False when it could not be written (logged)."""
        blob = HEADER.pack(MAGIC, zlib.crc32(payload), len(payload)) + payload
        if self.directory is None:
            self._memory[name] = blob
            return True
        tmp, final = self.directory / f"{name}.tmp", self.directory / f"{name}.win"
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            log.warning("sliding-window snapshot not written (%s): that prefix will be recomputed", exc)
            return False
        return True

    def read(self, name: str, payload_bytes: int) -> bytes | None:
        """The payload stored under ``name`` when it is there whole, of ``payload_bytes``, and checks out; else None."""
        try:
            blob = self._memory.get(name) or (self.directory / f"{name}.win").read_bytes() if self.directory \
                else self._memory.get(name, b"")
        except OSError:
            blob = b""
        if len(blob) != HEADER.size + payload_bytes:
            return None
        magic, crc, n = HEADER.unpack_from(blob)
        payload = memoryview(blob)[HEADER.size :]
        if magic != MAGIC or n != payload_bytes or zlib.crc32(payload) != crc:
            return None
        return bytes(payload)

    def discard(self, name: str) -> None:
        """Forget ``name`` (its file too, when writable)."""
        if self._memory.pop(name, None) is None and self.directory is not None and self.writable:
            (self.directory / f"{name}.win").unlink(missing_ok=True)
