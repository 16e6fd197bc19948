"""Prefix reuse for hybrid models: the sliding layers' window at a page boundary, kept for the next request.

A reused prefix must restore every layer's KV at its end. The global layers' pages are in the tiers; the
sliding layers keep no pages, only a ring of their window. Recomputing that window exactly is not cheap: a
sliding layer's K/V at position p depend on the layer below over (p - W, p], so an exact window needs
about (sliding layers x W) tokens recomputed (7.7K tokens for Gemma 3 270M). So the window that ends at a
prompt's last page boundary is kept instead, one snapshot per boundary:

- named by that page's digest, content-addressed like the pages (the model fingerprint, the KV layout and
  every token before the boundary), so any later prompt with that prefix may use it;
- on the SSD tier's disk when there is one (``<ssd-dir>/windows/``: written to a temporary file, fsynced,
  renamed; checked by size and CRC32 when read, and deleted when it fails), else in host memory (and
  without write-through, ``TierConfig.persist`` False, the disk's snapshots are read and none added);
- dropped oldest-first past a byte budget.

A snapshot is [sliding layers, n, 2, Hkv, D] for the n = min(W, boundary) positions before the boundary.
``WindowKeeper`` decides when: when a prompt is in (its first decode) and when a sequence that finished its
last step cleanly is freed, at the boundaries a later prompt reuses (the same prompt again: its last page
before the final token; a continuation: its last full page); and while a long prompt goes in, every
``EngineConfig.window_checkpoint`` tokens (at the end of the chunk that passes them), so a prompt sharing only its beginning
(the same document with another question) reuses all but the tokens after the last checkpoint.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from pathlib import Path

import torch

from kvdrive.runtime.kvcache.sequence import SeqKV
from kvdrive.runtime.kvcache.windows.ring import SlidingWindows

log = logging.getLogger(__name__)

MAGIC = b"KVDWIN01"
HEADER = struct.Struct("<8sIQ")  # magic, crc32 of the payload, payload bytes


class WindowSnapshots:
    def __init__(self, directory: Path | None, max_bytes: int, writable: bool = True) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.writable = writable  # False (no write-through): the directory's snapshots are read, none are added
        self._memory: dict[str, bytes] = {}
        self._sizes: dict[str, int] = {}  # name -> bytes, oldest first (insertion order, refreshed on use)
        self.saved = self.loaded = self.failed = 0
        if directory is not None and writable:
            directory.mkdir(parents=True, exist_ok=True)
            for f in directory.glob("*.tmp"):  # a write that a crash interrupted
                f.unlink(missing_ok=True)
        if directory is not None and directory.is_dir():
            for f in sorted(directory.glob("*.win"), key=lambda f: f.stat().st_mtime):
                self._sizes[f.stem] = f.stat().st_size

    @property
    def nbytes(self) -> int:
        return sum(self._sizes.values())

    def has(self, digest: bytes) -> bool:
        return digest.hex() in self._sizes

    def save(self, digest: bytes, window: torch.Tensor) -> None:
        """Keep ``window`` [layers, n, 2, Hkv, D] as the snapshot of the boundary ending at page ``digest``."""
        name = digest.hex()
        if name in self._sizes or (self.directory is not None and not self.writable):
            return
        payload = window.contiguous().cpu().view(torch.uint8).numpy().tobytes()
        blob = HEADER.pack(MAGIC, zlib.crc32(payload), len(payload)) + payload
        if len(blob) > self.max_bytes:
            return
        self._make_room(len(blob))
        if self.directory is None:
            self._memory[name] = blob
        else:
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
                return
        self._sizes[name] = len(blob)
        self.saved += 1

    def load(self, digest: bytes, like: torch.Tensor) -> torch.Tensor | None:
        """The snapshot ending at page ``digest`` shaped and typed like ``like``, or None (absent, or failed
        its checks: then it is deleted)."""
        name = digest.hex()
        if name not in self._sizes:
            return None
        try:
            blob = self._memory.get(name) or (self.directory / f"{name}.win").read_bytes() if self.directory \
                else self._memory.get(name, b"")
        except OSError:
            blob = b""
        want = like.numel() * like.element_size()
        ok = len(blob) == HEADER.size + want
        if ok:
            magic, crc, n = HEADER.unpack_from(blob)
            ok = magic == MAGIC and n == want and zlib.crc32(memoryview(blob)[HEADER.size :]) == crc
        if not ok:
            self.failed += 1
            log.warning("sliding-window snapshot %s failed its checks; recomputing that prefix", name[:12])
            self._drop(name)
            return None
        self._sizes[name] = self._sizes.pop(name)  # most recently used last
        self.loaded += 1
        data = torch.frombuffer(bytearray(blob[HEADER.size :]), dtype=torch.uint8)
        return data.view(like.dtype).view(like.shape).to(like.device)

    def _make_room(self, need: int) -> None:
        while self._sizes and self.nbytes + need > self.max_bytes:
            self._drop(next(iter(self._sizes)))

    def _drop(self, name: str) -> None:
        self._sizes.pop(name, None)
        if self._memory.pop(name, None) is None and self.directory is not None and self.writable:
            (self.directory / f"{name}.win").unlink(missing_ok=True)


class WindowKeeper:
    """What a hybrid model's sequences leave for later prompts, and what a reused prefix takes back."""

    def __init__(self, windows: SlidingWindows, snapshots: WindowSnapshots, page_size: int, interval: int) -> None:
        self.windows, self.snapshots, self.page_size = windows, snapshots, page_size
        self.interval = interval  # tokens between a prompt's checkpoints (0: none)

    def has(self, digest: bytes) -> bool:
        return self.snapshots.has(digest)

    def keep(self, seq: SeqKV) -> None:
        """Snapshot the window of ``seq`` (its ring up to date with its length) at its reusable boundaries."""
        if seq.inexact or not seq.length:
            return
        for pages in sorted({(seq.length - 1) // self.page_size, seq.length // self.page_size}):
            self._save(seq, pages)

    def checkpoint(self, seq: SeqKV) -> None:
        """After a prompt chunk: a snapshot at its last full page once ``interval`` tokens have gone in since
        the last one, so a prompt that shares only part of this one (the same document, another question)
        reuses it up to the last checkpoint before they differ."""
        if self.interval and not seq.inexact and seq.length - seq.window_kept >= self.interval:
            self._save(seq, seq.length // self.page_size)

    def _save(self, seq: SeqKV, pages: int) -> None:
        end = pages * self.page_size
        if max(0, end - self.windows.window) < seq.window_from:
            return  # a restored ring holds the window at its restore point, not the one before it
        if pages and pages <= len(seq.digests) and not self.snapshots.has(seq.digests[pages - 1]):
            self.snapshots.save(seq.digests[pages - 1], self.windows.snapshot(seq.row, end))
        seq.window_kept = max(seq.window_kept, end)

    def restore(self, seq: SeqKV, pages: int) -> bool:
        """The window before page ``pages`` of ``seq`` into its ring; False when that snapshot is gone."""
        end = pages * self.page_size
        window = self.snapshots.load(seq.digests[pages - 1], self.windows.empty_snapshot(end))
        if window is None:
            return False
        self.windows.restore(seq.row, end, window)
        seq.window_from = max(0, end - self.windows.window)  # the ring holds nothing older than this
        seq.window_kept = end
        return True
