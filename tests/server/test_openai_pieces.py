"""The OpenAI routes' pieces, called directly (no server, no model): a request's checks and sampling
parameters, its output constraint, the engine's refusals as HTTP errors, answer assembly, a disconnect."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvdrive.runtime.engine import PromptTooLongError, QueueFullError, RequestOutput, SamplingParams
from kvdrive.runtime.engine import Request as EngineRequest
from kvdrive.runtime.engine.grammar import CompiledGrammar, GrammarError, GrammarSpec
from kvdrive.runtime.prompt.digests import tenant_salt
from kvdrive.runtime.protocol import request_schemas as r
from kvdrive.runtime.protocol.secret_files import ApiKey
from kvdrive.runtime.server import openai_params as op
from kvdrive.runtime.server import response_schemas as s
from kvdrive.runtime.server.disconnect import ClientGone, until_disconnect
from kvdrive.runtime.server.errors import ApiError
from kvdrive.runtime.server.generation import Generation
from kvdrive.runtime.server.openai_api import Echo, chat_response, completion_response, usage_options
from kvdrive.runtime.server.streaming import Choice, Collected
from kvdrive.runtime.server.structured import OutputConstraints

LIMITS = op.Limits(max_context=100, vocab_size=50, default_max_tokens=30)
CHAT = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def chat_body(**fields: Any) -> r.ChatCompletionRequest:
    return r.ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT, **fields})


def completion_body(**fields: Any) -> r.CompletionRequest:
    return r.CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def refused(call: Any, *args: Any, **kwargs: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        call(*args, **kwargs)
    return info.value


# ---- a request's checks and sampling parameters


def test_a_model_is_served_by_its_id_or_an_alias_else_404_naming_the_field() -> None:
    op.check_model("m", "m", ())
    op.check_model("demo", "m", ("demo",))
    e = refused(op.check_model, "other", "m", ("demo",))
    assert (e.status, e.kind, e.param) == (404, "not_found_error", "model")
    assert e.message == "model 'other' is not served here (served: m)"


def test_length_checks_name_the_prompt_or_max_tokens() -> None:
    op.check_length(99, None, 100)
    op.check_length(90, 10, 100)
    e = refused(op.check_length, 100, None, 100)
    assert (e.status, e.param) == (400, "prompt") and "the prompt has 100 tokens" in e.message
    e = refused(op.check_length, 90, 11, 100)
    assert (e.status, e.param) == (400, "max_tokens")
    assert e.message == "prompt (90 tokens) + max_tokens (11) exceeds this model's context of 100 tokens"


def test_prompt_token_ids_must_be_in_the_vocabulary() -> None:
    op.check_prompt_ids([[0, 49]], 50)
    for bad in ([[50]], [[1], [-1]]):
        e = refused(op.check_prompt_ids, bad, 50)
        assert (e.status, e.param, e.message) == (400, "prompt", "prompt: token ids must be in [0, 50)")


def test_sampling_params_carry_every_field() -> None:
    body = completion_body(temperature=0.5, top_p=0.9, top_k=-1, seed=3, stop=["x"], ignore_eos=True,
                           presence_penalty=0.1, frequency_penalty=0.2, repetition_penalty=1.3,
                           logit_bias={"7": -2.0}, min_tokens=2, stop_token_ids=[4])
    p = op.sampling_params(body, 10, 5, LIMITS, logprobs=1, prompt_logprobs=2)
    assert p == SamplingParams(max_tokens=10, temperature=0.5, top_p=0.9, top_k=0, seed=3, stop=("x",),
                               ignore_eos=True, presence_penalty=0.1, frequency_penalty=0.2,
                               repetition_penalty=1.3, logit_bias=((7, -2.0),), min_tokens=2,
                               stop_token_ids=(4,), logprobs=1, prompt_logprobs=2)
    neutral = op.sampling_params(completion_body(), 10, 5, LIMITS, logprobs=None)
    assert (neutral.presence_penalty, neutral.frequency_penalty, neutral.repetition_penalty) == (0.0, 0.0, 1.0)


def test_max_tokens_defaults_and_is_cut_to_the_context_left() -> None:
    assert op.sampling_params(completion_body(), None, 5, LIMITS, None).max_tokens == 30  # the default
    assert op.sampling_params(completion_body(), 80, 40, LIMITS, None).max_tokens == 60  # the room after the prompt
    assert op.sampling_params(completion_body(), None, 99, LIMITS, None).max_tokens == 1


def test_out_of_vocabulary_ids_and_min_tokens_past_the_limit_are_400s_naming_the_field() -> None:
    e = refused(op.sampling_params, completion_body(logit_bias={"50": 1.0}), 4, 5, LIMITS, None)
    assert (e.param, e.message) == ("logit_bias", "logit_bias: token ids must be in [0, 50); got [50]")
    e = refused(op.sampling_params, completion_body(stop_token_ids=[1, 60, 70]), 4, 5, LIMITS, None)
    assert (e.param, e.message) == ("stop_token_ids", "stop_token_ids: token ids must be in [0, 50); got [60, 70]")
    e = refused(op.sampling_params, completion_body(min_tokens=5), 4, 5, LIMITS, None)
    assert (e.status, e.param) == (400, "min_tokens")
    assert e.message == "min_tokens (5) exceeds the tokens this request may generate (4)"


def test_chat_max_tokens_prefers_max_completion_tokens_and_reads_max_tokens_only_when_set() -> None:
    assert op.chat_max_tokens(chat_body()) is None
    assert op.chat_max_tokens(chat_body(max_tokens=7)) == 7
    assert op.chat_max_tokens(chat_body(max_tokens=7, max_completion_tokens=9)) == 9


def test_sample_j_seeds_with_seed_plus_j_and_only_sample_0_computes_prompt_logprobs() -> None:
    p = SamplingParams(seed=2**63 - 1, prompt_logprobs=1)
    assert op.sample_params(p, 0) == p
    assert (op.sample_params(p, 1).seed, op.sample_params(p, 1).prompt_logprobs) == (0, None)
    unseeded = SamplingParams(prompt_logprobs=1)
    assert op.sample_params(unseeded, 2) == SamplingParams(prompt_logprobs=None)


def test_the_cache_salt_derives_from_the_api_key_only_when_tenants_are_isolated() -> None:
    key = ApiKey("t", "secret")
    assert op.cache_salt(key, "s", isolate_tenants=False) == "s"
    assert op.cache_salt(None, "s", isolate_tenants=True) == "s"
    assert op.cache_salt(key, "s", isolate_tenants=True) == tenant_salt("secret", "s")


# ---- the output constraint


def _compiler(seen: list[GrammarSpec], error: str | None = None) -> OutputConstraints:
    def compile(spec: GrammarSpec) -> CompiledGrammar:
        seen.append(spec)
        if error is not None:
            raise GrammarError(error)
        return "compiled"  # type: ignore[return-value]
    return OutputConstraints(compile)


async def test_a_request_without_a_constraint_compiles_nothing() -> None:
    seen: list[GrammarSpec] = []
    assert await _compiler(seen).of(chat_body(), None) is None and seen == []


async def test_a_constraint_is_compiled_and_a_bad_one_is_a_400_naming_its_field() -> None:
    seen: list[GrammarSpec] = []
    assert await _compiler(seen).of(completion_body(guided_regex="[0-9]+"), None) == "compiled"
    assert seen == [GrammarSpec("regex", "[0-9]+")]
    with pytest.raises(ApiError) as info:
        await _compiler([], "unclosed").of(completion_body(guided_regex="[0-9"), None)
    assert (info.value.status, info.value.param, info.value.message) == (400, "guided_regex", "guided_regex: unclosed")


async def test_two_constraints_at_once_are_refused() -> None:
    with pytest.raises(ApiError) as info:
        await _compiler([]).of(completion_body(guided_regex="a", guided_choice=["b"]), None)
    assert info.value.param == "response_format" and info.value.message.startswith("give at most one of")
    body = chat_body(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(ApiError) as info:
        await _compiler([]).of(body, body.response_format, GrammarSpec("lark", "start: x"))
    assert (info.value.param, info.value.message) == (
        "tool_choice", "a forced tool call (tool_choice) cannot be combined with response_format")


async def test_a_tool_whose_parameters_do_not_compile_is_named_by_its_index() -> None:
    body = chat_body(tools=[TOOL])
    with pytest.raises(ApiError) as info:
        await _compiler([], "Invalid type").check_tools(body)
    assert (info.value.param, info.value.message) == ("tools", "tools[0].function.parameters: Invalid type")


# ---- the engine's refusals and latencies


def out(tokens: tuple[int, ...] = (1,), error: str | None = None) -> RequestOutput:
    return RequestOutput("r", tokens, "x" * len(tokens), 3, len(tokens), error=error)


def generation(*items: RequestOutput | BaseException, seen: list[EngineRequest] | None = None,
               latencies: tuple[list[float], list[float]] | None = None) -> Generation:
    async def generate(request: EngineRequest) -> AsyncIterator[RequestOutput]:
        if seen is not None:
            seen.append(request)
        for item in items:
            if isinstance(item, BaseException):
                raise item
            yield item
    ttft, itl = latencies or ([], [])
    return Generation(generate, ttft.append, itl.append, retry_after_seconds=7)


async def drain(g: Generation) -> list[RequestOutput]:
    return [o async for o in g.run([1, 2, 3], SamplingParams(), "salt")]


async def test_outputs_pass_through_and_latencies_are_observed() -> None:
    requests: list[EngineRequest] = []
    ttft: list[float] = []
    itl: list[float] = []
    g = generation(out(()), out((5,)), out((6,)), out((7,)), seen=requests, latencies=(ttft, itl))
    assert len(await drain(g)) == 4
    assert requests[0].prompt_ids == (1, 2, 3) and requests[0].cache_salt == "salt"
    assert len(ttft) == 1 and len(itl) == 2  # the first token's wait, then each next token's


async def test_a_full_queue_is_a_429_with_retry_after() -> None:
    with pytest.raises(ApiError) as info:
        await drain(generation(QueueFullError("8 waiting")))
    e = info.value
    assert (e.status, e.kind, e.headers) == (429, "rate_limit_error", {"Retry-After": "7"})
    assert e.message == "server busy: 8 waiting; retry later"


async def test_a_prompt_too_long_is_a_400_naming_the_prompt_and_an_engine_error_a_503() -> None:
    with pytest.raises(ApiError) as info:
        await drain(generation(PromptTooLongError("too long")))
    assert (info.value.status, info.value.param, info.value.message) == (400, "prompt", "too long")
    with pytest.raises(ApiError) as info:
        await drain(generation(out(), out(error="the step failed")))
    assert (info.value.status, info.value.kind, info.value.message) == (503, "server_error", "the step failed")


async def test_samples_run_each_choice_with_its_own_seed() -> None:
    requests: list[EngineRequest] = []
    g = generation(RequestOutput("r", (1,), "x", 3, 1, finished=True), seen=requests)
    fan = g.samples([[1], [2]], [SamplingParams(seed=10), SamplingParams(seed=20)], None, 2)
    got = [c async for c, _ in fan]
    assert sorted(got) == [0, 1, 2, 3]
    assert sorted((q.prompt_ids, q.params.seed) for q in requests) == [((1,), 10), ((1,), 11), ((2,), 20), ((2,), 21)]


# ---- answers


def collected(*choices: Choice) -> Collected:
    return Collected(list(choices), s.Usage.of(3, 4, 0))


def test_a_completion_echoes_each_prompt_before_its_choices() -> None:
    done = collected(Choice(" a", "stop", None), Choice(" b", "length", None), Choice(" c", "stop", None))
    resp = completion_response("cmpl-1", "m", done, Echo(["P", "Q"], 2)).model_dump()
    assert [c["text"] for c in resp["choices"]] == ["P a", "P b", "Q c"]
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2]
    assert completion_response("cmpl-1", "m", done, None).choices[0].text == " a"


def test_a_chat_answer_of_calls_ends_with_tool_calls_and_without_tools_stays_text() -> None:
    text = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    done = collected(Choice(text, "stop", None), Choice(text, "length", None), Choice("plain", "stop", None))
    choices = chat_response("chatcmpl-1", "m", done, {"add"}).choices
    assert [c.finish_reason for c in choices] == ["tool_calls", "length", "stop"]
    call = choices[0].message.tool_calls[0]  # type: ignore[index]
    assert (choices[0].message.content, call.function.name, call.function.arguments) == (None, "add", '{"a": 1}')
    assert choices[2].message.tool_calls is None and choices[2].message.content == "plain"
    as_text = chat_response("chatcmpl-1", "m", done, None).choices[0]
    assert (as_text.message.content, as_text.message.tool_calls, as_text.finish_reason) == (text, None, "stop")


def test_stream_usage_options() -> None:
    assert usage_options(None) == (False, False)
    assert usage_options(r.StreamOptions(include_usage=True)) == (True, False)
    assert usage_options(r.StreamOptions(include_usage=True, continuous_usage_stats=True)) == (True, True)


# ---- a client gone


async def test_a_disconnect_cancels_the_wait_and_a_request_still_there_gets_its_answer() -> None:
    async def gone() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def never() -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {}

    with pytest.raises(ClientGone):
        await until_disconnect(gone, asyncio.sleep(3600))
    assert await until_disconnect(never, asyncio.sleep(0, result="answer")) == "answer"
