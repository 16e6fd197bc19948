"""The connection to the shared tier's Valkey / Redis deployment: one node or a cluster, each key sent to its shard.

A key goes to the primary that owns its hash slot (``CLUSTER SLOTS``, refreshed when a shard answers MOVED or
a new shard appears); a deployment without cluster mode is one shard. Each shard has its own client (the
maintained ``valkey`` package: RESP, TLS, ACL auth, connection pools) with a short socket timeout and no
retries, and its own ``Breaker``: a shard that fails is skipped, and only its keys are misses. The cluster
client of the same package is not used because its recovery (topology refreshes and retries on a dead node)
blocks the caller for seconds; here a dead shard costs one timeout, then nothing until its probe.

Batches run one pipeline per shard, the shards in parallel. Results are per key: bytes, None (absent), or the
error that hit its shard (``ShardError``). Nothing here knows what a value means (``tier``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import valkey
from valkey.backoff import NoBackoff
from valkey.crc import key_slot
from valkey.retry import Retry

from kvdrive.runtime.kvcache.config import SharedTierConfig
from kvdrive.runtime.kvcache.store.shared.breaker import Breaker

log = logging.getLogger(__name__)

SLOTS = 16384
Endpoint = tuple[str, int]


@dataclass(frozen=True)
class ShardError:
    """Why a key's shard could not answer: ``kind`` is timeout | connection | refused (breaker open) | error."""

    kind: str
    detail: str


Result = bytes | None | ShardError


class Shards:
    def __init__(self, config: SharedTierConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._clients: dict[Endpoint, valkey.Valkey] = {}
        self._breakers: dict[Endpoint, Breaker] = {}  # every endpoint a client was made for
        self._slots: list[Endpoint] | None = None  # slot -> owning primary; None: not a cluster
        self._single: Endpoint | None = None
        self._owners: list[Endpoint] = []  # the shards: the cluster's primaries, or the single node
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(config.endpoints)),
                                        thread_name_prefix="kvdrive-shared")
        self.mode = "unknown"  # cluster | single | unknown (no endpoint answered yet)
        self.discover()

    # --- topology ------------------------------------------------------------------------------------
    def client(self, ep: Endpoint) -> valkey.Valkey:
        with self._lock:
            c = self._clients.get(ep)
            if c is None:
                cfg = self.config
                kw: dict[str, Any] = {}
                if cfg.tls:
                    kw = {"ssl": True, "ssl_ca_certs": cfg.ca_file, "ssl_cert_reqs": "required"}
                c = self._clients[ep] = valkey.Valkey(
                    host=ep[0], port=ep[1], username=cfg.user, password=cfg.password,
                    socket_timeout=cfg.timeout_s, socket_connect_timeout=cfg.timeout_s,
                    retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0, **kw)
                self._breakers.setdefault(ep, Breaker())
            return c

    def breaker(self, ep: Endpoint) -> Breaker:
        self.client(ep)  # made with its client
        with self._lock:
            return self._breakers[ep]

    def breakers(self) -> list[tuple[Endpoint, Breaker]]:
        """Every endpoint's breaker, now (a copy: shards may appear meanwhile)."""
        with self._lock:
            return list(self._breakers.items())

    def failing(self) -> list[tuple[Endpoint, Breaker]]:
        """The shards whose breaker is open now."""
        return [(ep, br) for ep, br in self.breakers() if br.is_open]

    def discover(self) -> bool:
        """Learn the deployment's shape from the first endpoint that answers; False when none did (the tier
        then counts as degraded and tries again on its next probe)."""
        for ep in self._seeds():
            try:
                slots = self.client(ep).execute_command("CLUSTER", "SLOTS")
            except valkey.ResponseError as exc:
                if "cluster" in str(exc).lower():  # cluster support disabled: one node
                    with self._lock:
                        self._slots, self._single, self._owners, self.mode = None, ep, [ep], "single"
                    log.info("shared tier: %s is a single node", f"{ep[0]}:{ep[1]}")
                    return True
                log.warning("shared tier: %s:%d answered CLUSTER SLOTS with %s", ep[0], ep[1], exc)
                continue
            except valkey.ValkeyError as exc:
                log.warning("shared tier: %s:%d unreachable (%s)", ep[0], ep[1], exc)
                continue
            table: list[Endpoint] = [ep] * SLOTS
            owners: dict[Endpoint, None] = {}
            for entry in slots:
                start, end, primary = int(entry[0]), int(entry[1]), entry[2]
                host = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
                owner = (host or ep[0], int(primary[1]))
                owners[owner] = None
                table[start : end + 1] = [owner] * (end - start + 1)
            for owner in owners:
                self.client(owner)
            with self._lock:
                self._slots, self._single, self._owners, self.mode = table, None, list(owners), "cluster"
            log.info("shared tier: a cluster of %d shards", len(owners))
            return True
        self.mode = "unknown"
        return False

    def _seeds(self) -> list[Endpoint]:
        known = [ep for ep, _ in self.breakers()] if self.mode == "cluster" else []
        return list(dict.fromkeys(list(self.config.endpoints) + known))

    def shard_of(self, key: bytes) -> Endpoint | None:
        with self._lock:
            if self._slots is not None:
                return self._slots[key_slot(key)]
            return self._single

    @property
    def shards(self) -> list[Endpoint]:
        with self._lock:
            return list(self._owners)

    # --- batches ---------------------------------------------------------------------------------------
    def get(self, keys: Sequence[bytes]) -> list[Result]:
        """Each key's value, None where absent, a ShardError where its shard failed."""
        return self._run(keys, lambda pipe, k: pipe.get(k), [None] * len(keys))

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> list[Result]:
        """Store values (no expiry: the store's own eviction policy drops them). Per distinct key, in order:
        b"True" or a ShardError."""
        values = dict(items)
        return self._run(list(values), lambda pipe, k: pipe.set(k, values[k]), [None] * len(values))

    def delete(self, keys: Sequence[bytes]) -> list[Result]:
        return self._run(keys, lambda pipe, k: pipe.delete(k), [None] * len(keys))

    def ping(self, ep: Endpoint) -> bool:
        """A probe of one shard (its breaker's half-open call): True when it answered."""
        br = self.breaker(ep)
        try:
            self.client(ep).ping()
        except valkey.ValkeyError as exc:
            br.failure(f"{type(exc).__name__}: {exc}")
            return False
        br.success()
        return True

    def _run(self, keys: Sequence[bytes], op: Any, out: list[Result]) -> list[Result]:
        if self.mode == "unknown" and not self.discover():
            return [ShardError("connection", "no endpoint of the shared tier answered")] * len(keys)
        groups: dict[Endpoint, list[int]] = {}
        for i, k in enumerate(keys):
            ep = self.shard_of(k)
            if ep is None:
                out[i] = ShardError("connection", "no shard owns this key")
                continue
            groups.setdefault(ep, []).append(i)
        futures = {ep: self._pool.submit(self._shard_batch, ep, [keys[i] for i in idx], op)
                   for ep, idx in groups.items()}
        moved = False
        for ep, fut in futures.items():
            res, ep_moved = fut.result()
            moved |= ep_moved
            for i, r in zip(groups[ep], res, strict=True):
                out[i] = r
        if moved:
            self.discover()
        return out

    def _shard_batch(self, ep: Endpoint, keys: list[bytes], op: Any) -> tuple[list[Result], bool]:
        br = self.breaker(ep)
        if not br.allow():
            return [ShardError("refused", f"{ep[0]}:{ep[1]} is failing ({br.last_error})")] * len(keys), False
        try:
            pipe = self.client(ep).pipeline(transaction=False)
            for k in keys:
                op(pipe, k)
            replies = pipe.execute(raise_on_error=False)
        except valkey.TimeoutError as exc:
            br.failure(f"timeout: {exc}")
            return [ShardError("timeout", f"{ep[0]}:{ep[1]}: {exc}")] * len(keys), False
        except valkey.ValkeyError as exc:
            br.failure(f"{type(exc).__name__}: {exc}")
            return [ShardError("connection", f"{ep[0]}:{ep[1]}: {exc}")] * len(keys), False
        except OSError as exc:
            br.failure(f"{type(exc).__name__}: {exc}")
            return [ShardError("connection", f"{ep[0]}:{ep[1]}: {exc}")] * len(keys), False
        br.success()
        out: list[Result] = []
        moved = False
        for r in replies:
            if isinstance(r, Exception):
                moved |= str(r).startswith(("MOVED", "ASK"))
                out.append(ShardError("error", str(r)))
            else:
                out.append(r if isinstance(r, bytes) or r is None else str(r).encode())
        return out, moved

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()
