"""The scheduler's page accounting: what a step may promise each sequence, and opening a sequence on its stored prefix.

``PageAllocator`` implements the scheduler's ``KVAllocator`` over the KV cache: a waiting prompt is admitted when
its pages fit what the tiers can still promise (and prompts in progress stay within ``prompt_memory_share`` of the
memory tiers: one prompt always runs, however large); a running sequence gets more tokens while they fit beside
what this step's plan already reserved. Its first chunk opens the sequence on its longest stored prefix (looked
up, not read: the step's load phase reads it), within its ``cache_salt``.
"""

from __future__ import annotations

from collections.abc import Callable

from kvdrive.runtime.engine.model_runner import ModelRunner
from kvdrive.runtime.engine.request import SequenceState


class PageAllocator:
    def __init__(self, runner: ModelRunner, prompts_in_progress: Callable[[], list[SequenceState]],
                 prompt_memory_share: Callable[[], float]) -> None:
        """``prompts_in_progress``: the running sequences still feeding their prompt; ``prompt_memory_share``:
        the share of the memory tiers they may hold (the scheduler's config, which changes live)."""
        self.runner = runner
        self.cache = runner.cache
        self._prompts = prompts_in_progress
        self._share = prompt_memory_share
        self._reserved = 0  # pages promised to this step's chunks (the scheduler's plan)

    def start_plan(self) -> None:
        self._reserved = 0

    def can_admit(self, seq: SequenceState) -> bool:
        if seq.warmup is not None and not seq.warmup.done():
            return False  # its prefix is still being fetched from the shared tier
        cache = self.cache
        if cache.pages_needed(None, len(seq.pending) + 1) + self._reserved > cache.free_pages:
            return False
        prompts = self._prompts()
        if not prompts:
            return True  # one prompt always runs, however large
        held = sum(cache.pages_needed(None, len(s.tokens)) for s in prompts + [seq])
        return held <= cache.memory_pages * self._share()

    def can_allocate(self, seq: SequenceState, n: int) -> bool:
        cache = self.cache
        return cache.pages_needed(seq.seq_id, n) + self._reserved <= cache.free_pages

    def allocate(self, seq: SequenceState, n: int) -> int:
        if seq.seq_id is None:  # first chunk: open the sequence; stored prefix pages (read in the step's load
            # phase) need no compute; a salted request matches only its own salt's pages
            # a request asking for its prompt's log-probabilities computes all of it (prompt_logprobs.py)
            reuse = seq.request.params.prompt_logprobs is None
            if seq.warmup is not None:  # pages fetched from the shared tier join the stored ones first
                self.cache.land_prefix(seq.warmup)
                seq.warmup = None
            seq.seq_id, reused = self.runner.open_sequence(seq.tokens if reuse else (), load=False,
                                                           salt=seq.request.cache_salt)
            seq.num_computed += reused
            if seq.cached_tokens is None:  # what the client is told: its first admission (not a recompute's)
                seq.cached_tokens = min(reused, len(seq.request.prompt_ids))
        n = min(n, seq.prefill_left or 1)  # a recomputed request's generated tokens: one per step (decode)
        self._reserved += self.cache.pages_needed(seq.seq_id, n)
        return n
