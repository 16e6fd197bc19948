"""Content addresses of a prompt's pages: a chain hash of the model fingerprint and every token up to each
page end, so equal prefixes map to equal digests across requests, replicas and restarts.

The runtime names its stored pages by them (``kvcache.store.keys.BlockKey``); the router computes them for a
prompt it has not sent anywhere yet, from the root a replica reports, and looks them up in its index of
what each replica holds.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

DIGEST_BYTES = 16


def root_digest(fingerprint: str) -> bytes:
    """The chain's start: the digest of the model fingerprint (model, KV dtype, page size, layout)."""
    return hashlib.blake2b(fingerprint.encode(), digest_size=DIGEST_BYTES).digest()


def salted_root(root: bytes, salt: str | None) -> bytes:
    """The chain's start of a request with a ``cache_salt``: none of its pages shares a digest with a page of
    another salt or of no salt, so tenants with different salts never reuse (or time) each other's pages."""
    if not salt:
        return root
    return hashlib.blake2b(root + b"cache_salt:" + salt.encode(), digest_size=DIGEST_BYTES).digest()


def tenant_salt(api_key: str, cache_salt: str | None) -> str:
    """The cache salt of a request under ``--isolate-tenants``: derived from its API key (a secret, so no other
    tenant can compute it, even knowing this function), then narrowed by the request's own ``cache_salt``."""
    tenant = hashlib.blake2b(b"kvdrive-tenant:" + api_key.encode(), digest_size=DIGEST_BYTES).hexdigest()
    return tenant if not cache_salt else f"{tenant}/{cache_salt}"


def chain_digest(prev: bytes, tokens: Sequence[int], salt: bytes = b"") -> bytes:
    """A page's digest: the previous page's digest (or the root), a salt (how the KV was computed) and the
    page's tokens as native int64."""
    return hashlib.blake2b(prev + salt + array("q", tokens).tobytes(), digest_size=DIGEST_BYTES).digest()


def page_digests(root: bytes, tokens: Sequence[int], page_size: int) -> list[bytes]:
    """The digest of each full page of ``tokens`` (exactly computed KV: no salt), in order."""
    out, prev = [], root
    for p in range(len(tokens) // page_size):
        prev = chain_digest(prev, tokens[p * page_size : (p + 1) * page_size])
        out.append(prev)
    return out
