"""One sequence's state in the cache, one step's share of it, and the error for a page no tier can serve: plain data."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class PageLostError(RuntimeError):
    """A page a running sequence needs could not be read from any tier (its KV must be recomputed)."""

    def __init__(self, seq_id: int, what: str) -> None:
        super().__init__(what)
        self.seq_id = seq_id


@dataclass
class SeqKV:
    """One sequence in the cache. Its open (partial) page lives in the device pool's tail rows at ``row``."""

    row: int  # batch row: summaries, page table and tail rows are indexed by it
    root: bytes = b""  # the digest chain's start: the cache's root, salted by the request's cache_salt
    tokens: list[int] = field(default_factory=list)  # tokens whose KV is stored (or being stored this step)
    length: int = 0
    digests: list[bytes] = field(default_factory=list)  # one per sealed page
    pids: list[int] = field(default_factory=list)  # dense page id of each sealed page
    inexact: bool = False  # a decode step attended to selected pages only: later pages are addressed apart
    prefilling: bool = True  # its prompt is still going in: placement holds its pages in the memory tiers
    settled: bool = True  # its last step finished (False from ``begin`` until ``finish_step``)
    window_from: int = 0  # hybrid models: the first position whose sliding-layer KV its ring was given
    window_kept: int = 0  # hybrid models: the boundary (in tokens) of its latest window snapshot
    unloaded: int = 0  # leading pages matched in the tiers at open and not read yet (``load_prefix``)


@dataclass(frozen=True)
class StepSeq:
    """One sequence's share of a forward step."""

    seq_id: int
    row: int
    start: int  # tokens stored before this step
    num_new: int
    positions: torch.Tensor  # [num_new]
    decode: bool  # a generated token (sparse under page selection); False: prompt tokens, always exact
    new_digests: tuple[bytes, ...]  # pages this step seals, in order
