"""The official `openai` client against a real `kvdrive serve` process with the demo model."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import ADMIN_TOKEN, API_KEY, LiveServer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key=API_KEY, max_retries=0)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]


def test_chat_completion_with_usage(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="demo", messages=QUESTION, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == 37 and r.usage.completion_tokens == 7 and r.usage.total_tokens == 44


def test_streamed_chat_equals_non_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=16,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is Paris."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7
    assert all(c.usage is None for c in chunks[:-1])  # usage once, at the end, unless asked for every chunk


def test_continuous_usage_counts_tokens_as_they_stream(client: openai.OpenAI) -> None:
    # vLLM's stream_options.continuous_usage_stats, which guidellm sends: the usage so far in every chunk
    stream = client.chat.completions.create(model="demo", messages=QUESTION, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True,
                                                                         "continuous_usage_stats": True})
    chunks = list(stream)
    counted = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert counted and counted == sorted(counted) and counted[-1] == 7  # grows with the answer
    assert all(c.usage.prompt_tokens == 37 for c in chunks if c.usage is not None)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7


def test_completion_length_limit_and_stop(client: openai.OpenAI) -> None:
    r = client.completions.create(model="demo", prompt="The capital of France is", max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    s = client.completions.create(model="demo", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 7"])
    assert s.choices[0].finish_reason == "stop" and " 7" not in s.choices[0].text
    assert s.choices[0].text.startswith(" 5, 6,")


def test_streamed_completion(client: openai.OpenAI) -> None:
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="demo", prompt="The capital of France is", max_tokens=6, temperature=0, stream=True))
    assert text == client.completions.create(model="demo", prompt="The capital of France is", max_tokens=6,
                                             temperature=0).choices[0].text


def test_seeded_sampling_is_reproducible_and_the_seed_matters(client: openai.OpenAI) -> None:
    def ask(seed: int) -> str:
        return client.chat.completions.create(model="demo", messages=QUESTION, max_tokens=12, temperature=1.5,
                                              seed=seed).choices[0].message.content or ""

    assert ask(3) == ask(3)
    assert len({ask(s) for s in (1, 2, 3, 4)}) > 1  # a server that ignored the seed would answer alike


def test_logprobs_and_penalties_parse_into_the_clients_types(client: openai.OpenAI) -> None:
    """Chat and completion logprobs, streamed or not, parse into the client's typed objects and spell the
    answer; the sampling controls go through the client's own signatures."""
    r = client.chat.completions.create(model="demo", messages=QUESTION, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content)
    streamed = [t for c in client.chat.completions.create(model="demo", messages=QUESTION, max_tokens=8,
                                                            temperature=0, logprobs=True, top_logprobs=2, stream=True)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 5)) for t in streamed] == [(t.token, round(t.logprob, 5)) for t in content]
    c = client.completions.create(model="demo", prompt="The capital of France is", max_tokens=5, temperature=0,
                                  logprobs=3)
    assert "".join(c.choices[0].logprobs.tokens) == c.choices[0].text and len(c.choices[0].logprobs.top_logprobs) == 5
    penalised = client.chat.completions.create(model="demo", messages=QUESTION, max_tokens=8, temperature=0,
                                               presence_penalty=2.0, frequency_penalty=2.0, logit_bias={"42": -100})
    assert isinstance(penalised.choices[0].message.content, str) and penalised.choices[0].finish_reason


def test_n_choices_with_a_seed_repeat_exactly(client: openai.OpenAI) -> None:
    def ask() -> list[str]:
        r = client.chat.completions.create(model="demo", messages=QUESTION, max_tokens=12, temperature=1.2, seed=7, n=3)
        assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.prompt_tokens == 37
        assert r.usage.completion_tokens == r.usage.total_tokens - 37 >= 3  # the prompt once, 3 choices' tokens
        return [c.message.content or "" for c in r.choices]

    first = ask()
    assert ask() == first and len(set(first)) > 1  # repeats, and the choices are distinct samples


def test_missing_or_wrong_api_key_is_401(live_server: LiveServer) -> None:
    bad = openai.OpenAI(base_url=live_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(live_server.url + "/v1/models").status_code == 401


def test_admin_requires_the_admin_token(live_server: LiveServer) -> None:
    assert httpx.get(live_server.url + "/admin/tiers", headers=live_server.headers(API_KEY)).status_code == 401
    r = httpx.get(live_server.url + "/admin/tiers", headers=live_server.headers(ADMIN_TOKEN))
    assert r.status_code == 200
    gpu = next(t for t in r.json()["tiers"] if t["tier"] == "gpu")
    assert gpu["capacity_bytes"] > 0 and gpu["used_bytes"] <= gpu["capacity_bytes"]


@pytest.mark.parametrize("body, status, fragment", [
    ({"model": "nope", "messages": QUESTION}, 404, "model 'nope' is not served"),
    ({"model": "demo", "messages": QUESTION, "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "demo", "messages": []}, 400, "messages"),
    ({"model": "demo", "messages": QUESTION, "temperature": 7}, 400, "temperature"),
    ({"model": "demo", "messages": QUESTION, "n": 17}, 400, "n"),
    ({"model": "demo", "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ({"model": "demo", "messages": QUESTION, "max_tokens": 9000}, 400, "exceeds this model's context"),
])
def test_bad_chat_requests_get_clear_4xx(live_server: LiveServer, body: dict, status: int, fragment: str) -> None:
    r = httpx.post(live_server.url + "/v1/chat/completions", json=body, headers=live_server.headers(), timeout=60)
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]["message"]


def test_prompt_longer_than_context_is_400(live_server: LiveServer) -> None:
    r = httpx.post(live_server.url + "/v1/completions", json={"model": "demo", "prompt": [42] * 9000},
                   headers=live_server.headers(), timeout=60)
    assert r.status_code == 400 and "context is 8192 tokens" in r.json()["error"]["message"]


def test_malformed_json_is_400(live_server: LiveServer) -> None:
    r = httpx.post(live_server.url + "/v1/completions", content=b"{not json", headers={
        **live_server.headers(), "content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_metrics_expose_the_contract_names(live_server: LiveServer) -> None:
    text = httpx.get(live_server.url + "/metrics").text
    for name in ("kvdrive_tier_capacity_bytes", "kvdrive_tier_used_bytes", "kvdrive_page_reads_total",
                 "kvdrive_requests_running", "kvdrive_requests_waiting", "kvdrive_generated_tokens_total",
                 "kvdrive_time_to_first_token_seconds_bucket", "kvdrive_inter_token_latency_seconds_bucket",
                 "kvdrive_prefetch_total", "kvdrive_prefetch_throttled_steps_total"):
        assert name in text, name
    for tier in ("gpu", "dram", "ssd"):
        assert f'kvdrive_tier_used_bytes{{tier="{tier}"}}' in text
