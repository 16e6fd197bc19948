"""Plain data of the engine's tiered KV cache: its configuration, per-sequence state, one step's
descriptor, the per-step admission state of a tier, page digests and the error for a lost page."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvdrive.runtime.attention import PageSummaries
from kvdrive.runtime.kvcache import BlockKey
from kvdrive.runtime.kvcache.keys import DIGEST_BYTES


class PageLostError(RuntimeError):
    """A page a running sequence needs could not be read from any tier (its KV must be recomputed)."""

    def __init__(self, seq_id: int, what: str) -> None:
        super().__init__(what)
        self.seq_id = seq_id


@dataclass(frozen=True)
class TierConfig:
    gpu_bytes: int  # device tier for KV, tails included
    dram_bytes: int = 0
    ssd_bytes: int = 0
    ssd_dir: str | None = None
    hugetlbfs_dir: str | None = None
    ssd_codec: str = "none"  # none | int8
    placement: str = "kvdrive"
    full_attention: bool = False
    token_budget: int = 1024
    max_sequences: int = 16  # open tail pages reserved in the gpu budget
    persist: bool = True  # write sealed pages through to the SSD tier (prefix reuse across restarts)
    io_threads: int = 4


@dataclass
class SeqKV:
    tokens: list[int] = field(default_factory=list)  # tokens whose KV is stored (or being stored this step)
    length: int = 0
    digests: list[bytes] = field(default_factory=list)  # one per sealed page
    tail_k: torch.Tensor | None = None  # [L, S, Hkv, D]
    tail_v: torch.Tensor | None = None
    summaries: PageSummaries | None = None
    inexact: bool = False  # a decode step attended to selected pages only: later pages are addressed apart
    selected: list[list[BlockKey] | None] = field(default_factory=list)  # per layer, last decode step
    runners_up: list[list[BlockKey]] = field(default_factory=list)  # per layer: next pages by score


@dataclass(frozen=True)
class StepSeq:
    """One sequence's share of a forward step."""

    seq_id: int
    start: int  # tokens stored before this step
    num_new: int
    positions: torch.Tensor  # [num_new]
    decode: bool  # a generated token (sparse under page selection); False: prompt tokens, always exact
    new_digests: tuple[bytes, ...]  # pages this step seals, in order


PREFETCH_PROBE = 8  # while prefetch does not pay, try it every 8th step
PREFETCH_MIN_PRECISION = 0.5  # prefetch while at least half of what it moves is then used
PROMOTE_MARGIN = 1.5  # a block replaces the device tier's coldest only when 1.5x hotter
PROMOTE_MIN_GAIN = 0.05  # ... and by at least this much attention mass (scores are in [0, Hq] per step)


@dataclass
class Admission:
    """A tier's admission state during one step (see ``TieredKVCache.update_floors``)."""

    free: int
    residents: Callable[[], list[float]]  # the residents' hotness, ascending (asked once they are needed)
    margin: float
    gain: float
    displaced: int = 0
    _scores: list[float] | None = None

    def admit(self, score: float) -> bool:
        if self.free > 0:
            self.free -= 1
            return True
        if self._scores is None:
            self._scores = self.residents()
        if self.displaced >= len(self._scores):
            return False
        floor = self._scores[self.displaced]
        if score > max(floor * self.margin, floor + self.gain):
            self.displaced += 1
            return True
        return False


def chain_digest(prev: bytes, tokens: list[int], salt: bytes = b"") -> bytes:
    """Page digest: the previous page's digest, a salt (how the KV was computed) and the page's tokens."""
    return hashlib.blake2b(prev + salt + np.asarray(tokens, dtype=np.int64).tobytes(),
                           digest_size=DIGEST_BYTES).digest()
