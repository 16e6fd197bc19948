"""OpenAI-compatible request and response bodies (pydantic): the HTTP edge of the runtime.

Requests are strict: a number is not a string or a boolean (``max_tokens: true`` is refused), floats
are finite, unknown fields are refused, and the OpenAI fields this server does not implement are
refused by name when set to anything but their neutral value (rather than ignored as if applied).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # an int is a number too; a bool or a string is not
Bool = Annotated[bool, Strict()]
REQUEST = ConfigDict(extra="forbid", allow_inf_nan=False)
# OpenAI fields not implemented here, with the values that mean "not used"
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
    "suffix": (None, ""), "best_of": (None, 1), "parallel_tool_calls": (None,), "modalities": (None, ["text"]),
    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,), "service_tier": (None, "auto", "default"),
}


def _refuse_unsupported(name: str, value: Any) -> Any:
    if value not in UNSUPPORTED[name]:
        raise ValueError(f"{name} is not supported by this server; leave it out")
    return value


class _SamplingFields(BaseModel):
    model_config = REQUEST

    model: str = Field(description="served model id (see GET /v1/models); 'demo' is an alias of the demo model")
    max_tokens: Int | None = Field(default=None, ge=1, description="tokens to generate at most")
    temperature: Float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: Float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: Int = Field(default=-1, ge=-1, description="-1 or 0: off (vLLM extension)")
    stop: str | list[str] | None = Field(default=None)
    seed: Int | None = Field(default=None, ge=0, le=2**63 - 1)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    n: Int = Field(default=1, ge=1, le=16, description=(
        "choices to sample (at most 16); they share the prompt's pages, computed once; with a seed, choice i "
        "samples with seed + i"))
    ignore_eos: Bool = Field(default=False, description="vLLM extension for benchmarks")
    user: str | None = Field(default=None, description="an end-user id (accepted, not used)")
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256, description=(
        "vLLM extension: this request's KV pages are shared only with requests of the same salt (on every tier, "
        "across restarts, and in a router's index): tenants with different salts cannot learn from timing "
        "whether the other sent a prompt"))
    presence_penalty: Float | None = Field(default=None, ge=-2.0, le=2.0,
                                           description="minus this for each token the completion has used")
    frequency_penalty: Float | None = Field(default=None, ge=-2.0, le=2.0,
                                            description="minus this times each token's count in the completion")
    repetition_penalty: Float | None = Field(default=None, gt=0.0, le=2.0, description=(
        "vLLM extension: a token seen in the prompt or completion has its logit divided by this (if > 0) or "
        "multiplied (if < 0); 1: off"))
    logit_bias: dict[str, Float] | None = Field(default=None, description=(
        "token id (as a string) -> bias in [-100, 100] added to its logit before sampling"))
    min_tokens: Int | None = Field(default=None, ge=0, description=(
        "vLLM extension: end-of-sequence and stop_token_ids cannot end the completion before this many tokens"))
    stop_token_ids: list[Int] | None = Field(default=None, description=(
        "vLLM extension: sampling one of these token ids ends the completion (the id is not emitted)"))

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids as strings; {key!r} is not one")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias[{key}] = {bias}: a bias must be in [-100, 100]")
        if v is not None and len(v) > 300:
            raise ValueError("logit_bias: at most 300 tokens")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return stops


class StreamOptions(BaseModel):
    model_config = REQUEST
    include_usage: Bool = False


class CompletionRequest(_SamplingFields):
    prompt: str | list[Int] | list[str] = Field(description="text, one string in a list, or token ids")
    max_tokens: Int | None = Field(default=16, ge=1)
    echo: Bool = False
    logprobs: Int | None = Field(default=None, ge=0, le=20, description=(
        "each generated token's log-probability and this many most likely alternatives"))
    suffix: Any = Field(default=None, description="not supported: refused unless null/empty")
    best_of: Any = Field(default=None, description="not supported: refused unless null/1")

    @field_validator("suffix", "best_of")
    @classmethod
    def _unsupported_completion(cls, v: Any, info: Any) -> Any:
        return _refuse_unsupported(info.field_name, v)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported: send one prompt per request")
            return v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_prompt_logprobs(cls, v: int | None, info: Any) -> int | None:
        if v is not None and info.data.get("echo"):
            raise ValueError("the prompt's log-probabilities (echo with logprobs) are not supported; "
                             "use echo or logprobs, not both")
        return v


class ContentPart(BaseModel):
    model_config = REQUEST
    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    model_config = REQUEST
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = ""
    name: str | None = Field(default=None, description="a participant name (accepted, not used)")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    logprobs: Bool | None = Field(default=None, description="each generated token's log-probability")
    top_logprobs: Int | None = Field(default=None, ge=0, le=20,
                                     description="this many most likely alternatives of each token (needs logprobs)")
    tools: Any = Field(default=None, description="not supported: refused unless null/[]")
    tool_choice: Any = Field(default=None, description="not supported: refused unless null/'none'")
    functions: Any = Field(default=None, description="not supported: refused unless null/[]")
    function_call: Any = Field(default=None, description="not supported: refused unless null/'none'")
    response_format: Any = Field(default=None, description="not supported: refused unless null/{'type': 'text'}")
    parallel_tool_calls: Any = Field(default=None, description="not supported: refused unless null")
    modalities: Any = Field(default=None, description="not supported: refused unless null/['text']")
    audio: Any = Field(default=None, description="not supported: refused unless null")
    prediction: Any = Field(default=None, description="not supported: refused unless null")
    reasoning_effort: Any = Field(default=None, description="not supported: refused unless null")
    service_tier: Any = Field(default=None, description="accepted only as null, 'auto' or 'default'")

    @field_validator("tools", "tool_choice", "functions", "function_call", "response_format", "parallel_tool_calls",
                     "modalities", "audio", "prediction", "reasoning_effort", "service_tier")
    @classmethod
    def _unsupported_chat(cls, v: Any, info: Any) -> Any:
        return _refuse_unsupported(info.field_name, v)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: Any) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("set logprobs to true to get top_logprobs")
        return v


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose K/V came from stored prefix pages, not computed


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> Usage:
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None  # the token's UTF-8 bytes (a token may hold part of a character)


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDeltaChoice(BaseModel):
    index: int = 0
    delta: ChatMessageOut
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatDeltaChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvdrive"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: int
    param: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Readiness(BaseModel):
    status: Literal["ready", "degraded"] = Field(description="degraded: serving, with a tier failing (see degraded)")
    degraded: dict[str, str] = Field(default_factory=dict, description="tier -> why it is degraded")


class TierUsageBody(BaseModel):
    tier: Literal["gpu", "dram", "ssd"]
    budget_bytes: int = Field(description="the configured budget (gpu: the envelope, the running sequences' "
                              "reserve included)")
    capacity_bytes: int = Field(description="bytes of pages the tier can hold now (<= budget)")
    used_bytes: int = Field(description="bytes held for running sequences")
    cached_bytes: int = Field(0, description="bytes of reusable pages no running sequence needs (evictable)")
    pages: int = Field(0, description="blocks (one layer's page) stored")
    backing: str
    errors: int = 0


class TiersUpdate(BaseModel):
    """PUT /admin/tiers: new budgets and/or the envelope's split, applied live (a field left out is unchanged)."""

    model_config = REQUEST
    gpu_bytes: Int | None = Field(None, ge=0, description="the device envelope: hot tier + running sequences' reserve")
    dram_bytes: Int | None = Field(None, ge=0)
    ssd_bytes: Int | None = Field(None, ge=0)
    max_running: Int | None = Field(None, ge=1, description="sequences that may run at once (at most --max-sequences); "
                                    "each takes its decode step buffer from the hot tier")

    @model_validator(mode="after")
    def _something(self) -> TiersUpdate:
        if all(v is None for v in (self.gpu_bytes, self.dram_bytes, self.ssd_bytes, self.max_running)):
            raise ValueError("give at least one of gpu_bytes, dram_bytes, ssd_bytes, max_running")
        return self


class EnvelopeSplitBody(BaseModel):
    """How the device envelope (the gpu budget) is split between the hot tier and running sequences."""

    envelope_bytes: int
    hot_bytes: int = Field(description="the hot KV tier")
    reserve_bytes: int = Field(description="kept for running sequences: fixed_reserve_bytes + "
                               "max_running x per_sequence_bytes")
    fixed_reserve_bytes: int = Field(description="every row's open pages (and sliding windows)")
    per_sequence_bytes: int = Field(description="one running sequence's decode step buffer")
    max_running: int
    max_sequences: int
    pending_max_running: int | None = Field(None, description="a smaller limit applied once that few sequences run")


class TiersResponse(BaseModel):
    tiers: list[TierUsageBody]
    split: EnvelopeSplitBody
