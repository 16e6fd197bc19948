"""Over HTTP, in-process on the tiny model: the sampling controls reach the engine (a logit bias forces a
token in a greedy completion, a stop token id ends it, min_tokens holds that end back), and a stream whose
prompt takes long sends SSE keep-alive comments until its first token."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from kvdrive.runtime.server.app import create_app
from kvdrive.runtime.server.state import ServerState


@pytest.fixture()
async def client(tiny_state: ServerState) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(tiny_state)), base_url="http://t") as c:
        yield c


async def _complete(client: httpx.AsyncClient, **fields: object) -> dict:  # type: ignore[type-arg]
    r = await client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 17, 33, 61, 90, 12], "max_tokens": 6,
                                                   "temperature": 0, "ignore_eos": True, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]  # type: ignore[no-any-return]


async def test_a_logit_bias_and_a_stop_token_id_steer_a_greedy_completion(client: httpx.AsyncClient,
                                                                          tiny_state: ServerState) -> None:
    tok = tiny_state.tokenizer
    plain = await _complete(client)
    forced = await _complete(client, logit_bias={"77": 100})
    assert forced["text"] == tok.decode([77] * 6) != plain["text"] and forced["finish_reason"] == "length"
    stopped = await _complete(client, stop_token_ids=[77], logit_bias={"77": 100})
    assert stopped["text"] == "" and stopped["finish_reason"] == "stop"
    held = await _complete(client, stop_token_ids=[77], logit_bias={"77": 100}, min_tokens=3)
    assert held["finish_reason"] == "stop" and len(tok.encode(held["text"], add_bos=False)) >= 3


async def test_a_stream_sends_keepalive_comments_while_its_prompt_is_computed(
        tiny_state: ServerState, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each engine step is held up 0.3 s (a long prefill); with a 0.05 s keep-alive interval the stream carries
    SSE comment lines before its first token, and its tokens and end are those of an unslowed stream."""
    engine = tiny_state.engine.engine
    real_step = engine.step

    def slow_step():  # type: ignore[no-untyped-def]
        time.sleep(0.3)
        return real_step()

    body = {"model": "tiny", "prompt": [5, 17, 33, 61], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "stream": True}
    fast = create_app(dataclasses.replace(tiny_state, config=dataclasses.replace(
        tiny_state.config, sse_keepalive_seconds=0.05)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=fast), base_url="http://t") as c:
        plain = (await c.post("/v1/completions", json=body)).text
        monkeypatch.setattr(engine, "step", slow_step)
        slowed = (await c.post("/v1/completions", json=body)).text
    lines = [ln for ln in slowed.split("\n\n") if ln]
    first_data = next(i for i, ln in enumerate(lines) if ln.startswith("data: {"))
    assert first_data > 0 and all(ln == ": keep-alive" for ln in lines[:first_data]), lines[:first_data + 1]
    data = [ln for ln in lines if ln.startswith("data: ")]

    def texts(stream: str) -> list[str]:
        return [json.loads(ln[6:])["choices"][0]["text"] for ln in stream.split("\n\n") if ln.startswith("data: {")]

    assert texts(slowed) == texts(plain) and data[-1] == "data: [DONE]"


async def _hit_pages(client: httpx.AsyncClient) -> float:
    text = (await client.get("/metrics")).text
    return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith("kvdrive_prefix_hit_pages_total")))


async def test_n_choices_share_the_prompt_and_stream_with_their_index(client: httpx.AsyncClient) -> None:
    """n=4 samples of one 100-token prompt: the prompt's 6 full pages are computed once and the other 3
    choices reference them (18 page hits); the usage counts the prompt once; with a seed the 4 choices
    repeat exactly, whole or streamed, each streamed chunk naming its choice."""
    prompt = [(7 * i) % 200 + 3 for i in range(100)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 1.0, "seed": 3, "n": 4,
            "ignore_eos": True}
    before = await _hit_pages(client)
    whole = (await client.post("/v1/completions", json=body)).json()
    assert await _hit_pages(client) - before >= 3 * (100 // 16)
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    assert whole["usage"]["prompt_tokens"] == 100 and whole["usage"]["completion_tokens"] == 20
    again = (await client.post("/v1/completions", json=body)).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in whole["choices"]]
    assert len({c["text"] for c in whole["choices"]}) > 1
    text = (await client.post("/v1/completions", json={**body, "stream": True})).text
    streamed: dict[int, str] = {}
    for ln in text.split("\n\n"):
        if ln.startswith("data: {"):
            for ch in json.loads(ln[6:])["choices"]:
                streamed[ch["index"]] = streamed.get(ch["index"], "") + ch["text"]
    assert [streamed[i] for i in range(4)] == [c["text"] for c in whole["choices"]]


async def test_the_kv_usage_gauge_counts_pages_promised_to_running_requests(tiny_state: ServerState) -> None:
    """The Gateway API Inference Extension's KV-usage metric: 0 with nothing running, above 0 while a request
    holds pages, back to 0 once it ended (its pages stay stored for reuse, evictable: free); the cache's shape
    is an info gauge."""
    def gauge(text: str, name: str) -> float:
        return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith(name + " ")))

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(tiny_state)), base_url="http://t") as c:
        before = (await c.get("/metrics")).text
        assert gauge(before, "kvdrive_kv_cache_usage_ratio") == 0.0
        info = next(ln for ln in before.splitlines() if ln.startswith("kvdrive_cache_config_info{"))
        assert 'block_size="' in info and 'num_gpu_blocks="' in info and info.endswith(" 1.0")
        body = {"model": "tiny", "prompt": list(range(5, 165)), "max_tokens": 90, "ignore_eos": True}
        answer = asyncio.ensure_future(c.post("/v1/completions", json=body))
        during = 0.0
        while not answer.done():  # scraped while the request runs (the engine has its own thread)
            text = (await c.get("/metrics")).text
            if gauge(text, "kvdrive_requests_running") >= 1:
                during = max(during, gauge(text, "kvdrive_kv_cache_usage_ratio"))
            await asyncio.sleep(0.005)
        assert (await answer).status_code == 200
        assert 0.0 < during <= 1.0
        assert gauge((await c.get("/metrics")).text, "kvdrive_kv_cache_usage_ratio") == 0.0
