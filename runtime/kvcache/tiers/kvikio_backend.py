"""The SSD tier through KvikIO (cuFile / GPUDirect Storage): same files, index and checksums as the
POSIX backend, with the slab I/O done by ``kvikio.CuFile``. Chosen automatically when CUDA and kvikio
are both present (extra ``gpu``); KvikIO cannot do any I/O without the NVIDIA driver, so the POSIX
backend is used everywhere else.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

import torch

from kvdrive.runtime.kvcache.tiers.ssd import PosixIO, SsdTier

log = logging.getLogger(__name__)


def kvikio_usable() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("kvikio") is not None


class KvikioIO(PosixIO):
    """preadv/pwritev on top of CuFile handles opened per slab file descriptor."""

    def __init__(self) -> None:
        import kvikio

        self._kvikio = kvikio
        self._files: dict[int, Any] = {}

    def _file(self, fd: int) -> Any:
        f = self._files.get(fd)
        if f is None:
            f = self._files[fd] = self._kvikio.CuFile(os.readlink(f"/proc/self/fd/{fd}"), "r+")
        return f

    def preadv(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        done = 0
        for b in bufs:  # the buffers are consecutive slots of one aligned staging buffer
            done += self._file(fd).pread(b, len(b), offset + done).get()
        return done

    def pwritev(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        done = 0
        for b in bufs:
            done += self._file(fd).pwrite(b, len(b), offset + done).get()
        return done

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


class KvikioSsdTier(SsdTier):
    def __init__(self, directory: str, block_bytes: int, budget_bytes: int, **kw: Any) -> None:
        self._kio = KvikioIO()
        super().__init__(directory, block_bytes, budget_bytes, io=self._kio, **kw)
        log.info("ssd tier uses KvikIO (cuFile) for %s", directory)

    @property
    def backing(self) -> str:
        return f"kvikio:{self.dir}"

    def close(self) -> None:
        super().close()
        self._kio.close()
