"""The official ``openai`` client against a real `kvdrive serve` (the demo model): structured outputs through
``chat.completions.parse``, a tool call round trip (whole and streamed), ``n`` with a seed, and every body
and chunk validated against the client's own types."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from conftest import API_KEY, LiveServer
from openai import OpenAI
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel

PEOPLE = [
    "Marie, 34, a nurse in Lyon who plays the violin", "Tom, 51, a fisherman from Bergen",
    "Aiko, 22, a student in Osaka who loves jazz", "Carlos, 45, a chef in Madrid", "Priya, 29, an engineer in Pune",
    "Liam, 8, a boy in Dublin", "Fatima, 63, a teacher in Rabat", "Ivan, 40, a pilot from Kyiv",
    "Sofia, 19, a dancer in Rome", "Noah, 72, a retired farmer in Iowa", "Chen, 36, a doctor in Shanghai",
    "Emma, 27, a painter in Paris who hates noise", "Omar, 55, a taxi driver in Cairo", "Lena, 31, a nurse in Berlin",
    "Raj, 48, a banker in Mumbai", "Ana, 24, a singer in Lisbon", "Jack, 60, a sailor in Sydney",
    "Yuki, 33, a writer in Tokyo", "Zoe, 12, a girl in Toronto who plays piano", "Paul, 39, a baker in Vienna",
]
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}]


class Person(BaseModel):
    name: str
    age: int
    city: str
    likes_music: bool


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> OpenAI:
    return OpenAI(base_url=live_server.url + "/v1", api_key=API_KEY, timeout=300)


def _sse(live_server: LiveServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    text = httpx.post(live_server.url + path, json={**body, "stream": True}, headers=live_server.headers(),
                      timeout=300).text
    return [json.loads(ln[6:]) for ln in text.split("\n\n") if ln.startswith("data: {")]


def test_parse_returns_a_parsed_object_for_every_prompt(client: OpenAI) -> None:
    parsed = []
    for p in PEOPLE:
        r = client.chat.completions.parse(model="demo", messages=[{"role": "user", "content": f"Extract the person: {p}"}],
                                          response_format=Person, temperature=0)
        parsed.append(r.choices[0].message.parsed)
    assert all(isinstance(x, Person) for x in parsed), parsed
    assert sum(x.age == int(p.split(", ")[1]) for x, p in zip(parsed, PEOPLE, strict=True)) >= 18  # read, not made up


def test_a_tool_call_round_trips_whole_and_streamed(client: OpenAI, live_server: LiveServer) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="demo", messages=ask, tools=WEATHER, tool_choice="required",  # type: ignore[arg-type]
                                       temperature=0)
    ChatCompletion.model_validate(r.model_dump())
    call = r.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments)["city"]  # type: ignore[union-attr]
    chunks = _sse(live_server, "/v1/chat/completions", {"model": "demo", "messages": ask, "tools": WEATHER,
                                                        "tool_choice": "required", "temperature": 0})
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
    deltas = [d for c in chunks for ch in c["choices"] for d in ch["delta"].get("tool_calls") or []]
    assert deltas[0]["function"]["name"] == "get_weather" and deltas[0]["id"]
    assert json.loads("".join(d["function"]["arguments"] or "" for d in deltas)) == json.loads(call.function.arguments)  # type: ignore[union-attr]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    history = ask + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 18, "sky": "cloudy"})}]
    answer = client.chat.completions.create(model="demo", messages=history, tools=WEATHER, temperature=0,  # type: ignore[arg-type]
                                            max_tokens=40)
    ChatCompletion.model_validate(answer.model_dump())
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content


def test_n_with_a_seed_repeats_exactly(client: OpenAI) -> None:
    def ask() -> list[str]:
        r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Name a color."}],
                                           n=3, seed=7, temperature=0.9, max_tokens=12)
        ChatCompletion.model_validate(r.model_dump())
        return [c.message.content or "" for c in sorted(r.choices, key=lambda c: c.index)]

    first = ask()
    assert len(first) == 3 and ask() == first


def test_logprob_and_echo_bodies_validate_against_the_client_types(live_server: LiveServer) -> None:
    body = {"model": "demo", "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "logprobs": 2}
    raw = httpx.post(live_server.url + "/v1/completions", json=body, headers=live_server.headers(), timeout=120).json()
    Completion.model_validate(raw)
    for c in _sse(live_server, "/v1/completions", body):  # a chunk before the last has finish_reason null (as
        # OpenAI streams them), which the client's Completion type, shared by both, does not declare
        Completion.model_validate({**c, "choices": [{**ch, "finish_reason": ch["finish_reason"] or "length"}
                                                     for ch in c["choices"]]})
    # with echo, the prompt's first token has no log-probability: null, as OpenAI's API answers it, although the
    # client's types declare a number; everything else validates
    echo = httpx.post(live_server.url + "/v1/completions", json={**body, "echo": True}, headers=live_server.headers(),
                      timeout=120).json()
    lp = echo["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert None not in lp["token_logprobs"][1:] + lp["top_logprobs"][1:]
    Completion.model_validate({**echo, "choices": [{**echo["choices"][0], "logprobs": {
        **lp, "token_logprobs": lp["token_logprobs"][1:], "top_logprobs": lp["top_logprobs"][1:]}}]})
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True,
            "top_logprobs": 2}
    ChatCompletion.model_validate(httpx.post(live_server.url + "/v1/chat/completions", json=chat,
                                             headers=live_server.headers(), timeout=120).json())
    for c in _sse(live_server, "/v1/chat/completions", chat):
        ChatCompletionChunk.model_validate(c)
