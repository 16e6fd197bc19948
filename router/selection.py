"""Which replica gets a request: a pure function of what each replica holds of the prompt and its load.

Costs are in prompt tokens, an estimate of the work ahead of this request's first token on each replica:
the prompt tokens it would compute there (those past the longest run of its leading pages the replica
holds) times ``recompute_weight``, plus the prompt tokens still to compute of the requests already routed
there (``pending``), plus ``load_tokens`` for every request it runs or queues (decode and overhead). The
cheapest replica wins. The weight is there because a prompt token computed again is not only this
request's wait: under load the fleet's prefill is the bottleneck, and every request queued behind it on
that replica waits for it too (a weight of 1 measured 1.02x round-robin's prefill on a saturated fleet:
queue differences of a few thousand tokens outbid every document hit).
Replicas more than ``max_imbalance`` requests above the least loaded are never picked, so one hot document
spills over to other replicas instead of queueing on one. Exact ties (idle replicas, no prefix anywhere)
are broken by the first page's digest (rendezvous hashing), so repeats of a new document converge.
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
    pending_tokens: int = 0  # prompt tokens still to compute of the requests this router sent it


@dataclass(frozen=True)
class Policy:
    mode: str = "prefix"  # prefix | round-robin
    load_tokens: int = 128  # a request already running or queued costs this many prompt tokens, besides its prefill
    recompute_weight: float = 3.0  # a prompt token this replica would compute costs this many queued ones
    max_imbalance: int = 8  # never more than this many requests above the least loaded replica


@dataclass(frozen=True)
class Decision:
    name: str
    reason: str  # one of REASONS
    matched_tokens: int


def _rendezvous(key: bytes, name: str) -> bytes:
    return hashlib.blake2b(key + name.encode(), digest_size=8).digest()


def choose(candidates: Sequence[Candidate], policy: Policy, page_size: int, first_page: bytes | None = None,
           turn: int = 0, readable: bool = True, prompt_tokens: int = 0) -> Decision:
    """The replica for one request of ``prompt_tokens``. ``first_page``: the digest of the prompt's first
    page (None for a prompt shorter than a page); ``readable`` False when the router could not read the
    prompt (an invalid body, which the replica will refuse; no tokenizer yet): only load decides, reason
    ``fallback``; ``turn``: a counter that round-robin and ties without a first page rotate on."""
    if not candidates:
        raise NoReplicaError("no replica is ready")
    ordered = sorted(candidates, key=lambda c: c.name)
    if policy.mode == "round-robin":
        c = ordered[turn % len(ordered)]
        return Decision(c.name, "round-robin", c.matched_pages * page_size)
    least = min(c.load for c in ordered)
    eligible = [c for c in ordered if c.load <= least + policy.max_imbalance]
    if not readable:
        idle = [c for c in eligible if c.load == least]
        c = idle[turn % len(idle)]
        return Decision(c.name, "fallback", 0)

    def cost(c: Candidate) -> float:
        computed = max(0, prompt_tokens - c.matched_pages * page_size)
        return policy.recompute_weight * computed + c.pending_tokens + policy.load_tokens * c.load

    best = min(cost(c) for c in eligible)
    tied = [c for c in eligible if cost(c) == best]
    c = tied[0] if len(tied) == 1 else max(tied, key=lambda c: _rendezvous(first_page or b"", c.name)) \
        if first_page is not None else tied[turn % len(tied)]
    shared = min(x.matched_pages for x in eligible)  # pages every replica holds (a common system prompt)
    reason = "prefix" if c.matched_pages > shared else "load"
    return Decision(c.name, reason, c.matched_pages * page_size)
