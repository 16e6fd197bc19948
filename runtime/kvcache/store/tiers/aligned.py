"""Page-aligned host buffers for O_DIRECT I/O, and a small pool that reuses them.

mmap memory is page aligned; O_DIRECT needs buffer addresses, file offsets and lengths aligned to
the device's logical block size. Reusing buffers avoids page-faulting fresh memory on every batch.
The pool's spares are bounded in bytes (not only per size class): a batch of an unusual size gets a
fresh mapping that is unmapped when released, so staging memory stays a constant, not a function of
every batch size the process ever saw.
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
    """Thread-safe free lists of aligned buffers by size class; keeps at most ``per_class`` spares of a
    class and ``max_spare_bytes`` of spares in all (a released buffer beyond that is unmapped)."""

    def __init__(self, per_class: int = 8, max_spare_bytes: int = 32 << 20) -> None:
        self.per_class = per_class
        self.max_spare_bytes = max_spare_bytes
        self.spare_bytes = 0
        self._free: dict[int, list[AlignedBuffer]] = {}
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> AlignedBuffer:
        size = max(GRANULE, -(-nbytes // GRANULE) * GRANULE)
        with self._lock:
            spares = self._free.get(size)
            if spares:
                self.spare_bytes -= size
                return spares.pop()
        return AlignedBuffer(size)

    def release(self, buf: AlignedBuffer) -> None:
        with self._lock:
            spares = self._free.setdefault(buf.nbytes, [])
            if len(spares) < self.per_class and self.spare_bytes + buf.nbytes <= self.max_spare_bytes:
                spares.append(buf)
                self.spare_bytes += buf.nbytes
            # else: dropped; the mapping is unmapped once its last view is gone
