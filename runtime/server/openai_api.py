"""The OpenAI-compatible routes: ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``.

A request becomes one engine request per choice (``fanout.py``: each prompt computed once), answered whole
or streamed (``streaming.py``). Every user error is an ``ApiError`` naming the field.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvdrive.runtime.engine import PromptTooLongError, QueueFullError, SamplingParams
from kvdrive.runtime.engine import Request as EngineRequest
from kvdrive.runtime.engine.grammar import CompiledGrammar, GrammarCompiler, GrammarError, GrammarSpec
from kvdrive.runtime.prompt.digests import tenant_salt
from kvdrive.runtime.prompt.tokenizer import TokenizerError
from kvdrive.runtime.protocol import request_schemas as r
from kvdrive.runtime.protocol.output_schemas import ResponseFormat
from kvdrive.runtime.protocol.prompts import chat_prompt, completion_prompts
from kvdrive.runtime.protocol.secret_files import ApiKey
from kvdrive.runtime.protocol.tool_prompt import active
from kvdrive.runtime.server import response_schemas as s
from kvdrive.runtime.server.errors import ERRORS, GENERATION_ERRORS, ApiError
from kvdrive.runtime.server.fanout import Fanout
from kvdrive.runtime.server.logprobs import LogprobRenderer
from kvdrive.runtime.server.state import ServerState
from kvdrive.runtime.server.streaming import collect, stream
from kvdrive.runtime.server.structured import grammar_spec, tool_grammar
from kvdrive.runtime.server.tool_parsing import ToolStream, parse

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready; its request was aborted."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``work``, cancelled the moment the client disconnects (its request is then aborted in the engine,
    freeing its slot and pages at the next step). Starlette notices a disconnect by itself only while it
    streams a response; this covers the wait before that: a prefill, or a whole non-streamed answer."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            raise ClientGone() from None
        raise
    finally:
        watcher.cancel()


def openai_routes(state: ServerState) -> APIRouter:
    router = APIRouter()
    cfg = state.config
    grammars = GrammarCompiler(state.tokenizer)

    async def constraint(body: r.SamplingFields, response_format: ResponseFormat | None,
                         tool_spec: GrammarSpec | None = None) -> CompiledGrammar | None:
        """The request's output grammar (a format, or a forced tool call), compiled off the event loop; a bad
        one is a 400 naming its field."""
        try:
            found = grammar_spec(response_format, body.guided_choice, body.guided_regex)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="response_format") from exc
        if tool_spec is not None:
            if found is not None:
                raise ApiError(400, f"a forced tool call (tool_choice) cannot be combined with {found[1]}",
                               param="tool_choice")
            found = (tool_spec, "tools")
        if found is None:
            return None
        spec, field = found
        try:
            return await asyncio.to_thread(grammars.compile, spec)
        except GrammarError as exc:
            raise ApiError(400, f"{field}: {exc}", param=field) from exc

    def check_model(name: str) -> None:
        if name not in (cfg.model_id, *cfg.aliases):
            raise ApiError(404, f"model {name!r} is not served here (served: {cfg.model_id})", "not_found_error",
                           "model")

    async def check_tools(body: r.ChatCompletionRequest) -> None:
        """Each function's parameters must be a schema a call can follow (compiled, off the event loop)."""
        for i, tool in enumerate(body.tools or []):
            spec = GrammarSpec("json_schema", json.dumps(tool.function.parameters))
            try:
                await asyncio.to_thread(grammars.compile, spec)
            except GrammarError as exc:
                raise ApiError(400, f"tools[{i}].function.parameters: {exc}", param="tools") from exc

    def sampling(body: r.SamplingFields, max_tokens: int | None, prompt_len: int, logprobs: int | None,
                 prompt_logprobs: int | None = None, grammar: CompiledGrammar | None = None) -> SamplingParams:
        room = state.max_context - prompt_len
        wanted = max_tokens if max_tokens is not None else cfg.default_chat_max_tokens
        vocab = state.tokenizer.vocab_size
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

    def check_length(prompt_len: int, max_tokens: int | None) -> None:
        if prompt_len + 1 > state.max_context:
            raise ApiError(400, f"the prompt has {prompt_len} tokens; this model's context is {state.max_context} "
                                f"tokens (prompt + at least one generated token)", param="prompt")
        if max_tokens is not None and prompt_len + max_tokens > state.max_context:
            raise ApiError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds this model's "
                                f"context of {state.max_context} tokens", param="max_tokens")

    async def run(prompt_ids: list[int], params: SamplingParams, salt: str | None) -> AsyncIterator[object]:
        request = EngineRequest(uuid.uuid4().hex, tuple(prompt_ids), params, time.perf_counter(), cache_salt=salt)
        arrived, last = request.arrival, None
        try:
            async for out in state.engine.generate(request):
                now = time.perf_counter()
                if out.new_token_ids:
                    if last is None:
                        state.metrics.ttft.observe(now - arrived)
                    else:
                        state.metrics.itl.observe(now - last)
                    last = now
                if out.error:
                    raise ApiError(503, out.error, "server_error")
                yield out
        except QueueFullError as exc:
            raise ApiError(429, f"server busy: {exc}; retry later", "rate_limit_error",
                           headers={"Retry-After": str(cfg.retry_after_seconds)}) from exc
        except PromptTooLongError as exc:
            raise ApiError(400, str(exc), param="prompt") from exc

    def salt_of(request: Request, cache_salt: str | None) -> str | None:
        """The request's cache salt: under --isolate-tenants derived from its API key (``tenant_salt``), then
        narrowed by its own ``cache_salt``; otherwise its ``cache_salt``."""
        key: ApiKey | None = getattr(request.state, "api_key", None)
        return tenant_salt(key.key, cache_salt) if cfg.isolate_tenants and key is not None else cache_salt

    def samples(prompts: list[list[int]], params: list[SamplingParams], salt: str | None, n: int) -> Fanout:
        """The ``n`` choices of each prompt (``fanout.py``: each prompt computed once); with a seed, sample j
        samples with seed + j, so the whole answer repeats. Only a prompt's sample 0 computes the prompt's
        log-probabilities (its other samples reuse its pages and echo the same)."""
        def start(c: int) -> AsyncIterator[object]:
            p, j = divmod(c, n)
            seeded = params[p] if params[p].seed is None else dataclasses.replace(
                params[p], seed=(params[p].seed + j) % 2**63)  # type: ignore[operator]
            if j:
                seeded = dataclasses.replace(seeded, prompt_logprobs=None)
            return run(prompts[p], seeded, salt)
        return Fanout(start, n, len(prompts))  # type: ignore[arg-type]

    @router.get("/v1/models", response_model=s.ModelList, responses={401: ERRORS[401]})
    async def models() -> s.ModelList:
        # max_model_len: what one request can hold now (the model's context, or less when the KV tiers
        # as configured hold less per request)
        return s.ModelList(data=[s.ModelCard(id=cfg.model_id, created=state.started,
                                             max_model_len=state.request_limit())])

    @router.post("/v1/completions", response_model=s.CompletionResponse, responses=GENERATION_ERRORS)
    async def completions(body: r.CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        try:
            prompts = completion_prompts(body, state.tokenizer)
        except TokenizerError as exc:
            raise ApiError(400, f"prompt: {exc}", param="prompt") from exc
        vocab = state.tokenizer.vocab_size
        if any(t < 0 or t >= vocab for ids in prompts for t in ids):
            raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
        for ids in prompts:
            check_length(len(ids), body.max_tokens)
        # echo with logprobs: the prompt's own log-probabilities too (prompt_logprobs.py)
        prompt_lps = body.logprobs if body.echo and body.logprobs is not None else None
        grammar = await constraint(body, None)
        params = [sampling(body, body.max_tokens, len(ids), body.logprobs, prompt_lps, grammar) for ids in prompts]
        rid = f"cmpl-{uuid.uuid4().hex}"
        echoes = [t if isinstance(t, str) else state.tokenizer.decode(t, skip_special_tokens=False)
                  for t in body.prompts()] if body.echo else []  # token-id prompts decoded only to echo them
        n = body.n

        def prefix(c: int) -> str:
            return echoes[c // n] if body.echo else ""

        def render(c: int) -> LogprobRenderer:
            return LogprobRenderer(state.tokenizer, chat=False, echo_first=prompts[c // n][0])

        renders = render if body.logprobs is not None else None
        outputs = samples(prompts, params, salt_of(request, body.cache_salt), n)
        if body.stream:
            return await until_disconnect(request, stream(
                rid, outputs, chat=False, model=cfg.model_id,
                include_usage=bool(body.stream_options and body.stream_options.include_usage),
                continuous_usage=bool(body.stream_options and body.stream_options.continuous_usage_stats),
                prefix=prefix if body.echo else None, keepalive_s=cfg.sse_keepalive_seconds, render=renders))
        done = await until_disconnect(request, collect(outputs, renders))
        return JSONResponse(s.CompletionResponse(id=rid, model=cfg.model_id, usage=done.usage, choices=[
            s.CompletionChoice(index=i, text=prefix(i) + c.text, finish_reason=c.finish_reason, logprobs=c.logprobs)
            for i, c in enumerate(done.choices)]).model_dump())

    @router.post("/v1/chat/completions", response_model=s.ChatCompletionResponse, responses=GENERATION_ERRORS)
    async def chat(body: r.ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        try:
            prompt_ids = chat_prompt(body, state.tokenizer)
        except TokenizerError as exc:
            raise ApiError(400, str(exc), param="messages") from exc
        tools = active(body)
        if tools:
            await check_tools(body)
        grammar = await constraint(body, body.response_format, tool_grammar(body) if tools else None)
        max_tokens = body.max_completion_tokens or (body.max_tokens if "max_tokens" in body.model_fields_set else None)
        check_length(len(prompt_ids), max_tokens)
        params = sampling(body, max_tokens, len(prompt_ids), (body.top_logprobs or 0) if body.logprobs else None,
                          grammar=grammar)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        render = (lambda _: LogprobRenderer(state.tokenizer, chat=True)) if body.logprobs else None
        outputs = samples([prompt_ids], [params], salt_of(request, body.cache_salt), body.n)
        names = {t.function.name for t in body.tools or []}
        if body.stream:
            return await until_disconnect(request, stream(
                rid, outputs, chat=True, model=cfg.model_id,
                include_usage=bool(body.stream_options and body.stream_options.include_usage),
                continuous_usage=bool(body.stream_options and body.stream_options.continuous_usage_stats),
                keepalive_s=cfg.sse_keepalive_seconds, render=render,
                tool_stream=(lambda: ToolStream(names)) if tools else None))
        done = await until_disconnect(request, collect(outputs, render))
        choices = []
        for i, c in enumerate(done.choices):
            content, calls = parse(c.text, names) if tools else (c.text, [])
            reason = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
            choices.append(s.ChatChoice(index=i, message=s.ChatMessageOut(content=content, tool_calls=calls or None),
                                        finish_reason=reason, logprobs=c.logprobs))
        return JSONResponse(s.ChatCompletionResponse(id=rid, model=cfg.model_id, usage=done.usage,
                                                     choices=choices).model_dump())

    return router
