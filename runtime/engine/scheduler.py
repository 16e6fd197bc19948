"""Continuous batching: which sequences run in the next step and how many tokens each feeds.

Every step, decoding sequences feed their one new token first; the remaining token budget goes to
prompt chunks (chunked prefill), so a long prompt never stalls running decodes. When the KV cache
cannot hold a decode, the most recently admitted sequence is preempted (its pages freed, its
tokens recomputed later). Pure bookkeeping over a cache that answers ``pages_needed`` and
``free_pages``; the engine frees pages when asked to preempt.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvdrive.runtime.engine.request import SequenceState


class PageSource(Protocol):
    def pages_needed(self, seq_id: int | None, n: int) -> int: ...
    @property
    def free_pages(self) -> int: ...


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

    def plan(self, cache: PageSource, preempt: Callable[[SequenceState], None]) -> list[ScheduledChunk]:
        """The next step's chunks. Calls ``preempt`` (which must free pages) when a decode lacks room."""
        budget = self.config.step_token_budget
        chunks: list[ScheduledChunk] = []
        reserved = 0  # pages promised to chunks already in this step
        for seq in list(self.running):  # decodes, oldest first: victims are always unscheduled ones
            if seq not in self.running or seq.num_generated == 0 or len(seq.pending) != 1:
                continue
            need = cache.pages_needed(seq.seq_id, 1)
            while need + reserved > cache.free_pages and seq in self.running:
                victim = self.running[-1]
                preempt(victim)  # frees the victim's pages and calls requeue()
            if seq not in self.running:
                continue
            reserved += need
            chunks.append(ScheduledChunk(seq, 1))
            budget -= 1
        for seq in self.running:  # prompt chunks of sequences already admitted
            if budget <= 0 or len(seq.pending) == 0 or any(c.seq is seq for c in chunks):
                continue
            n = min(len(seq.pending), budget)
            need = cache.pages_needed(seq.seq_id, n)
            if need + reserved > cache.free_pages:
                continue
            reserved += need
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running:
            seq = self.waiting[0]
            # admit only when the whole prompt (and one more token) fits now: no thrashing
            if cache.pages_needed(None, len(seq.pending) + 1) + reserved > cache.free_pages:
                break
            self.waiting.popleft()
            self.running.append(seq)
            n = min(len(seq.pending), budget)
            reserved += cache.pages_needed(None, n)
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
