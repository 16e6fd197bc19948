"""Secrets of the API (``--api-key-file``) and admin (``--admin-token-file``) routes, read from files.

The checks themselves are the gate's (``gate.py``)."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

log = logging.getLogger(__name__)


def read_secret(path: str | Path | None) -> str | None:
    """The first line of a secret file (trailing whitespace dropped); None when no file is given. A file
    that group or others may read is used, with a warning that says how to fix it."""
    if path is None:
        return None
    mode = Path(path).stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("secret file %s is readable by group or others (mode %o): chmod 600 it", path,
                    stat.S_IMODE(mode))
    text = Path(path).read_text().strip()
    if not text:
        raise ValueError(f"secret file {path} is empty")
    return text.splitlines()[0].strip()
