"""Which replica gets a request: a pure function of what each replica holds of the prompt and its load.

Two rules, in this order:

1. **Affinity.** A replica that holds at least ``affinity_share`` of the prompt (its leading pages, beyond
   those every replica holds, such as a common system prompt) is a *holder*. When there is one, the
   request goes to the cheapest holder (cost below), unless a replica with nothing running or queued would
   answer sooner by computing the prompt itself: spilling to idle capacity delays nobody, while sending a
   repeat to a busy non-holder recomputes work the fleet has already done, delays every request queued
   there, and stores the document twice in caches that then hold less. On a saturated fleet that cost is
   what decides throughput: with a cost rule alone (weights 1 and 3 below) a 3-replica fleet measured
   1.01-1.02x round-robin's prefill, its holders' queues outbidding their hits.
2. **Cost.** Otherwise (no holder, or an idle replica wins) the cheapest replica: its cost, in prompt
   tokens, estimates the work ahead of this request's first token there: the prompt tokens it would
   compute (those past the longest run of its leading pages the replica holds) times ``recompute_weight``,
   plus the prompt tokens still to compute of the requests already routed there (``pending``), plus
   ``load_tokens`` for every request it runs or queues (decode and overhead).

What a replica holds of the prompt is its *credit*, in pages: the longest run of the prompt's leading pages it can
reuse, each page it holds itself counting 1 and each it would fetch from the fleet's shared tier (a store every
replica reads, docs/kv-events.md) counting ``shared_weight`` (below 1: a fetch costs what a local copy does not).
So a replica holding a prefix itself outranks one that would fetch it, and a prefix only the shared tier holds
gives every replica the same credit: it is common to all, like a system prompt, and load decides.

Replicas more than ``max_imbalance`` requests above the least loaded are never picked, so one hot document
spills over to other replicas (which then hold it too) instead of queueing on one. Exact ties (idle
replicas, no prefix anywhere) are broken by rendezvous hashing of a digest that names the prompt's start
(``affinity_key``), so repeats of a new document converge.
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
    matched_pages: int  # the longest run of the prompt's leading pages this replica holds or can fetch
    load: int  # requests the replica is running or queueing
    pending_tokens: int = 0  # prompt tokens still to compute of the requests this router sent it
    shared_pages: int = 0  # of matched_pages, those only the fleet's shared tier holds (it would fetch them)


@dataclass(frozen=True)
class Policy:
    mode: str = "prefix"  # prefix | round-robin
    load_tokens: int = 128  # a request already running or queued costs this many prompt tokens, besides its prefill
    recompute_weight: float = 3.0  # a prompt token this replica would compute costs this many queued ones
    max_imbalance: int = 8  # never more than this many requests above the least loaded replica
    affinity_share: float = 0.5  # a replica holding this share of the prompt keeps it unless an idle one is faster
    shared_weight: float = 0.5  # a page a replica would fetch from the shared tier counts this much of one it holds


@dataclass(frozen=True)
class Decision:
    name: str
    reason: str  # one of REASONS
    matched_tokens: int  # prompt tokens the replica will not compute: it holds them or fetches them
    shared_tokens: int = 0  # of those, the tokens it fetches from the fleet's shared tier


def _rendezvous(key: bytes, name: str) -> bytes:
    return hashlib.blake2b(key + name.encode(), digest_size=8).digest()


def choose(candidates: Sequence[Candidate], policy: Policy, page_size: int, first_page: bytes | None = None,
           turn: int = 0, readable: bool = True, prompt_tokens: int = 0) -> Decision:
    """The replica for one request of ``prompt_tokens``. ``first_page``: the prompt's ``affinity_key`` (None
    for a prompt shorter than a page); ``readable`` False when the router could not read the
    prompt (an invalid body, which the replica will refuse; no tokenizer yet): only load decides, reason
    ``fallback``; ``turn``: a counter that round-robin and ties without a first page rotate on."""
    if not candidates:
        raise NoReplicaError("no replica is ready")
    ordered = sorted(candidates, key=lambda c: c.name)
    if policy.mode == "round-robin":
        c = ordered[turn % len(ordered)]
        return Decision(c.name, "round-robin", c.matched_pages * page_size, c.shared_pages * page_size)
    least = min(c.load for c in ordered)
    eligible = [c for c in ordered if c.load <= least + policy.max_imbalance]
    if not readable:
        idle = [c for c in eligible if c.load == least]
        c = idle[turn % len(idle)]
        return Decision(c.name, "fallback", 0)

    def credit(c: Candidate) -> float:
        return c.matched_pages - (1.0 - policy.shared_weight) * c.shared_pages

    def cost(c: Candidate) -> float:
        computed = max(0.0, prompt_tokens - credit(c) * page_size)
        return policy.recompute_weight * computed + c.pending_tokens + policy.load_tokens * c.load

    def cheapest(cs: list[Candidate]) -> Candidate:
        best = min(cost(c) for c in cs)
        tied = [c for c in cs if cost(c) == best]
        if len(tied) == 1:
            return tied[0]
        if first_page is not None:
            return max(tied, key=lambda c: _rendezvous(first_page, c.name))
        return tied[turn % len(tied)]

    # what every replica has of the prompt (a common system prompt; a prefix only the shared tier holds)
    common = min(credit(x) for x in eligible)
    prompt_pages = max(1, prompt_tokens // page_size)
    holders = [c for c in eligible if credit(c) > common
               and credit(c) - common >= policy.affinity_share * (prompt_pages - common)]
    best = cheapest(eligible)
    idle_spill = best not in holders and best.load == 0 and best.pending_tokens == 0
    c = cheapest(holders) if holders and not idle_spill else best
    reason = "prefix" if credit(c) > common else "load"
    return Decision(c.name, reason, c.matched_pages * page_size, c.shared_pages * page_size)


def affinity_key(digests: Sequence[bytes], depth: int = 16) -> bytes | None:
    """The digest of the prompt's first ``depth`` pages (or of all, when shorter): it names the prompt's
    start, past a short common system prompt, so new prompts that open alike (one document, other
    questions) hash to the same replica on ties; None for a prompt shorter than a page."""
    return digests[min(len(digests), depth) - 1] if digests else None
