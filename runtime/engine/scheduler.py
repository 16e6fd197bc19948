"""Continuous batching: which sequences run in the next step and how many tokens each feeds.

Every step, decoding sequences feed their one new token first; the remaining token budget goes to
prompt chunks (chunked prefill), so a long prompt never stalls running decodes. The scheduler both
checks and allocates: a ``KVAllocator`` answers ``can_admit`` / ``can_allocate`` and then ``allocate``s
(opening a new sequence with prefix reuse, which may shorten what it still has to feed), so the chunks
it returns are final. When the KV cache cannot hold a decode, the most recently admitted sequence is
preempted (its pages freed, its tokens recomputed later).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

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


@dataclass(frozen=True)
class ScheduledChunk:
    seq: SequenceState
    num_tokens: int

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

    def plan(self, kv: KVAllocator, preempt: Callable[[SequenceState], None]) -> list[ScheduledChunk]:
        """The next step's chunks, allocated. Calls ``preempt`` (which must free pages) when a decode lacks room."""
        kv.start_plan()
        budget = self.config.step_token_budget
        chunks: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        for seq in list(self.running):  # decodes, oldest first: victims are always unscheduled ones
            if seq not in self.running or seq.num_generated == 0 or len(seq.pending) != 1:
                continue
            while not kv.can_allocate(seq, 1) and seq in self.running:
                preempt(self.running[-1])  # frees the victim's pages and calls requeue()
            if seq not in self.running:
                continue
            chunks.append(ScheduledChunk(seq, kv.allocate(seq, 1)))
            scheduled.add(id(seq))
            budget -= 1
        for seq in self.running:  # prompt chunks of sequences already admitted
            if budget <= 0 or not seq.pending or id(seq) in scheduled:
                continue
            n = min(len(seq.pending), budget)
            if not kv.can_allocate(seq, n):
                continue
            n = kv.allocate(seq, n)
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running:
            seq = self.waiting[0]
            if not kv.can_admit(seq):  # admit only when the whole prompt (and one more token) fits: no thrashing
                break
            self.waiting.popleft()
            self.running.append(seq)
            n = kv.allocate(seq, budget)
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return chunks

    def requeue(self, seq: SequenceState) -> None:
        """A preempted sequence goes back to the front of the queue."""
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def remove(self, seq: SequenceState) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
