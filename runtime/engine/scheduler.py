"""Continuous batching: which sequences run in the next step and how many tokens each feeds.

Every step, decoding sequences feed their one new token first; the remaining token budget goes to
prompt chunks (chunked prefill), so a long prompt never stalls running decodes.

How the prompt budget is shared is the policy:
- ``fair`` (the default): the oldest prompt in progress always gets ``oldest_share`` of the budget, and
  the rest goes to the shortest remaining prompts first, running and waiting alike. A short request
  starts within a step or two of its arrival instead of queueing behind a long prefill; a long prompt is
  slowed by at most 1/``oldest_share``, never starved. A waiting request can be overtaken by at most
  ``max_bypass`` later ones; then admission is first come, first served until it is in.
- ``fifo``: prompts in arrival order, each taking what budget is left. The scheduler both
checks and allocates: a ``KVAllocator`` answers ``can_admit`` / ``can_allocate`` and then ``allocate``s
(opening a new sequence on its stored prefix, which may shorten what it still has to feed). Planning
does no I/O: an allocation only looks the stored prefix up and references its pages; the step's load
phase (``LLMEngine._load``) reads them, and starts a chunk earlier when some could not be read. When the KV cache cannot hold a decode, the most recently
admitted sequence is preempted (its pages freed, its tokens recomputed later).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from kvdrive.runtime.engine.request import SequenceState


class KVAllocator(Protocol):
    def start_plan(self) -> None:
        """A new step's plan begins: nothing is reserved yet."""

    def can_admit(self, seq: SequenceState) -> bool:
        """A waiting sequence's whole prompt (and one more token) fits now."""

    def can_allocate(self, seq: SequenceState, n: int) -> bool:
        """``n`` more tokens of a running sequence fit, with what this plan already reserved."""

    def allocate(self, seq: SequenceState, n: int) -> int:
        """Reserve room for up to ``n`` tokens (opening the sequence, with prefix reuse, if it has no KV
        yet); returns how many tokens it feeds this step."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int = 16  # sequences in the running batch
    max_waiting: int = 64  # queued requests before new ones are refused (HTTP 429)
    step_token_budget: int = 512  # tokens fed per step (decodes + prefill chunks)
    step_seconds: float = 0.0  # latency target of a step: fewer prompt tokens when steps run slow (pacing.py); 0: off
    policy: Literal["fair", "fifo"] = "fair"  # how prompt chunks share the step's budget (module docstring)
    oldest_share: float = 0.25  # fair: the budget fraction the oldest prompt in progress always gets
    max_bypass: int = 16  # fair: later requests admitted ahead of a waiting one before it goes first
    # prompts in progress may fill this share of the memory tiers (device + DRAM); a prompt that would pass
    # it waits, one always runs: every chunk of a prompt reads all its earlier pages, so prompts that spill
    # to the SSD tier re-read it chunk after chunk (measured in docs/reliability.md)
    prompt_memory_share: float = 0.75

    def __post_init__(self) -> None:
        if not 0 < self.oldest_share <= 1:
            raise ValueError(f"oldest_share must be in (0, 1], not {self.oldest_share}")
        if self.step_seconds < 0:
            raise ValueError(f"step_seconds must be >= 0, not {self.step_seconds}")
        if not 0 < self.prompt_memory_share:
            raise ValueError(f"prompt_memory_share must be positive, not {self.prompt_memory_share}")


@dataclass(frozen=True)
class ScheduledChunk:
    seq: SequenceState
    num_tokens: int
    decode: bool = False  # generated tokens fed one at a time (page selection applies), not prompt

    @classmethod
    def of(cls, seq: SequenceState, num_tokens: int) -> ScheduledChunk:
        """A chunk of ``seq``'s pending tokens: decode once its prompt is in (a sampled token, or one replayed
        after a preemption), prompt before."""
        return cls(seq, num_tokens, decode=seq.num_generated > 0 and seq.prefill_left == 0)

    @property
    def completes(self) -> bool:
        """This chunk feeds the sequence's last pending token: sample after the step."""
        return self.num_tokens == len(self.seq.pending)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def plan(self, kv: KVAllocator, preempt: Callable[[SequenceState], None],
             budget: int | None = None) -> list[ScheduledChunk]:
        """The next step's chunks, allocated, within ``budget`` tokens (default: the configured budget). Calls
        ``preempt`` (which must free pages) when a decode lacks room."""
        kv.start_plan()
        budget = self.config.step_token_budget if budget is None else budget
        chunks: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        for seq in list(self.running):  # decodes, oldest first: victims are always unscheduled ones
            if seq not in self.running or seq.num_generated == 0 or seq.prefill_left > 0:
                continue  # not decoding (a sampled token, or a generated one replayed after a preemption)
            while not kv.can_allocate(seq, 1) and seq in self.running:
                preempt(self.running[-1])  # frees the victim's pages and calls requeue()
            if seq not in self.running:
                continue
            chunks.append(ScheduledChunk.of(seq, kv.allocate(seq, 1)))
            scheduled.add(id(seq))
            budget -= 1
        if self.config.policy == "fifo":
            self._prompts_fifo(kv, chunks, scheduled, budget)
        else:
            self._prompts_fair(kv, chunks, scheduled, budget)
        return chunks

    def _prompts_fifo(self, kv: KVAllocator, chunks: list[ScheduledChunk], scheduled: set[int], budget: int) -> None:
        for seq in self.running:  # prompt chunks of sequences already admitted
            if budget <= 0 or not seq.prefill_left or id(seq) in scheduled:
                continue
            n = min(seq.prefill_left, budget)
            if not kv.can_allocate(seq, n):
                continue
            n = kv.allocate(seq, n)
            chunks.append(ScheduledChunk.of(seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running:
            seq = self.waiting[0]
            if not kv.can_admit(seq):  # admit only when the whole prompt (and one more token) fits: no thrashing
                break
            self.waiting.popleft()
            self.running.append(seq)
            n = kv.allocate(seq, budget)
            chunks.append(ScheduledChunk.of(seq, n))
            budget -= n

    def _prompts_fair(self, kv: KVAllocator, chunks: list[ScheduledChunk], scheduled: set[int], budget: int) -> None:
        prompts = [s for s in self.running if s.prefill_left and id(s) not in scheduled]
        oldest: ScheduledChunk | None = None
        if prompts and budget > 0:  # the oldest prompt in progress always moves: slowed, never starved
            seq = prompts.pop(0)
            n = min(seq.prefill_left, max(1, int(budget * self.config.oldest_share)))
            if kv.can_allocate(seq, n):
                oldest = ScheduledChunk.of(seq, kv.allocate(seq, n))
                chunks.append(oldest)
                budget -= oldest.num_tokens
        head = self.waiting[0] if self.waiting else None
        head_first = head is not None and head.bypassed >= self.config.max_bypass
        pool = prompts + ([head] if head_first else list(self.waiting))  # type: ignore[list-item]
        admitted = {id(s) for s in prompts}
        for seq in sorted(pool, key=lambda s: len(s.pending)):  # shortest remaining prompt first (stable)
            if budget <= 0:
                break
            if id(seq) in admitted:
                n = min(seq.prefill_left, budget)
                if kv.can_allocate(seq, n):
                    n = kv.allocate(seq, n)
                    chunks.append(ScheduledChunk.of(seq, n))
                    budget -= n
                continue
            if len(self.running) >= self.config.max_running:
                continue
            if not kv.can_admit(seq):  # admit only when the whole prompt (and one more token) fits: no thrashing
                if head_first:
                    break
                continue
            self.waiting.remove(seq)
            self.running.append(seq)
            if head is not None and seq is not head and any(w is head for w in self.waiting):
                head.bypassed += 1
            n = kv.allocate(seq, budget)
            chunks.append(ScheduledChunk.of(seq, n))
            budget -= n
        if oldest is not None and budget > 0 and oldest.seq.prefill_left > oldest.num_tokens:
            n = min(oldest.seq.prefill_left, oldest.num_tokens + budget)  # what nobody else wanted
            if kv.can_allocate(oldest.seq, n):
                chunks[chunks.index(oldest)] = ScheduledChunk.of(oldest.seq, kv.allocate(oldest.seq, n))

    def requeue(self, seq: SequenceState) -> None:
        """A preempted sequence goes back to the front of the queue."""
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def remove(self, seq: SequenceState) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
