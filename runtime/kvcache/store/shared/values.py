"""The shared tier's value format: one page (every layer) with a header that lets a reader prove it is the page it asked for.

A value in the shared store is self-contained, so no metadata can outlive its data when the store evicts
it, and a reader trusts nothing but the bytes it got:

``header | payload``, the header little-endian (``HEADER``):

- magic ``b"KVDS"`` and the format version;
- the page digest (the key's own: a value stored under another page's key is refused);
- the cache identity: a digest of the model fingerprint (model, KV dtype, page size, layout), so a value
  written by another model or dtype is refused even under a colliding key;
- the layers and the bytes of one layer's block, and the payload's length (a truncated value is refused);
- a CRC-32 over the digest, the identity and the payload (a flipped byte is refused): the SSD tier's CRC
  (``store.tiers.checksum``: ISA-L's when installed, else zlib's; the same values).

The payload is the page's blocks, layer-major: ``[num_layers, block_bytes]`` uint8, as the local tiers hold
them. ``decode`` returns them or raises ``BadValue`` naming the cause (``CAUSES``), which callers count.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch

from kvdrive.runtime.kvcache.store.tiers.checksum import CRC32

MAGIC = b"KVDS"
VERSION = 1
HEADER = struct.Struct("<4sH16s16sIIQI")  # magic, version, digest, identity, layers, block bytes, payload, crc
CAUSES = ("truncated", "magic", "version", "digest", "identity", "layout", "checksum")


class BadValue(ValueError):
    """A value that is not the page asked for; ``cause`` is one of ``CAUSES``."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause = cause


def cache_identity(fingerprint: str) -> bytes:
    """The 16-byte identity of a cache's pages: model, KV dtype, page size and layout (the fingerprint)."""
    return hashlib.blake2b(b"kvdrive-shared:" + fingerprint.encode(), digest_size=16).digest()


@dataclass(frozen=True)
class PageFormat:
    """What every value of one cache must say: its identity and its blocks' shape."""

    identity: bytes  # cache_identity(fingerprint)
    num_layers: int
    block_bytes: int

    @property
    def payload_bytes(self) -> int:
        return self.num_layers * self.block_bytes

    @property
    def value_bytes(self) -> int:
        return HEADER.size + self.payload_bytes

    def encode(self, digest: bytes, blocks: torch.Tensor) -> bytes:
        """The value of page ``digest`` from its blocks [num_layers, block_bytes] uint8."""
        if tuple(blocks.shape) != (self.num_layers, self.block_bytes) or blocks.dtype != torch.uint8:
            raise ValueError(f"blocks {tuple(blocks.shape)} {blocks.dtype}: expected "
                             f"({self.num_layers}, {self.block_bytes}) uint8")
        payload = blocks.contiguous().cpu().numpy().tobytes()
        crc = CRC32(payload, CRC32(digest + self.identity))
        return HEADER.pack(MAGIC, VERSION, digest, self.identity, self.num_layers, self.block_bytes,
                           len(payload), crc) + payload

    def decode(self, digest: bytes, value: bytes) -> torch.Tensor:
        """Page ``digest``'s blocks [num_layers, block_bytes] uint8 from ``value``, only whole and verified."""
        if len(value) < HEADER.size:
            raise BadValue("truncated", f"{len(value)} bytes, shorter than the header")
        magic, version, got, identity, layers, block, length, crc = HEADER.unpack_from(value)
        if magic != MAGIC:
            raise BadValue("magic", f"magic {magic!r}")
        if version != VERSION:
            raise BadValue("version", f"format version {version}, this reader knows {VERSION}")
        if got != digest:
            raise BadValue("digest", f"the value is page {got.hex()}")
        if identity != self.identity:
            raise BadValue("identity", "written by another model, KV dtype or page layout")
        if (layers, block) != (self.num_layers, self.block_bytes):
            raise BadValue("layout", f"{layers} layers x {block} bytes, expected {self.num_layers} x {self.block_bytes}")
        if length != self.payload_bytes or len(value) != HEADER.size + length:
            raise BadValue("truncated", f"{len(value) - HEADER.size} payload bytes, header says {length}, "
                           f"expected {self.payload_bytes}")
        payload = memoryview(value)[HEADER.size :]
        if CRC32(payload, CRC32(digest + identity)) != crc:
            raise BadValue("checksum", "CRC-32 mismatch")
        blocks = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return blocks.view(self.num_layers, self.block_bytes)
