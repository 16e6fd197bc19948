"""Secrets of the API (``--api-key-file``) and admin (``--admin-token-file``) routes, read from files.

An API key file holds one key, or one per tenant: each line ``KEY`` or ``TENANT KEY`` (blank lines and ``#``
comments skipped). The tenant names only label logs; under ``--isolate-tenants`` a request's prefix pages are
keyed by a salt derived from its key (``prompt/digests.py:tenant_salt``). A replica (``kvdrive serve``) and the
router (``kvdrive route``, which calls the replicas with its first key) read the same file; the checks
themselves are the server's gate's (``kvdrive.runtime.server.gate``)."""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ApiKey:
    tenant: str
    key: str


def read_api_keys(path: str | Path | None) -> tuple[ApiKey, ...]:
    """The keys of an API key file (module docstring); () when no file is given. Raises ValueError on an
    empty file, a malformed line or a key given twice."""
    if path is None:
        return ()
    read_secret(path)  # the permission warning, and an empty file refused
    keys: list[ApiKey] = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 2:
            raise ValueError(f"{path}:{n}: expected KEY or TENANT KEY, got {len(words)} words")
        tenant, key = (words[0], words[1]) if len(words) == 2 else (f"key{len(keys) + 1}", words[0])
        if any(k.key == key for k in keys):
            raise ValueError(f"{path}:{n}: this key is given twice")
        keys.append(ApiKey(tenant, key))
    return tuple(keys)


def read_secret(path: str | Path | None) -> str | None:
    """The first line of a secret file (trailing whitespace dropped); None when no file is given. A file
    that group or others may read is used, with a warning that says how to fix it."""
    if path is None:
        return None
    st = Path(path).stat()
    problem = secret_mode_problem(st.st_mode, st.st_uid, st.st_gid, os.geteuid(), (os.getegid(), *os.getgroups()))
    if problem:
        log.warning("secret file %s %s", path, problem)
    text = Path(path).read_text().strip()
    if not text:
        raise ValueError(f"secret file {path} is empty")
    return text.splitlines()[0].strip()


def secret_mode_problem(mode: int, uid: int, gid: int, euid: int, groups: tuple[int, ...]) -> str | None:
    """What is wrong with a secret file's permissions, or None. Group access is fine when it is the
    only way this process reads the file: another user's file in one of our groups, as a Kubernetes
    Secret volume with fsGroup is (root, the pod's group, mode 0440)."""
    bits = stat.S_IMODE(mode)
    others = mode & stat.S_IRWXO
    through_group = uid != euid and gid in groups
    if others or (mode & stat.S_IRWXG and not through_group):
        return f"is readable by group or others (mode {bits:o}): chmod 600 it"
    return None
