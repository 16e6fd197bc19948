"""The OpenAI-compatible routes: ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``.

A request becomes one engine request per choice (``generation.py``, ``fanout.py``: each prompt computed once),
answered whole or streamed (``streaming.py``). Every user error is an ``ApiError`` naming the field
(``openai_params.py``, ``structured.py``). Each route's work is a function of the request, the caller and the
``Served`` model (``completion``, ``chat_completion``), callable without a server; ``openai_routes`` only registers them.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive

from kvdrive.runtime.engine.grammar import GrammarCompiler
from kvdrive.runtime.prompt import Tokenizer
from kvdrive.runtime.prompt.tokenizer import TokenizerError
from kvdrive.runtime.protocol import request_schemas as r
from kvdrive.runtime.protocol.prompts import chat_prompt, completion_prompts
from kvdrive.runtime.protocol.secret_files import ApiKey
from kvdrive.runtime.protocol.tool_prompt import active
from kvdrive.runtime.server import response_schemas as s
from kvdrive.runtime.server.disconnect import until_disconnect
from kvdrive.runtime.server.errors import ERRORS, GENERATION_ERRORS, ApiError
from kvdrive.runtime.server.generation import Generation
from kvdrive.runtime.server.logprobs import LogprobRenderer
from kvdrive.runtime.server.openai_params import (
    Limits,
    cache_salt,
    chat_max_tokens,
    check_length,
    check_model,
    check_prompt_ids,
    sampling_params,
)
from kvdrive.runtime.server.state import ServerState
from kvdrive.runtime.server.streaming import Collected, Render, collect, stream
from kvdrive.runtime.server.structured import OutputConstraints, tool_grammar
from kvdrive.runtime.server.tool_parsing import ToolStream, parse

T = TypeVar("T")


@dataclass(frozen=True)
class Served:
    """What the completions and chat routes answer with: the model's names and tokenizer, the limits a request
    is checked against, its output constraints, the engine, and the stream's keep-alive."""

    model_id: str
    aliases: tuple[str, ...]
    tokenizer: Tokenizer
    limits: Limits
    isolate_tenants: bool  # a request's cache salt derives from its API key
    keepalive_s: float
    constraints: OutputConstraints
    generation: Generation

    @classmethod
    def of(cls, state: ServerState) -> Served:
        cfg = state.config
        return cls(model_id=cfg.model_id, aliases=cfg.aliases, tokenizer=state.tokenizer,
                   limits=Limits(state.max_context, state.tokenizer.vocab_size, cfg.default_chat_max_tokens),
                   isolate_tenants=cfg.isolate_tenants, keepalive_s=cfg.sse_keepalive_seconds,
                   constraints=OutputConstraints(GrammarCompiler(state.tokenizer).compile),
                   generation=Generation(state.engine.generate, state.metrics.ttft.observe, state.metrics.itl.observe,
                                         cfg.retry_after_seconds))


@dataclass(frozen=True)
class Caller:
    """Who asked: the API key the gate let in (None: open access), and their connection's ASGI channel, which
    tells when they are gone."""

    api_key: ApiKey | None
    receive: Receive

    @classmethod
    def of(cls, request: Request) -> Caller:
        return cls(getattr(request.state, "api_key", None), request.receive)

    async def until_disconnect(self, work: Awaitable[T]) -> T:
        return await until_disconnect(self.receive, work)


def model_list(model_id: str, started: int, max_model_len: int) -> s.ModelList:
    """``max_model_len``: what one request can hold now (the model's context, or less when the KV tiers as
    configured hold less per request)."""
    return s.ModelList(data=[s.ModelCard(id=model_id, created=started, max_model_len=max_model_len)])


def usage_options(options: r.StreamOptions | None) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of a stream."""
    return bool(options and options.include_usage), bool(options and options.continuous_usage_stats)


@dataclass(frozen=True)
class Echo:
    """A completion's echoed prompt per choice (choice ``c`` is prompt ``c // n``'s)."""

    texts: list[str]
    n: int

    def __call__(self, c: int) -> str:
        return self.texts[c // self.n]


def echo_of(body: r.CompletionRequest, tokenizer: Tokenizer) -> Echo | None:
    """The prompts as echoed (token-id prompts decoded, only to echo them); None without ``echo``."""
    if not body.echo:
        return None
    return Echo([t if isinstance(t, str) else tokenizer.decode(t, skip_special_tokens=False)
                 for t in body.prompts()], body.n)


def completion_render(tokenizer: Tokenizer, prompts: list[list[int]], n: int) -> Render:
    """Each choice's log-probability renderer (an echoed prompt's first token has none)."""
    return lambda c: LogprobRenderer(tokenizer, chat=False, echo_first=prompts[c // n][0])


def completion_response(rid: str, model: str, done: Collected, echo: Echo | None) -> s.CompletionResponse:
    return s.CompletionResponse(id=rid, model=model, usage=done.usage, choices=[
        s.CompletionChoice(index=i, text=(echo(i) if echo else "") + c.text, finish_reason=c.finish_reason,
                           logprobs=c.logprobs)
        for i, c in enumerate(done.choices)])


def chat_response(rid: str, model: str, done: Collected, tools: set[str] | None) -> s.ChatCompletionResponse:
    """``tools``: the names of the functions in play, whose calls are read from each answer's text (an
    answer of calls that stopped ends with finish_reason "tool_calls"); None when no tools are in play."""
    choices = []
    for i, c in enumerate(done.choices):
        content, calls = parse(c.text, tools) if tools is not None else (c.text, [])
        reason = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
        choices.append(s.ChatChoice(index=i, message=s.ChatMessageOut(content=content, tool_calls=calls or None),
                                    finish_reason=reason, logprobs=c.logprobs))
    return s.ChatCompletionResponse(id=rid, model=model, usage=done.usage, choices=choices)


async def completion(body: r.CompletionRequest, caller: Caller, served: Served) -> Response:
    """``POST /v1/completions``: every prompt of the batch, ``n`` choices each."""
    check_model(body.model, served.model_id, served.aliases)
    tokenizer = served.tokenizer
    try:
        prompts = completion_prompts(body, tokenizer)
    except TokenizerError as exc:
        raise ApiError(400, f"prompt: {exc}", param="prompt") from exc
    check_prompt_ids(prompts, served.limits.vocab_size)
    for ids in prompts:
        check_length(len(ids), body.max_tokens, served.limits.max_context)
    # echo with logprobs: the prompt's own log-probabilities too (prompt_logprobs.py)
    prompt_lps = body.logprobs if body.echo and body.logprobs is not None else None
    grammar = await served.constraints.of(body, None)
    params = [sampling_params(body, body.max_tokens, len(ids), served.limits, body.logprobs, prompt_lps, grammar)
              for ids in prompts]
    rid = f"cmpl-{uuid.uuid4().hex}"
    echo = echo_of(body, tokenizer)
    n = body.n
    render = completion_render(tokenizer, prompts, n) if body.logprobs is not None else None
    outputs = served.generation.samples(prompts, params, cache_salt(caller.api_key, body.cache_salt,
                                                                    served.isolate_tenants), n)
    if body.stream:
        include_usage, continuous_usage = usage_options(body.stream_options)
        return await caller.until_disconnect(stream(
            rid, outputs, chat=False, model=served.model_id, include_usage=include_usage,
            continuous_usage=continuous_usage, prefix=echo, keepalive_s=served.keepalive_s, render=render))
    done = await caller.until_disconnect(collect(outputs, render))
    return JSONResponse(completion_response(rid, served.model_id, done, echo).model_dump())


async def chat_completion(body: r.ChatCompletionRequest, caller: Caller, served: Served) -> Response:
    """``POST /v1/chat/completions``: the conversation through the chat template, ``n`` choices, tool calls
    read back from the answers when tools are in play."""
    check_model(body.model, served.model_id, served.aliases)
    tokenizer = served.tokenizer
    try:
        prompt_ids = chat_prompt(body, tokenizer)
    except TokenizerError as exc:
        raise ApiError(400, str(exc), param="messages") from exc
    tools = active(body)
    if tools:
        await served.constraints.check_tools(body)
    grammar = await served.constraints.of(body, body.response_format, tool_grammar(body) if tools else None)
    max_tokens = chat_max_tokens(body)
    check_length(len(prompt_ids), max_tokens, served.limits.max_context)
    params = sampling_params(body, max_tokens, len(prompt_ids), served.limits,
                             (body.top_logprobs or 0) if body.logprobs else None, grammar=grammar)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    render: Render | None = (lambda _: LogprobRenderer(tokenizer, chat=True)) if body.logprobs else None
    outputs = served.generation.samples([prompt_ids], [params], cache_salt(caller.api_key, body.cache_salt,
                                                                            served.isolate_tenants), body.n)
    names = {t.function.name for t in body.tools or []}
    if body.stream:
        include_usage, continuous_usage = usage_options(body.stream_options)
        return await caller.until_disconnect(stream(
            rid, outputs, chat=True, model=served.model_id, include_usage=include_usage,
            continuous_usage=continuous_usage, keepalive_s=served.keepalive_s, render=render,
            tool_stream=(lambda: ToolStream(names)) if tools else None))
    done = await caller.until_disconnect(collect(outputs, render))
    return JSONResponse(chat_response(rid, served.model_id, done, names if tools else None).model_dump())


def openai_routes(state: ServerState) -> APIRouter:
    router = APIRouter()
    served = Served.of(state)

    @router.get("/v1/models", response_model=s.ModelList, responses={401: ERRORS[401]})
    async def models() -> s.ModelList:
        return model_list(served.model_id, state.started, state.request_limit())

    @router.post("/v1/completions", response_model=s.CompletionResponse, responses=GENERATION_ERRORS)
    async def completions(body: r.CompletionRequest, request: Request) -> Response:
        return await completion(body, Caller.of(request), served)

    @router.post("/v1/chat/completions", response_model=s.ChatCompletionResponse, responses=GENERATION_ERRORS)
    async def chat(body: r.ChatCompletionRequest, request: Request) -> Response:
        return await chat_completion(body, Caller.of(request), served)

    return router
