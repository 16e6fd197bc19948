"""Plain data of the engine's KV cache: its configuration (tier budgets nested in the engine's), one
sequence's state, one step's descriptor, and the error for a lost page."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class PageLostError(RuntimeError):
    """A page a running sequence needs could not be read from any tier (its KV must be recomputed)."""

    def __init__(self, seq_id: int, what: str) -> None:
        super().__init__(what)
        self.seq_id = seq_id


@dataclass(frozen=True)
class TierConfig:
    """Byte budgets and backings of the three tiers."""

    envelope_bytes: int | None = None  # the device envelope: hot KV tier + running sequences' reserve (open
    # pages, decode step buffers); None: one full-context sequence. The CLI, HTTP API and CRD call it the gpu budget
    dram_bytes: int = 0
    ssd_bytes: int = 0
    ssd_dir: str | None = None
    hugetlbfs_dir: str | None = None
    ssd_codec: str = "none"  # none | int8
    ssd_backend: str = "posix"  # posix | kvikio (asked for explicitly: see kvikio_backend)
    persist: bool = True  # write sealed pages through to the SSD tier (prefix reuse across restarts)
    io_threads: int = 4


@dataclass(frozen=True)
class EngineConfig:
    tiers: TierConfig = field(default_factory=TierConfig)
    placement: str = "kvdrive"  # kvdrive | lru | ondemand | fullfetch
    full_attention: bool = False
    token_budget: int = 1024  # tokens each decode query attends to (selected pages + the open one)
    selection_radius: float = 1.0  # the box radius' weight in a page's selection score (SelectionConfig)
    selection_carry: str = "layer"  # layer | shared | shared+neighbours: the previous step's mass a page carries
    selection_sketch: int = 8  # 0, 4 or 8: bits of the per-key sketch that scores pages (0: the box bound)
    page_size: int = 16
    kv_dtype: torch.dtype | None = None  # None: the model's dtype
    max_sequences: int = 16  # the most sequences that may ever run at once (rows and open pages reserved)
    max_running: int | None = None  # sequences that may run at once to start with (live; None: max_sequences)
    prefill_chunk: int = 512  # tokens per prefill forward in ``ModelRunner.prefill`` (bounds activation memory)
    window_checkpoint: int = 2048  # hybrid models: a long prompt keeps its window every this many tokens (0: off)

    @property
    def start_running(self) -> int:
        """The sequences that may run at once to start with."""
        return self.max_running if self.max_running is not None else self.max_sequences


@dataclass(frozen=True)
class EnvelopeSplit:
    """How the device envelope (the gpu budget) is split now: the hot KV tier, and the reserve for running
    sequences: a fixed part (the open pages, and a hybrid model's windows, of every row) and
    ``per_sequence_bytes`` (one decode step buffer) for each of the ``max_running`` sequences."""

    envelope_bytes: int
    hot_bytes: int
    fixed_reserve_bytes: int
    per_sequence_bytes: int
    max_running: int
    max_sequences: int
    pending_max_running: int | None = None  # a smaller limit waiting for running sequences to finish

    @property
    def reserve_bytes(self) -> int:
        return self.fixed_reserve_bytes + self.max_running * self.per_sequence_bytes


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
