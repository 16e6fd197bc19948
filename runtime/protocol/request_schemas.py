"""The OpenAI-compatible request bodies of completions and chat (pydantic): what a replica serves and what the
router reads a prompt from.

Requests are strict: a number is not a string or a boolean (``max_tokens: true`` is refused), floats
are finite, unknown fields are refused, and the OpenAI fields this server does not implement are
refused by name when set to anything but their neutral value (rather than ignored as if applied).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from kvdrive.runtime.protocol.fields import REQUEST, Bool, Float, Int
from kvdrive.runtime.protocol.output_schemas import NamedToolChoice, ResponseFormat, ToolCall, ToolDef

# OpenAI fields not implemented here, with the values that mean "not used"
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none"),
    "suffix": (None, ""), "best_of": (None, 1), "modalities": (None, ["text"]),
    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,), "service_tier": (None, "auto", "default"),
}


def _refuse_unsupported(name: str, value: Any) -> Any:
    if value not in UNSUPPORTED[name]:
        raise ValueError(f"{name} is not supported by this server; leave it out")
    return value


class SamplingFields(BaseModel):
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
    guided_choice: list[str] | None = Field(default=None, min_length=1, max_length=256, description=(
        "vLLM extension: the output is exactly one of these strings"))
    guided_regex: str | None = Field(default=None, min_length=1, max_length=4096, description=(
        "vLLM extension: the output matches this regular expression"))

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
    # vLLM's extension: with include_usage, every chunk that carries tokens also carries the usage so far
    continuous_usage_stats: Bool = False


MAX_PROMPTS = 32  # prompts in one completions request


class CompletionRequest(SamplingFields):
    prompt: str | list[Int] | list[str] | list[list[Int]] = Field(description=(
        f"text, token ids, or a batch of either (at most {MAX_PROMPTS}): choice i * n + j is prompt i's sample j"))
    max_tokens: Int | None = Field(default=16, ge=1)
    echo: Bool = False
    logprobs: Int | None = Field(default=None, ge=0, le=20, description=(
        "each token's log-probability and this many most likely alternatives; with echo, the prompt's tokens "
        "too (the first has none: null)"))
    suffix: Any = Field(default=None, description="not supported: refused unless null/empty")
    best_of: Any = Field(default=None, description="not supported: refused unless null/1")

    @field_validator("suffix", "best_of")
    @classmethod
    def _unsupported_completion(cls, v: Any, info: Any) -> Any:
        return _refuse_unsupported(info.field_name, v)

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: str | list[int] | list[str] | list[list[int]]) -> str | list[int] | list[str] | list[list[int]]:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts in one request; got {len(v)}")
            if any(not p for p in v):
                raise ValueError("a prompt of the batch is empty")
        if not v:
            raise ValueError("the prompt is empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request (one, or a batch), as text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ContentPart(BaseModel):
    model_config = REQUEST
    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    model_config = REQUEST
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = ""
    name: str | None = Field(default=None, description="a participant name (accepted, not used)")
    tool_calls: list[ToolCall] | None = Field(default=None, description="an assistant message's calls")
    tool_call_id: str | None = Field(default=None, description="a tool message: the id of the call it answers")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    logprobs: Bool | None = Field(default=None, description="each generated token's log-probability")
    top_logprobs: Int | None = Field(default=None, ge=0, le=20,
                                     description="this many most likely alternatives of each token (needs logprobs)")
    tools: list[ToolDef] | None = Field(default=None, max_length=128, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(default=None, description=(
        "none: answer in text; auto (the default with tools): the model decides; required or a named function: "
        "grammar-constrained, so the answer is always a call that parses"))
    parallel_tool_calls: Bool = Field(default=True, description="whether the answer may hold more than one call")
    functions: Any = Field(default=None, description="not supported: refused unless null/[]")
    function_call: Any = Field(default=None, description="not supported: refused unless null/'none'")
    response_format: ResponseFormat | None = Field(default=None, description=(
        "text, json_object (any JSON object) or json_schema: the output is grammar-constrained to it"))
    modalities: Any = Field(default=None, description="not supported: refused unless null/['text']")
    audio: Any = Field(default=None, description="not supported: refused unless null")
    prediction: Any = Field(default=None, description="not supported: refused unless null")
    reasoning_effort: Any = Field(default=None, description="not supported: refused unless null")
    service_tier: Any = Field(default=None, description="accepted only as null, 'auto' or 'default'")

    @field_validator("functions", "function_call",
                     "modalities", "audio", "prediction", "reasoning_effort", "service_tier")
    @classmethod
    def _unsupported_chat(cls, v: Any, info: Any) -> Any:
        return _refuse_unsupported(info.field_name, v)

    @model_validator(mode="after")
    def _tools_agree(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: function names must be unique; got {names}")
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools {names}")
        return self

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: Any) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("set logprobs to true to get top_logprobs")
        return v
