"""The router finds an isolated tenant's pages where the replica stored them: under ``--isolate-tenants`` it
salts a prompt with its caller's key exactly as the replica does (``tenant_salt``), and without the flag it
uses the request's own ``cache_salt``."""

from __future__ import annotations

import json
from typing import Any, cast

from kvdrive.router.prompt_reading import prompt_tokens
from kvdrive.runtime.prompt import Tokenizer
from kvdrive.runtime.prompt.digests import tenant_salt

TOKENS = cast(Tokenizer, object())  # token-id prompts are read without it


def _body(**extra: Any) -> bytes:
    return json.dumps({"model": "demo", "prompt": [5, 6, 7], **extra}).encode()


def test_the_router_salts_a_prompt_as_the_replica_does() -> None:
    assert prompt_tokens("completions", _body(), TOKENS) == ([5, 6, 7], None)
    assert prompt_tokens("completions", _body(cache_salt="s"), TOKENS) == ([5, 6, 7], "s")
    isolated = prompt_tokens("completions", _body(), TOKENS, tenant_key="key-a")
    assert isolated == ([5, 6, 7], tenant_salt("key-a", None))
    narrowed = prompt_tokens("completions", _body(cache_salt="s"), TOKENS, tenant_key="key-a")
    assert narrowed == ([5, 6, 7], tenant_salt("key-a", "s"))
    assert tenant_salt("key-a", None) != tenant_salt("key-b", None)  # two keys, two tenants
