"""Requests entering the engine and the outputs each step returns for them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvdrive.runtime.engine.detokenize import TextStream
from kvdrive.runtime.engine.grammar import Matcher
from kvdrive.runtime.engine.sampling import SamplingParams, TokenLogprob
from kvdrive.runtime.kvcache import PrefixWarmup


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    arrival: float
    cache_salt: str | None = None  # its pages are shared only with requests of the same salt (tenant isolation)


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    prompt_tokens: int
    completion_tokens: int
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens whose K/V came from the tiers (stored pages) when it was admitted
    logprobs: tuple[TokenLogprob, ...] = ()  # one per new token, when the request asked for them
    # prompt tokens 1.. (token 0 has none), with the request's first token, when it asked for them
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass
class SequenceState:
    """The engine's mutable view of one running request (internal to the engine)."""

    request: Request
    stream: TextStream
    rng: torch.Generator | None
    seq_id: int | None = None  # id in the KV cache while it holds pages
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_generated: int = 0
    first_token_at: float | None = None
    bypassed: int = 0  # later requests admitted ahead of this one while it waited (fair scheduling)
    lost_page_restarts: int = 0  # recomputations this request needed because a page of its was unreadable
    undone_steps: int = 0  # steps of this request undone because a tier had no slot for their pages
    cached_tokens: int | None = None  # prompt tokens reused from stored pages at its first admission
    prompt_vocab: torch.Tensor | None = None  # the prompt's distinct token ids [n] (a repetition penalty's)
    prompt_lps: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.. so far (prompt_logprobs)
    prompt_lps_sent: bool = False
    matcher: Matcher | None = None  # where its output stands in its grammar (structured output)
    warmup: PrefixWarmup | None = None  # its prefix being fetched from the shared tier (admitted once done)

    @property
    def prefill_left(self) -> int:
        """Tokens still to feed as prompt (full attention). A new request: everything pending. One recomputed
        after a preemption: only the rest of its prompt; its generated tokens are then replayed one per step
        as decode (page selection), as they were first computed, so that its KV and what it samples next
        are those of a run that was never interrupted."""
        if self.num_generated == 0:
            return len(self.pending)
        return max(0, len(self.request.prompt_ids) - self.num_computed)

    @property
    def pending(self) -> list[int]:
        """Tokens still to feed to the model (a prompt chunk, or the last sampled token)."""
        return self.tokens[self.num_computed :]
