"""Block devices for the fault bench (as root): an ext4 image on a loop device, filling it, and where a
file's extents lie on the device (to know which blocks a shrunk device turns into EIO).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

MiB = 1 << 20


def sh(*cmd: str) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout.strip()


@contextlib.contextmanager
def loop_fs(image: Path, mib: int, mnt: Path, mkfs: tuple[str, ...]) -> Iterator[str]:
    """An ext4 image of ``mib`` MiB on a loop device mounted at ``mnt``; yields the loop device."""
    image.unlink(missing_ok=True)
    with open(image, "wb") as f:
        f.truncate(mib * MiB)
    dev = ""
    try:
        sh("mkfs.ext4", "-q", "-F", *mkfs, str(image))
        dev = sh("losetup", "-f", "--show", str(image))
        mnt.mkdir(parents=True, exist_ok=True)
        sh("mount", "-o", "errors=continue", dev, str(mnt))
        yield dev
    finally:
        cleanup_mount(mnt, dev, image)


def cleanup_mount(mnt: Path, dev: str, image: Path) -> None:
    if os.path.ismount(mnt):
        try:
            sh("umount", str(mnt))
        except RuntimeError as exc:
            print(f"umount: {exc}; lazy unmount", file=sys.stderr)
            subprocess.run(["umount", "-l", str(mnt)])
    if dev:
        subprocess.run(["losetup", "-d", dev])
    image.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        mnt.rmdir()


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: Path, leave: int) -> int:
    """Write a filler file until only ``leave`` bytes are free (0: until ENOSPC); returns bytes written."""
    written = 0
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)
    try:
        for chunk in (MiB, 64 << 10, 4096, 1024):
            buf = b"\xa5" * chunk
            while free_bytes(path.parent) - chunk >= leave:
                try:
                    written += os.write(fd, buf)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
            os.fsync(fd)
    finally:
        os.close(fd)
    return written


def extents_beyond(path: Path, cut_bytes: int) -> tuple[int, int]:
    """(bytes of ``path`` that lie at or past ``cut_bytes`` on the device, bytes mapped) from filefrag."""
    out = sh("filefrag", "-v", "-b1024", str(path))
    beyond = total = 0
    for lo, hi in re.findall(r"^\s*\d+:\s+\d+\.\.\s*\d+:\s+(\d+)\.\.\s*(\d+):", out, re.M):
        a, b = int(lo) * 1024, (int(hi) + 1) * 1024
        total += b - a
        beyond += max(0, b - max(a, cut_bytes))
    return beyond, total
