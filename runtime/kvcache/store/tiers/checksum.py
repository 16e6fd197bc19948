"""The checksum of one SSD slot: CRC-32 (IEEE 802.3, the value ``zlib.crc32`` gives).

Owns which implementation computes it: ISA-L's (package ``isal``, PCLMUL/AVX-512 folding, ~25 GB/s
on one core here) when it is installed, else zlib's (~5 GB/s). Both give identical values, so slabs
and index journals written with one verify with the other, and the on-disk format does not depend
on which is installed. Both take any buffer (a memoryview slice of an aligned staging buffer).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

Crc32 = Callable[..., int]  # (data, start value=0): zlib.crc32's signature


def _pick() -> tuple[Crc32, str]:
    try:
        from isal import isal_zlib
    except ImportError:
        return zlib.crc32, "zlib"
    return isal_zlib.crc32, "isal"


CRC32, CRC32_IMPL = _pick()


def slot_crcs(mv: memoryview, start: int, count: int, slot_bytes: int, crc: Crc32 = CRC32) -> list[int]:
    """CRC of each of ``count`` consecutive slots of ``mv`` starting at byte ``start``."""
    return [crc(mv[o : o + slot_bytes]) for o in range(start, start + count * slot_bytes, slot_bytes)]
