"""Page identity: block keys.

A block is one layer's page (K and V of `page_size` tokens, all KV heads). Its key is a 16-byte
digest plus the layer. Pages are content-addressed (``kvdrive.runtime.prompt.digests``): a chain hash of
the model fingerprint and every token up to the page end, so equal prefixes map to equal keys across
requests, replicas and restarts.
"""

from __future__ import annotations

from kvdrive.runtime.prompt.digests import DIGEST_BYTES


class BlockKey:
    """Immutable (digest, layer). Hash and equality are hand-written: block keys are dictionary keys on
    every page read (thousands per decode step), and a dataclass's generated ones build a tuple per call."""

    __slots__ = ("_hash", "digest", "layer")
    digest: bytes  # DIGEST_BYTES
    layer: int

    def __init__(self, digest: bytes, layer: int) -> None:
        if len(digest) != DIGEST_BYTES:
            raise ValueError(f"a block digest is {DIGEST_BYTES} bytes, got {len(digest)}")
        object.__setattr__(self, "digest", digest)
        object.__setattr__(self, "layer", layer)
        object.__setattr__(self, "_hash", hash((digest, layer)))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("BlockKey is immutable")

    def __hash__(self) -> int:
        return self._hash  # type: ignore[no-any-return]

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if other.__class__ is not BlockKey:
            return NotImplemented
        return self._hash == other._hash and self.layer == other.layer and self.digest == other.digest  # type: ignore[attr-defined]

    def __lt__(self, other: BlockKey) -> bool:
        return (self.digest, self.layer) < (other.digest, other.layer)

    def __reduce__(self) -> tuple[type[BlockKey], tuple[bytes, int]]:
        return BlockKey, (self.digest, self.layer)

    def __repr__(self) -> str:
        return f"BlockKey({self.digest.hex()[:12]}, L{self.layer})"
