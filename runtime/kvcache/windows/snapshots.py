"""Prefix reuse for hybrid models: the sliding layers' window at a page boundary, kept for the next request.

A reused prefix must restore every layer's KV at its end. The global layers' pages are in the tiers; the
sliding layers keep no pages, only a ring of their window. Recomputing that window exactly is not cheap: a
sliding layer's K/V at position p depend on the layer below over (p - W, p], so an exact window needs
about (sliding layers x W) tokens recomputed (7.7K tokens for Gemma 3 270M). So the window that ends at a
prompt's last page boundary is kept instead, one snapshot per boundary:

- named by that page's digest, content-addressed like the pages (the model fingerprint, the KV layout and
  every token before the boundary), so any later prompt with that prefix may use it;
- its bytes in ``store.tiers.window_files`` (on the SSD tier's disk when there is one, crash-safe and checked
  by CRC32 when read, else in host memory; without write-through, ``TierConfig.persist`` False, the disk's
  snapshots are read and none added), written and read by the Mover (``Mover.write_window``, ``read_window``)
  as every other byte is;
- dropped least recently used first past a byte budget, as placement chooses (``TierEviction.window_victims``).

A snapshot is [sliding layers, n, 2, Hkv, D] for the n = min(W, boundary) positions before the boundary.
``WindowKeeper`` decides when: when a prompt is in (its first decode) and when a sequence that finished its
last step cleanly is freed, at the boundaries a later prompt reuses (the same prompt again: its last page
before the final token; a continuation: its last full page); and while a long prompt goes in, every
``EngineConfig.window_checkpoint`` tokens (at the end of the chunk that passes them), so a prompt sharing only its beginning
(the same document with another question) reuses all but the tokens after the last checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from kvdrive.runtime.kvcache.sequence import SeqKV
from kvdrive.runtime.kvcache.store.tiers.window_files import WindowFiles
from kvdrive.runtime.kvcache.windows.ring import SlidingWindows

log = logging.getLogger(__name__)


class WindowIO(Protocol):
    """The Mover's window-snapshot I/O (``Mover.write_window`` ...): the only caller of ``WindowFiles``."""

    def write_window(self, files: WindowFiles, name: str, payload: bytes) -> bool: ...

    def read_window(self, files: WindowFiles, name: str, payload_bytes: int) -> bytes | None: ...

    def discard_window(self, files: WindowFiles, name: str) -> None: ...


WindowVictims = Callable[[Mapping[str, int], int, int], list[str]]  # sizes (LRU first), need, max -> to drop


class WindowSnapshots:
    def __init__(self, files: WindowFiles, io: WindowIO, victims: WindowVictims, max_bytes: int) -> None:
        """``files``: where the blobs live; ``io``: the Mover; ``victims``: placement's choice of what to drop
        past ``max_bytes`` (``TierEviction.window_victims``)."""
        self.files, self.io, self.victims = files, io, victims
        self.max_bytes = max_bytes
        self._sizes: dict[str, int] = dict(files.recovered())  # name -> stored bytes, least recently used first
        self.saved = self.loaded = self.failed = 0

    @property
    def nbytes(self) -> int:
        return sum(self._sizes.values())

    def has(self, digest: bytes) -> bool:
        return digest.hex() in self._sizes

    def save(self, digest: bytes, window: torch.Tensor) -> None:
        """Keep ``window`` [layers, n, 2, Hkv, D] as the snapshot of the boundary ending at page ``digest``."""
        name = digest.hex()
        if name in self._sizes or not self.files.writable:
            return
        payload = window.contiguous().cpu().view(torch.uint8).numpy().tobytes()
        size = self.files.stored_bytes(len(payload))
        if size > self.max_bytes:
            return
        for victim in self.victims(self._sizes, size, self.max_bytes):
            self._drop(victim)
        if not self.io.write_window(self.files, name, payload):
            return
        self._sizes[name] = size
        self.saved += 1

    def load(self, digest: bytes, like: torch.Tensor) -> torch.Tensor | None:
        """The snapshot ending at page ``digest`` shaped and typed like ``like``, or None (absent, or failed
        its checks: then it is dropped)."""
        name = digest.hex()
        if name not in self._sizes:
            return None
        payload = self.io.read_window(self.files, name, like.numel() * like.element_size())
        if payload is None:
            self.failed += 1
            log.warning("sliding-window snapshot %s failed its checks; recomputing that prefix", name[:12])
            self._drop(name)
            return None
        self._sizes[name] = self._sizes.pop(name)  # most recently used last
        self.loaded += 1
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return data.view(like.dtype).view(like.shape).to(like.device)

    def _drop(self, name: str) -> None:
        self._sizes.pop(name, None)
        self.io.discard_window(self.files, name)


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
