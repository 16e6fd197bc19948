"""vLLM's tokenizer routes, in-process on the tiny model: they encode and decode exactly as the engine does
(what lm-evaluation-harness's remote tokenizer relies on), refuse bad input with a 400 naming the field, and
need the API key like /v1."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import httpx
import pytest

from kvdrive.runtime.prompt import ChatMessage
from kvdrive.runtime.protocol.secret_files import ApiKey
from kvdrive.runtime.server.app import create_app
from kvdrive.runtime.server.state import ServerState


@pytest.fixture()
async def client(tiny_state: ServerState) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(tiny_state)), base_url="http://t") as c:
        yield c


async def test_tokenize_and_detokenize_agree_with_the_engine(client: httpx.AsyncClient,
                                                             tiny_state: ServerState) -> None:
    tok = tiny_state.tokenizer
    text = "The capital of France is Paris."
    r = (await client.post("/tokenize", json={"prompt": text, "return_token_strs": True})).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == tiny_state.max_context and len(r["token_strs"]) == r["count"]
    plain = (await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})).json()
    assert plain["tokens"] == tok.encode(text, add_bos=False)
    back = (await client.post("/detokenize", json={"tokens": plain["tokens"]})).json()
    assert back["prompt"] == text
    msgs = [{"role": "user", "content": "hi"}]
    chat = (await client.post("/tokenize", json={"messages": msgs})).json()
    assert chat["tokens"] == tok.encode_chat([ChatMessage("user", "hi")])
    info = (await client.get("/tokenizer_info")).json()
    assert info["eos_token"] == tok.token_text(tok.eos_token_ids[0]) and info["vocab_size"] == tok.vocab_size


@pytest.mark.parametrize(("path", "body", "fragment", "param"), [
    ("/tokenize", {}, "exactly one of prompt and messages", "prompt"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "exactly one of", "prompt"),
    ("/tokenize", {"prompt": 5}, "valid string", "prompt"),
    ("/tokenize", {"prompt": "x", "model": "nope"}, "not served here", "model"),
    ("/detokenize", {"tokens": [10**9]}, "ids must be in", "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "valid integer", "tokens.0"),
])
async def test_bad_input_is_a_4xx_naming_the_field(client: httpx.AsyncClient, path: str, body: dict[str, object],
                                                   fragment: str, param: str) -> None:
    r = await client.post(path, json=body)
    assert 400 <= r.status_code < 500, r.text
    assert fragment in r.json()["error"]["message"] and r.json()["error"]["param"] == param


async def test_the_routes_need_the_api_key(tiny_state: ServerState) -> None:
    state = dataclasses.replace(tiny_state, config=dataclasses.replace(tiny_state.config, api_keys=(ApiKey("t", "k"),)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://t") as c:
        assert (await c.post("/tokenize", json={"prompt": "x"})).status_code == 401
        assert (await c.get("/tokenizer_info")).status_code == 401
        ok = await c.post("/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200
