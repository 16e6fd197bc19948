"""The device envelope of the KV cache and its live split between the hot tier and concurrency.

Owns the arithmetic and the one move. The gpu budget is one envelope of device bytes:

    envelope = hot tier (the store's device tier)
             + fixed reserve (every row's open pages, and a hybrid model's sliding windows)
             + max_running x per-sequence reserve (one decode step buffer each)

The per-sequence reserve is the buffer a decode step reads each layer's selected pages into
(``PageReader``'s ``[2, B, Hkv, K+1, S*D]``: K+1 page columns of one layer, K and V), allocated here once
for ``max_running`` sequences and cut into each step's batch, so that the split is real bytes: one more
running sequence is one buffer's worth less hot tier. Under full attention the buffer grows with the
context and cannot be reserved (``columns`` is 0): the step allocates it outside the envelope and
``max_running`` moves no bytes.

``set_max_running`` moves the split between steps (engine thread). Growing concurrency shrinks the hot
tier first (the store demotes pages; BudgetError, nothing changed, when the pages running sequences need
would not fit); shrinking waits until at most the new limit runs (the scheduler admits no more
meanwhile), then gives the buffers back to the hot tier (``settle``, after each step).
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from kvdrive.runtime.attention import SelectionConfig
from kvdrive.runtime.kvcache.config import EngineConfig, EnvelopeSplit
from kvdrive.runtime.kvcache.placement import policy_for
from kvdrive.runtime.kvcache.store import BudgetError, KVLayout

log = logging.getLogger(__name__)

DEVICE_FREE_SHARE = 0.8  # of a CUDA device's free memory (after the weights) that a default gpu budget may take


def step_columns(config: EngineConfig) -> int:
    """Page columns of one decode step buffer: the selected pages and the open one (0 under full attention)."""
    sparse = policy_for(config.placement, config.full_attention).sparse
    return SelectionConfig(config.token_budget, config.page_size).budget_pages + 1 if sparse else 0


def reserve_bytes(layout: KVLayout, config: EngineConfig, window_bytes: int = 0) -> int:
    """What the envelope keeps for running sequences beside the hot tier, at the config's start limit:
    every row's open page (and sliding window, ``window_bytes`` each) and each running sequence's step buffer."""
    return (config.max_sequences * (layout.page_bytes + window_bytes)
            + config.start_running * step_columns(config) * layout.block_bytes)


def default_envelope_bytes(layout: KVLayout, config: EngineConfig, context: int, window_bytes: int,
                           device: torch.device) -> int:
    """The gpu budget when none is given: one full-context sequence's pages plus everything the envelope
    reserves (every row's open page and sliding window, the running sequences' step buffers). On CUDA it is
    capped at ``DEVICE_FREE_SHARE`` of the device's free memory, read after the weights were loaded, so the
    activations keep the rest; BudgetError when even that leaves no page beside the reserves."""
    reserve = reserve_bytes(layout, config, window_bytes)
    want = layout.pages_for(context) * layout.page_bytes + reserve
    if device.type != "cuda":
        return want
    free = int(torch.cuda.mem_get_info(device)[0])
    cap = int(free * DEVICE_FREE_SHARE)
    if cap < reserve + layout.block_bytes:
        raise BudgetError(
            f"the device has {free >> 20} MiB free after the weights; {config.max_sequences} rows and "
            f"{config.start_running} running sequences reserve {reserve >> 20} MiB, more than "
            f"{DEVICE_FREE_SHARE:.0%} of it (lower --max-sequences / --max-running, or free the device)")
    if cap < want:
        log.info("gpu budget defaults to %.0f%% of the device's free memory: %d MiB (one full-context sequence "
                 "would take %d MiB)", DEVICE_FREE_SHARE * 100, cap >> 20, want >> 20)
    return min(want, cap)


class HotTier(Protocol):
    """The device tier as the envelope moves its budget (``KVCache``)."""

    def hot_budget(self) -> int:
        """The device tier's budget now, in bytes."""
        ...

    def resize_hot(self, hot_bytes: int) -> None:
        """Give the device tier ``hot_bytes`` live, on the engine thread with no transfer in flight
        (BudgetError, nothing changed, when the pages running sequences need would not fit)."""
        ...


class Envelope:
    def __init__(self, fixed_reserve: int, columns: int, block_bytes: int, max_sequences: int, max_running: int,
                 device: torch.device) -> None:
        if not 1 <= max_running <= max_sequences:
            raise BudgetError(f"max_running {max_running} must be in [1, {max_sequences}] (--max-sequences)")
        self.fixed_reserve = fixed_reserve
        self.block_bytes = block_bytes
        self.per_sequence_bytes = columns * block_bytes  # columns: of one step buffer (0: full attention)
        self.max_sequences = max_sequences
        self.max_running = max_running
        self.pending: int | None = None  # a smaller limit waiting for running sequences to finish
        self.envelope_bytes = 0  # the gpu budget (set by the cache once it is known)
        self.device = device
        self._hot: HotTier | None = None
        self._buffer = self._new_buffer(max_running)

    def bind(self, hot: HotTier) -> None:
        """The hot tier whose budget is the envelope's other half (the cache, once its store exists)."""
        self._hot = hot

    def reserve(self, max_running: int | None = None) -> int:
        n = self.max_running if max_running is None else max_running
        return self.fixed_reserve + n * self.per_sequence_bytes

    def hot_bytes(self, envelope: int, max_running: int | None = None) -> int:
        """The hot tier's share of ``envelope`` at ``max_running`` (BudgetError when nothing is left)."""
        n = self.max_running if max_running is None else max_running
        hot = envelope - self.reserve(n)
        if hot < self.block_bytes:
            raise BudgetError(
                f"gpu budget {envelope} bytes leaves no room for KV pages: {self.max_sequences} rows reserve "
                f"{self.fixed_reserve} bytes for their open pages (and any sliding windows) and {n} running "
                f"sequences {n * self.per_sequence_bytes} bytes for their decode step buffers (raise the budget "
                f"or lower --max-running / --max-sequences)")
        return hot

    def split(self) -> EnvelopeSplit:
        hot = self._hot.hot_budget() if self._hot is not None else self.hot_bytes(self.envelope_bytes)
        return EnvelopeSplit(envelope_bytes=self.envelope_bytes, hot_bytes=hot, fixed_reserve_bytes=self.fixed_reserve,
                             per_sequence_bytes=self.per_sequence_bytes, max_running=self.max_running,
                             max_sequences=self.max_sequences, pending_max_running=self.pending)

    def step_storage(self, batch: int, width: int) -> torch.Tensor | None:
        """``batch`` x ``width`` page columns of the reserved buffer ([bytes] uint8), or None when they do not
        fit (full attention, or a batch over the limit while a shrink is pending)."""
        need = batch * width * self.block_bytes
        return self._buffer[:need] if 0 < need <= self._buffer.numel() else None

    def _new_buffer(self, n: int) -> torch.Tensor:
        with torch.inference_mode(False):
            return torch.empty(n * self.per_sequence_bytes, dtype=torch.uint8, device=self.device)

    def set_max_running(self, n: int, running: int) -> bool:
        """Move the split to ``n`` running sequences (``running`` run now). Returns False while a smaller
        limit waits for sequences to finish."""
        if not 1 <= n <= self.max_sequences:
            raise BudgetError(f"max_running must be in [1, {self.max_sequences}] (--max-sequences), not {n}")
        if n < running and n < self.max_running:
            self.pending = n
            log.info("envelope split: max_running %d -> %d once %d running sequences are down to %d",
                     self.max_running, n, running, n)
            return False
        self.pending = None
        if n == self.max_running:
            return True
        hot = self.hot_bytes(self.envelope_bytes, n)
        assert self._hot is not None
        if n > self.max_running:  # the hot tier gives the bytes up first (may refuse), then the buffer takes them
            self._hot.resize_hot(hot)
            self._buffer = self._new_buffer(0)
            self._buffer = self._new_buffer(n)
        else:
            self._buffer = self._new_buffer(n)
            self._hot.resize_hot(hot)
        log.info("envelope split: max_running %d -> %d: hot tier %.1f MiB, reserve %.1f MiB of %.1f MiB",
                 self.max_running, n, hot / 2**20, self.reserve(n) / 2**20, self.envelope_bytes / 2**20)
        self.max_running = n
        return True

    def settle(self, running: int) -> None:
        """After a step: apply a pending smaller limit once at most that many sequences run."""
        if self.pending is not None and running <= self.pending:
            self.set_max_running(self.pending, running)
