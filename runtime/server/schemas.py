"""OpenAI-compatible request and response bodies (pydantic): the HTTP edge of the runtime."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(description="served model id (see GET /v1/models); 'demo' is an alias of the demo model")
    max_tokens: int | None = Field(default=None, ge=1, description="tokens to generate at most")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, description="-1 or 0: off (vLLM extension)")
    stop: str | list[str] | None = Field(default=None)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1, description="only 1 completion per request is supported")
    ignore_eos: bool = Field(default=False, description="vLLM extension for benchmarks")

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return stops


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] = Field(description="text, one string in a list, or token ids")
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported: send one prompt per request")
            return v[0]
        if isinstance(v, list) and not v:
            raise ValueError("the prompt is empty")
        return v


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = ""

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: None = None


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
    logprobs: None = None


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
    logprobs: None = None


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


class TierUsage(BaseModel):
    tier: Literal["gpu", "dram", "ssd"]
    budget_bytes: int = Field(description="the configured budget (gpu: includes the open pages' reserve)")
    capacity_bytes: int = Field(description="bytes of pages the tier can hold now (<= budget)")
    used_bytes: int = Field(description="bytes held for running sequences")
    cached_bytes: int = Field(0, description="bytes of reusable pages no running sequence needs (evictable)")
    pages: int = Field(0, description="blocks (one layer's page) stored")
    backing: str
    errors: int = 0


class TiersUpdate(BaseModel):
    """PUT /admin/tiers: new budgets, applied live."""

    model_config = ConfigDict(extra="forbid")
    gpu_bytes: int = Field(ge=0, description="device tier, including one open page per running sequence")
    dram_bytes: int = Field(ge=0)
    ssd_bytes: int = Field(ge=0)


class TiersResponse(BaseModel):
    tiers: list[TierUsage]
