"""The KV cache's configuration (tier budgets nested in the engine's) and the device envelope's split: plain data."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
