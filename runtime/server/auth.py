"""Bearer-token checks for the API (``--api-key-file``) and admin (``--admin-token-file``) routes."""

from __future__ import annotations

import hmac
from pathlib import Path


def read_secret(path: str | Path | None) -> str | None:
    """The first line of a secret file (trailing whitespace dropped); None when no file is given."""
    if path is None:
        return None
    text = Path(path).read_text().strip()
    if not text:
        raise ValueError(f"secret file {path} is empty")
    return text.splitlines()[0].strip()


def bearer_ok(expected: str | None, authorization: str | None) -> bool:
    """Constant-time comparison; no configured secret means open access."""
    if expected is None:
        return True
    if not authorization or not authorization.startswith("Bearer "):
        return False
    return hmac.compare_digest(authorization[len("Bearer "):].strip().encode(), expected.encode())
