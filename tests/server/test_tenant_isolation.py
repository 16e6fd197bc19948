"""Tenant isolation (``--isolate-tenants``), in-process on the tiny model: with one API key per tenant, a
tenant's requests reuse each other's prefix pages and never another tenant's, so no tenant can learn from
timing (or ``cached_tokens``) whether another sent a prompt; without the flag the same two keys share pages
(the control that shows the test can fail). The key file's format is checked too."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import pytest

from kvdrive.runtime.protocol.secret_files import ApiKey, read_api_keys
from kvdrive.runtime.server.app import create_app
from kvdrive.runtime.server.state import ServerState

KEYS = (ApiKey("alice", "key-alice-1"), ApiKey("bob", "key-bob-2"))


async def _cached(client: httpx.AsyncClient, key: str, prompt: list[int], salt: str | None = None) -> int:
    body: dict[str, object] = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if salt:
        body["cache_salt"] = salt
    r = await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize("isolate", [True, False])
async def test_a_tenant_reuses_only_its_own_prefix_pages(tiny_state: ServerState, isolate: bool) -> None:
    config = dataclasses.replace(tiny_state.config, api_keys=KEYS, isolate_tenants=isolate)
    app = create_app(dataclasses.replace(tiny_state, config=config))
    prompt = [7 + (i * 13) % 180 for i in range(100 + isolate)]  # a prompt of its own per case
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        assert await _cached(client, "key-alice-1", prompt) == 0
        assert await _cached(client, "key-alice-1", prompt) > 0  # the same tenant: its stored pages
        bob = await _cached(client, "key-bob-2", prompt)
        if isolate:
            assert bob == 0  # another tenant: nothing reused
            assert await _cached(client, "key-bob-2", prompt) > 0  # bob's own pages now
            assert await _cached(client, "key-alice-1", prompt, salt="project-x") == 0  # a salt narrows further
        else:
            assert bob > 0
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt},
                              headers={"Authorization": "Bearer key-mallory"})
        assert r.status_code == 401


def test_the_key_file_holds_one_key_or_one_per_tenant(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("only-key\n")
    f.chmod(0o600)
    assert read_api_keys(f) == (ApiKey("key1", "only-key"),)
    f.write_text("# tenants\nalice key-a\n\nbob key-b  # the second\n")
    assert read_api_keys(f) == (ApiKey("alice", "key-a"), ApiKey("bob", "key-b"))
    for bad, why in (("a b c\n", "expected KEY or TENANT KEY"), ("a k\nb k\n", "given twice"), ("\n", "empty")):
        f.write_text(bad)
        with pytest.raises(ValueError, match=why):
            read_api_keys(f)
