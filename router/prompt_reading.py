"""What the router reads from a request it places, the same way on both of its faces (the HTTP proxy,
``app.py``, and the ext_proc endpoint picker, ``extproc.py``): a completions or chat body's prompt as the
replica will tokenize it (``kvdrive.runtime.protocol``), its cache salt, and the caller's Bearer credential."""

from __future__ import annotations

import json

from pydantic import ValidationError

from kvdrive.runtime.prompt import Tokenizer, TokenizerError
from kvdrive.runtime.prompt.digests import tenant_salt
from kvdrive.runtime.protocol import request_schemas as r
from kvdrive.runtime.protocol.prompts import chat_prompt, completion_prompt

PROMPTED = {"completions": (r.CompletionRequest, completion_prompt),
            "chat/completions": (r.ChatCompletionRequest, chat_prompt)}


def prompt_tokens(path: str, body: bytes, tokenizer: Tokenizer | None,
                  tenant_key: str | None = None) -> tuple[list[int], str | None] | None:
    """The prompt's token ids exactly as a replica will compute them, and its cache salt (a salted prompt's
    pages are addressed apart): under ``--isolate-tenants`` derived from the caller's key, as the replica
    derives it (``tenant_salt``); None when it cannot be read."""
    kind = PROMPTED.get(path)
    if kind is None or tokenizer is None:
        return None
    model, build = kind
    try:
        parsed = model.model_validate(json.loads(body))
        salt = tenant_salt(tenant_key, parsed.cache_salt) if tenant_key is not None else parsed.cache_salt
        return build(parsed, tokenizer), salt  # type: ignore[operator]
    except (ValueError, ValidationError, TokenizerError):  # json.JSONDecodeError is a ValueError
        return None


def bearer(authorization: str | None) -> str | None:
    """The credential of a ``Bearer`` Authorization header (the replica checks it; the router only hashes)."""
    scheme, _, credential = (authorization or "").strip().partition(" ")
    return credential.strip() if scheme.lower() == "bearer" and credential.strip() else None
