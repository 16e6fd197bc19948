"""What a replica tells the router: its digest root and page size, its tokenizer, and the pages it holds.

The router's whole premise is that it computes a prompt's page digests itself and finds them in what a
replica reports; these tests check that the two agree on a real server state (a tiny model), and that the
tokenizer rebuilt from the spec encodes exactly as the replica's own.
"""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from kvdrive.runtime.prompt import ChatMessage, Tokenizer, page_digests
from kvdrive.runtime.protocol.secret_files import ApiKey
from kvdrive.runtime.server.app import create_app
from kvdrive.runtime.server.state import ServerState


def test_the_pages_a_replica_reports_are_the_digests_the_router_computes(tiny_state: ServerState) -> None:
    client = TestClient(create_app(tiny_state))
    info = client.get("/v1/kvdrive/routing").json()
    root, page = bytes.fromhex(info["root"]), info["page_size"]
    assert info["model"] == "tiny" and page == 16 and len(info["instance"]) == 32

    prompt = list(range(10, 90))  # 80 token ids: 5 full pages
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200
    listed = client.get("/v1/kvdrive/prefixes")
    assert listed.headers["content-type"] == "application/octet-stream"
    assert listed.headers["x-kvdrive-root"] == info["root"]
    held = {listed.content[i : i + 16] for i in range(0, len(listed.content), 16)}
    assert int(listed.headers["x-kvdrive-pages"]) == len(held)
    assert set(page_digests(root, prompt, page)) <= held  # the router's digests are the replica's pages
    other = page_digests(root, list(range(500, 580)), page)
    assert not set(other) & held  # and a prompt never sent is not there


def test_the_tokenizer_spec_rebuilds_the_replicas_tokenizer(tiny_state: ServerState) -> None:
    client = TestClient(create_app(tiny_state))
    rebuilt = Tokenizer.from_spec(client.get("/v1/kvdrive/tokenizer").json())
    own = tiny_state.tokenizer
    for text in ("Hello world", "  spaces\tand\nlines ", "émoji 🙂 and <|im_start|> spelled out"):
        assert rebuilt.encode(text) == own.encode(text)
    if own.chat_template:
        msgs = [ChatMessage("user", "What is 2+2?")]
        assert rebuilt.encode_chat(msgs) == own.encode_chat(msgs)
    assert rebuilt.eos_token_ids == own.eos_token_ids and rebuilt.bos_token_id == own.bos_token_id


def test_the_routing_endpoints_need_the_api_key_like_the_rest_of_v1(tiny_state: ServerState) -> None:
    import dataclasses

    state = dataclasses.replace(tiny_state, config=dataclasses.replace(tiny_state.config, api_keys=(ApiKey("t", "k-123"),)))
    client = TestClient(create_app(state))
    for path in ("/v1/kvdrive/routing", "/v1/kvdrive/tokenizer", "/v1/kvdrive/prefixes"):
        assert client.get(path).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer k-123"}).status_code == 200


def test_usage_reports_the_prompt_tokens_served_from_stored_pages(tiny_state: ServerState) -> None:
    """``usage.prompt_tokens_details.cached_tokens`` (OpenAI's field): none for a prompt never seen, the
    stored full pages for a repeat, streamed or not; a client (and the routing benchmark) sees what a
    request cost in prefill."""
    client = TestClient(create_app(tiny_state))
    prompt = list(range(120, 210))  # 90 tokens: 5 full pages and 10 tokens
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = client.post("/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens"] == 90 and first["prompt_tokens_details"] == {"cached_tokens": 0}
    again = client.post("/v1/completions", json=body).json()["usage"]
    assert again["prompt_tokens_details"] == {"cached_tokens": 80}
    streamed = client.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 80}
