"""Structured outputs over HTTP, in-process on the tiny random-weight model: a model whose own choices are
noise still answers documents that parse and follow their schema, because every sampled token is masked to
continue it (llguidance). Bad schemas, regexes and combinations are a 400 naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator

import httpx
import jsonschema
import pytest
from conftest import make_tiny_model

from kvdrive.runtime.server.app import create_app
from kvdrive.runtime.server.state import ServerState

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Berlin"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {"$ref": "#/$defs/Address"},
    },
    "required": ["name", "age", "city", "tags", "address"],
    "additionalProperties": False,
    "$defs": {"Address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                          "required": ["zip"], "additionalProperties": False}},
}


@pytest.fixture()
async def client(tiny_state: ServerState) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(tiny_state)), base_url="http://t") as c:
        yield c


def chat(**extra: object) -> dict[str, object]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "a person"}], "max_tokens": 200, **extra}


async def test_json_schema_answers_always_parse_and_follow_the_schema(client: httpx.AsyncClient) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "Person", "schema": SCHEMA, "strict": True}}
    r = await client.post("/v1/chat/completions", json=chat(response_format=fmt, temperature=1.0, seed=3, n=6))
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice  # the document ended itself, well before max_tokens
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    # sampled, not greedy: the masked tokens' -inf must not turn sampling into argmax
    assert len({c["message"]["content"] for c in r.json()["choices"]}) > 1


@pytest.fixture(scope="module")
def long_client_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerState]:
    """The tiny random-weight model with a context long enough for the generic tools prompt."""
    from kvdrive.runtime.engine import SchedulerConfig
    from kvdrive.runtime.server.serve import ServeOptions, build_state

    d = make_tiny_model(tmp_path_factory.mktemp("tiny-long"), 2048)
    state = build_state(ServeOptions(model=str(d), served_model_name="tiny", progress=False,
                                     scheduler=SchedulerConfig(max_waiting=8)))
    state.engine.start()
    yield state
    state.engine.shutdown()


async def test_a_forced_tool_call_follows_a_schema_with_defs(long_client_state: ServerState) -> None:
    """pydantic (and the openai SDK's pydantic_function_tool) put nested models in $defs: a forced call still
    compiles and its arguments follow the schema, references included."""
    params = {"$defs": {"Address": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                                    "required": ["city"], "additionalProperties": False}},
              "type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}, "count": {"type": "integer",
                                                                                           "minimum": 1, "maximum": 9}},
              "required": ["to", "count"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "ship", "parameters": params}}]
    app = create_app(long_client_state)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        r = await client.post("/v1/chat/completions", json=chat(tools=tools, tool_choice="required", temperature=1.0,
                                                                seed=4, parallel_tool_calls=False))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "ship"
    jsonschema.validate(json.loads(call["function"]["arguments"]), params)


async def test_json_object_mode_answers_an_object_and_a_cut_one_says_length(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=chat(response_format={"type": "json_object"}, temperature=1.0,
                                                            seed=5, n=4))
    for choice in r.json()["choices"]:
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["message"]["content"]), dict)
        else:  # a document cut by max_tokens is reported as such, never as a whole answer
            assert choice["finish_reason"] == "length"
    fmt = {"type": "json_schema", "json_schema": {"name": "Person", "schema": SCHEMA}}  # cannot end in 3 tokens
    short = (await client.post("/v1/chat/completions", json=chat(response_format=fmt, max_tokens=3))).json()
    assert short["choices"][0]["finish_reason"] == "length"


async def test_guided_choice_and_regex_streamed_and_whole(client: httpx.AsyncClient) -> None:
    choices = ["yes", "no", "maybe later", "café \"au lait\""]
    for seed in range(4):
        r = (await client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 20,
                                                        "temperature": 1.0, "seed": seed,
                                                        "guided_choice": choices})).json()
        assert r["choices"][0]["text"] in choices and r["choices"][0]["finish_reason"] == "stop"
    body = chat(guided_regex=r"[0-9]{3}-[a-z]{2}", temperature=1.0, seed=9, stream=True)
    text = (await client.post("/v1/chat/completions", json=body)).text
    parts = [json.loads(ln[6:]) for ln in text.split("\n\n") if ln.startswith("data: {")]
    answer = "".join(p["choices"][0]["delta"].get("content") or "" for p in parts if p["choices"])
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", answer), answer


@pytest.mark.parametrize(("extra", "fragment", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "minimum": 5, "maximum": 1}}}}, "Unsatisfiable schema", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "nonsense", "response_format"),
    ({"response_format": {"type": "json_schema"}}, "json_schema is given exactly when", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}},
     "should match pattern", "response_format.json_schema.name"),
    ({"response_format": {"type": "xml"}}, "Input should be", "response_format.type"),
    ({"guided_regex": "(("}, "invalid regex", "guided_regex"),
    ({"guided_choice": []}, "at least 1 item", "guided_choice"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "at most one of", "response_format"),
])
async def test_a_bad_constraint_is_a_400_naming_the_field(client: httpx.AsyncClient, extra: dict[str, object],
                                                         fragment: str, param: str) -> None:
    r = await client.post("/v1/chat/completions", json=chat(**extra))
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"] and r.json()["error"]["param"] == param, r.json()


async def test_a_grammar_that_can_only_end_wins_over_min_tokens(client: httpx.AsyncClient) -> None:
    """The only choice is the empty string and min_tokens asks for one token: nothing but end-of-sequence
    continues the document, so the answer ends there (a complete document), never a 5xx (found by the fuzzer)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Pick."}], "guided_choice": [""],
            "min_tokens": 1, "max_tokens": 4}
    answer = await client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["message"]["content"] == "" and choice["finish_reason"] == "stop"


async def test_a_grammar_that_can_only_end_survives_a_vanishing_repetition_penalty(
        client: httpx.AsyncClient) -> None:
    """repetition_penalty 5e-324 (valid, but 0 in float32) must not turn the grammar's masked tokens into nan:
    the answer is the empty choice, never a 5xx (the body the fuzzer drew in CI)."""
    body = {"model": "tiny", "messages": [{"role": "tool"}], "guided_choice": [""], "repetition_penalty": 5e-324,
            "max_tokens": 4}
    answer = await client.post("/v1/chat/completions", json=body)
    assert answer.status_code < 500, answer.text
    if answer.status_code == 200:
        assert answer.json()["choices"][0]["message"]["content"] == ""


async def test_a_regex_sampled_at_a_vanishing_temperature_follows_the_regex(client: httpx.AsyncClient) -> None:
    """temperature 5e-324 over a grammar's mask divides every allowed (negative) logit to -inf: the answer is
    the greedy one the regex allows, never a 5xx (the body the fuzzer drew in CI)."""
    body = {"model": "tiny", "messages": [{"role": "tool"}], "guided_regex": "0", "temperature": 5e-324,
            "max_tokens": 4}
    answer = await client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "0"
