"""Which replica gets a request: a pure function of what each replica holds of the prompt and its load.

Scores are in prompt tokens: a replica is worth the tokens of the prompt's leading pages it already holds
(they need no prefill there), minus ``load_tokens`` for every request it is already running or queueing.
Replicas more than ``max_imbalance`` requests above the least loaded are never picked, so one hot document
cannot pile every request onto one pod. With no prefix anywhere the least loaded replicas are tied, and
the first page's digest picks among them by rendezvous hashing, so repeats of a new document converge on
one replica while the load stays even.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

REASONS = ("prefix", "load", "fallback", "round-robin")


class NoReplicaError(RuntimeError):
    """No replica can take a request now."""


@dataclass(frozen=True)
class Candidate:
    name: str  # the replica's base URL
    matched_pages: int  # the longest run of the prompt's leading pages this replica holds
    load: int  # requests the replica is running or queueing


@dataclass(frozen=True)
class Policy:
    mode: str = "prefix"  # prefix | round-robin
    load_tokens: int = 512  # a request already running or queued weighs as much as this many prompt tokens
    max_imbalance: int = 8  # never more than this many requests above the least loaded replica


@dataclass(frozen=True)
class Decision:
    name: str
    reason: str  # one of REASONS
    matched_tokens: int


def _rendezvous(key: bytes, name: str) -> bytes:
    return hashlib.blake2b(key + name.encode(), digest_size=8).digest()


def choose(candidates: Sequence[Candidate], policy: Policy, page_size: int, first_page: bytes | None = None,
           turn: int = 0, readable: bool = True) -> Decision:
    """The replica for one request. ``first_page``: the digest of the prompt's first page (None for a prompt
    shorter than a page); ``readable`` False when the router could not read the prompt (an invalid body,
    which the replica will refuse; no tokenizer yet): only load decides, reason ``fallback``; ``turn``: a
    counter that round-robin and ties without a first page rotate on."""
    if not candidates:
        raise NoReplicaError("no replica is ready")
    ordered = sorted(candidates, key=lambda c: c.name)
    if policy.mode == "round-robin":
        c = ordered[turn % len(ordered)]
        return Decision(c.name, "round-robin", c.matched_pages * page_size)
    least = min(c.load for c in ordered)
    eligible = [c for c in ordered if c.load <= least + policy.max_imbalance]

    def score(c: Candidate) -> int:
        return c.matched_pages * page_size - policy.load_tokens * c.load

    best = max(eligible, key=lambda c: (score(c), -c.load))
    if best.matched_pages and score(best) > -policy.load_tokens * least:
        return Decision(best.name, "prefix", best.matched_pages * page_size)
    idle = [c for c in eligible if c.load == least]
    if not readable or first_page is None:
        c = idle[turn % len(idle)]
        return Decision(c.name, "load" if readable else "fallback", 0)
    c = max(idle, key=lambda c: _rendezvous(first_page, c.name))
    return Decision(c.name, "load", c.matched_pages * page_size)
