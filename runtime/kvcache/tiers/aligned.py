"""Page-aligned host buffers for O_DIRECT I/O, and a small pool that reuses them.

mmap memory is page aligned; O_DIRECT needs buffer addresses, file offsets and lengths aligned to
the device's logical block size. Reusing buffers avoids page-faulting fresh memory on every batch.
"""

from __future__ import annotations

import mmap
import threading

import torch

GRANULE = 64 << 10  # pool size classes: multiples of 64 KiB


class AlignedBuffer:
    """One anonymous mapping; ``mv`` is a writable memoryview, ``tensor`` a uint8 view of it."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.mv = memoryview(self.mm)
        with torch.inference_mode(False):  # a normal tensor: any thread may write it, in or out of inference mode
            self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes)


class AlignedBufferPool:
    """Thread-safe free lists of aligned buffers by size class; keeps at most ``per_class`` spares."""

    def __init__(self, per_class: int = 8) -> None:
        self.per_class = per_class
        self._free: dict[int, list[AlignedBuffer]] = {}
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> AlignedBuffer:
        size = max(GRANULE, -(-nbytes // GRANULE) * GRANULE)
        with self._lock:
            spares = self._free.get(size)
            if spares:
                return spares.pop()
        return AlignedBuffer(size)

    def release(self, buf: AlignedBuffer) -> None:
        with self._lock:
            spares = self._free.setdefault(buf.nbytes, [])
            if len(spares) < self.per_class:
                spares.append(buf)
