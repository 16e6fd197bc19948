"""The sampling controls reach the engine from HTTP: a logit bias forces a token in a greedy completion, a
stop token id ends it, and min_tokens holds that end back, over the tiny model in-process."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from kvdrive.runtime.server.app import ServerState, create_app


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
