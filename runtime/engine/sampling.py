"""Sampling parameters and next-token sampling (greedy, temperature, top-k, top-p, seeded).

The logit controls (penalties, bias, ``min_tokens``) are applied before sampling, batched over the step's
sequences (``logit_controls.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvdrive.runtime.engine.grammar import CompiledGrammar


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # OpenAI: minus this for every token the completion has used
    frequency_penalty: float = 0.0  # OpenAI: minus this times how often the completion has used the token
    repetition_penalty: float = 1.0  # vLLM/HF: a token seen in the prompt or the completion: logit / p if > 0, else * p
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0  # end-of-sequence and stop_token_ids cannot be sampled before this many tokens
    stop_token_ids: tuple[int, ...] = ()  # sampling one of these ends the completion (like EOS: not emitted)
    logprobs: int | None = None  # report each generated token's log-probability and this many top alternatives
    prompt_logprobs: int | None = None  # report each prompt token's too (its whole prompt computed: no prefix reuse)
    grammar: CompiledGrammar | None = None  # structured output: every sampled token continues it (grammar.py)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not -2.0 <= self.presence_penalty <= 2.0 or not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError("repetition_penalty must be in (0, 2]")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        for k in (self.logprobs, self.prompt_logprobs):
            if k is not None and not 0 <= k <= 20:
                raise ValueError("logprobs and prompt_logprobs must be in [0, 20]")

    @property
    def controls_logits(self) -> bool:
        """Whether any logit control applies (else the logits are sampled as the model gave them)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (the logits before any sampling control, in
    float32), and the ``top`` most likely tokens of that position: (token id, log-probability), best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def make_rng(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator()
    if params.seed is not None:
        g.manual_seed(params.seed)
    else:
        g.seed()
    return g


def token_logprob(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """``token``'s entry of logprobs [V] and the ``k`` best entries (token id, log-probability), best first."""
    top = torch.topk(logprobs, k) if k else None
    pairs = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else ()
    return TokenLogprob(token, float(logprobs[token]), pairs)


def sample(logits: torch.Tensor, params: SamplingParams, rng: torch.Generator | None) -> int:
    """Pick the next token from logits [V] (float32)."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    scores = logits.float().cpu() / params.temperature  # [V]; -inf: a token masked out (a grammar, a bias)
    # A vanishing temperature overflows: to +inf, nan (0 / 0) or, where every allowed logit is negative, all
    # -inf (softmax of which is nan); max() carries any of the three. Its limit is greedy among the allowed.
    if not bool(torch.isfinite(scores.max())):
        return int(torch.argmax(logits).item())
    if params.top_k > 0:
        kth = torch.topk(scores, min(params.top_k, scores.shape[-1])).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_p, dim=-1)
        drop = cumulative - sorted_p > params.top_p  # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=rng).item())
