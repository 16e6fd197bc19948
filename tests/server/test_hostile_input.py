"""Hostile and sloppy input at the HTTP edge, in-process over a tiny model: each case gets the status the
OpenAI API would give and a message naming what is wrong; the credential is checked before the body.

The table is the one in docs/reliability.md (cases, expected status).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from kvdrive.runtime.protocol.secret_files import ApiKey
from kvdrive.runtime.server.app import create_app
from kvdrive.runtime.server.state import ServerState

KEY = "k3y"
ADMIN = "adm1n"
CHAT = [{"role": "user", "content": "hi"}]


def _app(state: ServerState, **config: Any) -> Any:
    settings = {"api_keys": (ApiKey("t", KEY),), "admin_token": ADMIN, **config}
    return create_app(dataclasses.replace(state, config=dataclasses.replace(state.config, **settings)))


@pytest.fixture()
async def client(tiny_state: ServerState) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=_app(tiny_state, max_body_bytes=64 << 10))
    async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                 headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": CHAT, "max_tokens": 2, **fields}


# (path, body, status, fragment of the message, param)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
BAD_INPUT = [
    ("/v1/completions", {"model": "tiny", "prompt": "\udfff x"}, 400, "unpaired UTF-16 surrogate", "prompt"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "\ud800"}]), 400, "surrogate", "messages"),
    ("/v1/chat/completions", chat(logprobs="yes"), 400, "valid boolean", "logprobs"),
    ("/v1/chat/completions", chat(top_logprobs=3), 400, "set logprobs to true", "top_logprobs"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=21), 400, "less than or equal to 20", "top_logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": -1}, 400, "greater than or equal to 0",
     "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": [[5, 6]] * 33}, 400, "at most 32 prompts", "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [[5, 6], []]}, 400, "a prompt of the batch is empty", "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [[5, 6], [10**9]]}, 400, "token ids must be in", "prompt"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "has space"}}]), 400,
     "should match pattern", "tools.0.function.name"),
    ("/v1/chat/completions", chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), 400,
     "Input should be 'function'", "tools.0.type"),
    ("/v1/chat/completions", chat(tools=[TOOL, TOOL]), 400, "function names must be unique", None),
    ("/v1/chat/completions", chat(tool_choice="auto"), 400, "tool_choice needs tools", None),
    ("/v1/chat/completions", chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}), 400,
     "not among the tools", None),
    ("/v1/chat/completions", chat(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"}),
     400, "cannot be combined with response_format", "tool_choice"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 3, "maximum": 1}}, "required": ["x"]}}}],
        tool_choice="required"), 400, "Unsatisfiable", "tools"),
    ("/v1/chat/completions", chat(functions=[{"name": "f"}]), 400, "functions is not supported", "functions"),
    ("/v1/chat/completions", chat(presence_penalty=2.5), 400, "less than or equal to 2", "presence_penalty"),
    ("/v1/chat/completions", chat(frequency_penalty=-3), 400, "greater than or equal to -2", "frequency_penalty"),
    ("/v1/chat/completions", chat(frequency_penalty="high"), 400, "valid number", "frequency_penalty"),
    ("/v1/chat/completions", chat(repetition_penalty=0), 400, "greater than 0", "repetition_penalty"),
    ("/v1/chat/completions", chat(logit_bias={"x": 5}), 400, "token ids as strings", "logit_bias"),
    ("/v1/chat/completions", chat(logit_bias={"42": 500}), 400, "a bias must be in [-100, 100]", "logit_bias"),
    ("/v1/chat/completions", chat(logit_bias={"99999999": 1}), 400, "token ids must be in", "logit_bias"),
    ("/v1/chat/completions", chat(stop_token_ids=[-1]), 400, "token ids must be in", "stop_token_ids"),
    ("/v1/chat/completions", chat(min_tokens=5), 400, "min_tokens (5) exceeds", "min_tokens"),
    ("/v1/chat/completions", chat(min_tokens=-1), 400, "greater than or equal to 0", "min_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "suffix": "y"}, 400, "suffix is not supported", "suffix"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "best_of": 3}, 400, "best_of is not supported", "best_of"),
    ("/v1/chat/completions", chat(bogus=1), 400, "Extra inputs are not permitted", "bogus"),
    ("/v1/chat/completions", chat(max_tokens=True), 400, "valid integer", "max_tokens"),
    ("/v1/chat/completions", chat(stream="yes"), 400, "valid boolean", "stream"),
    ("/v1/chat/completions", chat(temperature="0.5"), 400, "valid number", "temperature"),
    ("/v1/chat/completions", chat(max_tokens="many"), 400, "valid integer", "max_tokens"),
    ("/v1/chat/completions", chat(temperature=7), 400, "less than or equal to 2", "temperature"),
    ("/v1/chat/completions", chat(n=17), 400, "less than or equal to 16", "n"),
    ("/v1/chat/completions", chat(n=0), 400, "greater than or equal to 1", "n"),
    ("/v1/chat/completions", chat(cache_salt=""), 400, "at least 1 character", "cache_salt"),
    ("/v1/chat/completions", chat(messages=[]), 400, "at least 1 item", "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "x"}]), 400, "Input should be",
     "messages.0.role"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "the prompt is empty", "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": []}, 400, "the prompt is empty", "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [10**9]}, 400, "token ids must be in", "prompt"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model 'nope' is not served", "model"),
    ("/v1/completions", {"model": "tiny"}, 400, "Field required", "prompt"),
]


@pytest.mark.parametrize(("path", "body", "status", "fragment", "param"), BAD_INPUT,
                         ids=[f"{c[0].rsplit('/', 1)[-1]}-{c[4]}-{i}" for i, c in enumerate(BAD_INPUT)])
async def test_bad_input_gets_the_openai_status_and_names_the_field(
        client: httpx.AsyncClient, path: str, body: dict[str, Any], status: int, fragment: str, param: str | None) -> None:
    r = await client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["param"] == param and error["code"] == status, error


async def test_neutral_values_of_unsupported_fields_are_accepted(client: httpx.AsyncClient) -> None:
    """What SDKs send by default (logprobs false, penalties 0, no bias, an end-user id) is not an error."""
    r = await client.post("/v1/chat/completions", json=chat(logprobs=False, presence_penalty=0, frequency_penalty=0.0,
                                                           logit_bias={}, tools=[], user="u-1", seed=1))
    assert r.status_code == 200, r.text


async def test_malformed_json_and_nan_are_400(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] is None
    r = await client.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [{"role": "user", '
                          b'"content": "x"}], "temperature": NaN}', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "finite number" in r.json()["error"]["message"], r.text


async def test_the_credential_is_checked_before_the_body(tiny_state: ServerState) -> None:
    transport = httpx.ASGITransport(app=_app(tiny_state))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        r = await c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "authentication_error"
        # RFC 7235: the scheme is case-insensitive
        ok = await c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1},
                          headers={"Authorization": f"bearer {KEY}"})
        assert ok.status_code == 200, ok.text
        assert (await c.get("/admin/tiers", headers={"Authorization": f"Bearer {KEY}"})).status_code == 401
        assert (await c.get("/admin/tiers", headers={"Authorization": f"BEARER {ADMIN}"})).status_code == 200


async def test_metadata_is_open_by_default_and_protected_on_request(tiny_state: ServerState) -> None:
    for protect, status in ((False, 200), (True, 401)):
        transport = httpx.ASGITransport(app=_app(tiny_state, protect_metadata=protect))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            for path in ("/metrics", "/openapi.json", "/docs"):
                assert (await c.get(path)).status_code == status, (protect, path)
            assert (await c.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})).status_code == 200
            assert (await c.get("/healthz")).status_code == 200  # probes carry no token
            health = await c.get("/health")  # vLLM's, which load generators check first
            assert health.status_code == 200 and health.content == b""


async def test_a_body_over_the_limit_is_413_with_or_without_content_length(client: httpx.AsyncClient) -> None:
    big = json.dumps(chat(messages=[{"role": "user", "content": "x" * (80 << 10)}])).encode()
    r = await client.post("/v1/chat/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "exceeds the limit of 65536 bytes" in r.json()["error"]["message"]

    async def chunked() -> AsyncIterator[bytes]:
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    r = await client.post("/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text


async def test_405_names_the_allowed_methods(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"


async def test_models_reports_what_one_request_can_hold(tiny_state: ServerState, client: httpx.AsyncClient) -> None:
    card = (await client.get("/v1/models")).json()["data"][0]
    assert card["max_model_len"] == tiny_state.request_limit() <= tiny_state.max_context


async def test_the_openapi_document_declares_what_the_server_answers(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/openapi.json")).json()
    chat_op = doc["paths"]["/v1/chat/completions"]["post"]
    assert {"400", "401", "404", "413", "429", "503"} <= set(chat_op["responses"]) and "422" not in chat_op["responses"]
    assert "422" in doc["paths"]["/admin/tiers"]["put"]["responses"]  # impossible budgets
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert "HTTPValidationError" not in json.dumps(doc)


def test_a_world_readable_secret_file_is_used_with_a_warning(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    from kvdrive.runtime.protocol.secret_files import read_secret

    path = tmp_path / "admin"
    path.write_text("t0ken\n")
    path.chmod(0o600)
    assert read_secret(path) == "t0ken" and "chmod 600" not in caplog.text
    path.chmod(0o644)
    assert read_secret(path) == "t0ken"
    assert f"secret file {path} is readable by group or others (mode 644): chmod 600 it" in caplog.text


def test_a_kubernetes_secret_volume_file_is_not_warned_about() -> None:
    """Found by the one-node cluster: every pod logged "chmod 600 it" for its admin token. A Secret
    volume with fsGroup gives the file to root, group = the pod's group, mode 0440: group read is
    the only way the server can read it, and the mount is read-only."""
    from kvdrive.runtime.protocol.secret_files import secret_mode_problem

    pod = {"uid": 0, "gid": 10001, "euid": 10001, "groups": (10001,)}
    assert secret_mode_problem(0o440, **pod) is None
    assert secret_mode_problem(0o444, **pod) is not None  # others may still read it: warned
    own = {"uid": 10001, "gid": 10001, "euid": 10001, "groups": (10001,)}
    assert secret_mode_problem(0o640, **own) is not None  # our own file: chmod 600 is the fix
    assert secret_mode_problem(0o600, **own) is None
    stranger = {"uid": 0, "gid": 50, "euid": 10001, "groups": (10001,)}
    assert secret_mode_problem(0o440, **stranger) is not None  # a group we are not in
