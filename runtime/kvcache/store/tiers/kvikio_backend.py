"""The SSD tier through KvikIO (cuFile / GPUDirect Storage): same files, index and checksums as the
POSIX backend, with the slab I/O done by ``kvikio.CuFile``. Used only when asked for
(``--ssd-backend kvikio``; needs CUDA and the ``gpu`` extra): on its first GPU machine (an H200 without
GDS, so KvikIO's compatibility mode) it read 2.8 GB/s against the POSIX backend's 0.94 in the tier
benchmark, but under the decode benchmark's prefill its writes failed with EPERM and a restart's
startup check met an EOF (``bench/results/gpu/README.md``), so the POSIX backend stays the default.
KvikIO's failures (``RuntimeError``) are raised as ``OSError`` here, so that the tier's fault handling
(a failing tier, retries from another copy) applies to them as to a failed system call.
"""

from __future__ import annotations

import errno
import importlib.util
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from kvdrive.runtime.kvcache.store.tiers.ssd import PosixIO, SsdTier

log = logging.getLogger(__name__)


def kvikio_unusable_reason() -> str | None:
    """Why KvikIO cannot run here (None: it can)."""
    if importlib.util.find_spec("kvikio") is None:
        return "kvikio is not installed (pip install '.[gpu]')"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (KvikIO needs the NVIDIA driver)"
    return None


def _io(what: str, fd: int, call: Callable[[], int]) -> int:
    try:
        return call()
    except RuntimeError as exc:  # KvikIO reports POSIX and cuFile failures as RuntimeError
        raise OSError(errno.EIO, f"KvikIO {what} on fd {fd}: {exc}") from exc


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
            done += _io("read", fd, lambda b=b, at=offset + done: self._file(fd).pread(b, len(b), at).get())
        return done

    def pwritev(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        done = 0
        for b in bufs:
            done += _io("write", fd, lambda b=b, at=offset + done: self._file(fd).pwrite(b, len(b), at).get())
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
