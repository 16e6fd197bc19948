"""From an OpenAI request to the engine's parameters: the model it names, its prompt against the vocabulary and
the context, its sampling fields as ``SamplingParams``, its cache salt. Every violation is an ``ApiError``
naming the field (404 for a model not served, 400 otherwise)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvdrive.runtime.engine import SamplingParams
from kvdrive.runtime.engine.grammar import CompiledGrammar
from kvdrive.runtime.prompt.digests import tenant_salt
from kvdrive.runtime.protocol import request_schemas as r
from kvdrive.runtime.protocol.secret_files import ApiKey
from kvdrive.runtime.server.errors import ApiError


@dataclass(frozen=True)
class Limits:
    """What a request is checked against: the model's context and vocabulary, and the tokens a request that
    names no ``max_tokens`` may generate."""

    max_context: int
    vocab_size: int
    default_max_tokens: int


def check_model(name: str, model_id: str, aliases: tuple[str, ...]) -> None:
    if name not in (model_id, *aliases):
        raise ApiError(404, f"model {name!r} is not served here (served: {model_id})", "not_found_error", "model")


def check_prompt_ids(prompts: list[list[int]], vocab_size: int) -> None:
    """A completions prompt given as token ids holds only the vocabulary's."""
    if any(t < 0 or t >= vocab_size for ids in prompts for t in ids):
        raise ApiError(400, f"prompt: token ids must be in [0, {vocab_size})", param="prompt")


def check_length(prompt_len: int, max_tokens: int | None, max_context: int) -> None:
    """The prompt and at least one generated token (or ``max_tokens`` of them, when given) fit the context."""
    if prompt_len + 1 > max_context:
        raise ApiError(400, f"the prompt has {prompt_len} tokens; this model's context is {max_context} "
                            f"tokens (prompt + at least one generated token)", param="prompt")
    if max_tokens is not None and prompt_len + max_tokens > max_context:
        raise ApiError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds this model's "
                            f"context of {max_context} tokens", param="max_tokens")


def chat_max_tokens(body: r.ChatCompletionRequest) -> int | None:
    """A chat request's limit: ``max_completion_tokens``, else ``max_tokens`` when the request set it."""
    return body.max_completion_tokens or (body.max_tokens if "max_tokens" in body.model_fields_set else None)


def sampling_params(body: r.SamplingFields, max_tokens: int | None, prompt_len: int, limits: Limits,
                    logprobs: int | None, prompt_logprobs: int | None = None,
                    grammar: CompiledGrammar | None = None) -> SamplingParams:
    """The engine's parameters for one prompt: ``max_tokens`` (or the default) cut to the context left after
    the prompt; token ids (``logit_bias``, ``stop_token_ids``) in the vocabulary; ``min_tokens`` within it."""
    room = limits.max_context - prompt_len
    wanted = max_tokens if max_tokens is not None else limits.default_max_tokens
    vocab = limits.vocab_size
    for name, ids in (("logit_bias", [int(k) for k in body.logit_bias or {}]),
                      ("stop_token_ids", body.stop_token_ids or [])):
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"{name}: token ids must be in [0, {vocab}); got {bad[:5]}", param=name)
    max_tokens = max(1, min(wanted, room))
    if body.min_tokens is not None and body.min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens ({body.min_tokens}) exceeds the tokens this request may generate "
                            f"({max_tokens})", param="min_tokens")
    return SamplingParams(max_tokens=max_tokens, temperature=body.temperature,
                          top_p=body.top_p, top_k=max(0, body.top_k), seed=body.seed,
                          stop=tuple(body.stop or ()), ignore_eos=body.ignore_eos,
                          presence_penalty=body.presence_penalty or 0.0,
                          frequency_penalty=body.frequency_penalty or 0.0,
                          repetition_penalty=body.repetition_penalty or 1.0,
                          logit_bias=tuple((int(k), v) for k, v in (body.logit_bias or {}).items()),
                          min_tokens=body.min_tokens or 0, stop_token_ids=tuple(body.stop_token_ids or ()),
                          logprobs=logprobs, prompt_logprobs=prompt_logprobs, grammar=grammar)


def sample_params(params: SamplingParams, j: int) -> SamplingParams:
    """A prompt's sample ``j``: with a seed, seed + j (so the whole answer repeats); only sample 0 computes the
    prompt's log-probabilities (the others reuse its pages and echo the same)."""
    seeded = params if params.seed is None else dataclasses.replace(params, seed=(params.seed + j) % 2**63)
    return dataclasses.replace(seeded, prompt_logprobs=None) if j else seeded


def cache_salt(api_key: ApiKey | None, salt: str | None, isolate_tenants: bool) -> str | None:
    """The request's cache salt: under --isolate-tenants derived from its API key (``tenant_salt``), then
    narrowed by its own ``cache_salt``; otherwise its ``cache_salt``."""
    return tenant_salt(api_key.key, salt) if isolate_tenants and api_key is not None else salt
