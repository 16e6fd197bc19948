"""The KV cache's configuration (tier budgets nested in the engine's) and the device envelope's split: plain data."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
SCHEMES = {"valkey": False, "redis": False, "valkeys": True, "rediss": True}  # scheme -> TLS


@dataclass(frozen=True)
class SharedTierConfig:
    """Where the shared tier is (a Valkey / Redis node or cluster every replica reaches) and how to talk to it."""

    endpoints: tuple[tuple[str, int], ...]  # (host, port): one node, or seeds of a cluster
    namespace: str = "default"  # keys are kvd:<namespace>:<page digest hex>
    tls: bool = False
    user: str | None = None
    password: str | None = None
    ca_file: str | None = None
    timeout_s: float = 0.5  # time budget of one round trip to a shard (a fetch, a publish)
    stage_bytes: int = 512 << 20  # the most fetched bytes one request's prefix load holds before landing

    @classmethod
    def parse(cls, url: str, namespace: str = "default", user: str | None = None, password: str | None = None,
              ca_file: str | None = None, timeout_ms: int = 500) -> SharedTierConfig:
        """From ``valkey://HOST:PORT[,HOST:PORT...]`` (``valkeys://`` for TLS; ``redis://``, ``rediss://`` too).
        ValueError naming what is wrong."""
        scheme, sep, rest = url.partition("://")
        if not sep or scheme not in SCHEMES:
            raise ValueError(f"shared tier {url!r}: expected valkey://HOST:PORT[,HOST:PORT...] "
                             f"(schemes: {', '.join(SCHEMES)})")
        endpoints = []
        for part in rest.rstrip("/").split(","):
            host, colon, port = part.strip().rpartition(":")
            host = host.strip("[]")
            if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"shared tier {url!r}: endpoint {part!r} is not HOST:PORT")
            endpoints.append((host, int(port)))
        if not NAMESPACE.fullmatch(namespace):
            raise ValueError(f"shared tier namespace {namespace!r}: 1-63 letters, digits, '.', '_' or '-', "
                             "starting with a letter or digit")
        if not 10 <= timeout_ms <= 10_000:
            raise ValueError(f"shared tier timeout {timeout_ms} ms: expected 10..10000")
        tls = SCHEMES[scheme]
        if ca_file is not None and not tls:
            raise ValueError("a shared tier CA file needs TLS: use valkeys:// (or rediss://)")
        return cls(tuple(endpoints), namespace, tls, user, password, ca_file, timeout_ms / 1000)

    def describe(self) -> str:
        """The endpoints as the user gave them, without secrets."""
        hosts = ",".join(f"{h}:{p}" for h, p in self.endpoints)
        return f"{'valkeys' if self.tls else 'valkey'}://{hosts} (namespace {self.namespace})"


@dataclass(frozen=True)
class TierConfig:
    """Byte budgets and backings of the three tiers."""

    envelope_bytes: int | None = None  # the device envelope: hot KV tier + running sequences' reserve (open
    # pages, decode step buffers); None: one full-context sequence. The CLI, HTTP API and CRD call it the gpu budget
    dram_bytes: int = 0
    ssd_bytes: int = 0
    ssd_dir: str | None = None
    hugetlbfs_dir: str | None = None
    ssd_codec: str = "none"  # none | int8
    ssd_backend: str = "posix"  # posix | kvikio (asked for explicitly: see kvikio_backend)
    persist: bool = True  # write sealed pages through to the SSD tier (prefix reuse across restarts)
    io_threads: int = 4
    shared: SharedTierConfig | None = None  # the fleet's shared tier (Valkey / Redis), when given


@dataclass(frozen=True)
class EngineConfig:
    tiers: TierConfig = field(default_factory=TierConfig)
    placement: str = "kvdrive"  # kvdrive | lru | ondemand | fullfetch
    full_attention: bool = False
    token_budget: int = 1024  # tokens each decode query attends to (selected pages + the open one)
    selection_radius: float = 1.0  # the box radius' weight in a page's selection score (SelectionConfig)
    selection_carry: str = "layer"  # layer | shared | shared+neighbours: the previous step's mass a page carries
    selection_sketch: int = 8  # 0, 4 or 8: bits of the per-key sketch that scores pages (0: the box bound)
    # auto | drop | means | sketch: the pages a decode step leaves out (SelectionConfig.rest); auto: sketch, or
    # drop without a key sketch (selection_sketch 0)
    selection_rest: str = "auto"
    page_size: int = 16
    kv_dtype: torch.dtype | None = None  # None: the model's dtype
    max_sequences: int = 16  # the most sequences that may ever run at once (rows and open pages reserved)
    max_running: int | None = None  # sequences that may run at once to start with (live; None: max_sequences)
    prefill_chunk: int = 512  # tokens per prefill forward in ``ModelRunner.prefill`` (bounds activation memory)
    window_checkpoint: int = 2048  # hybrid models: a long prompt keeps its window every this many tokens (0: off)

    @property
    def start_running(self) -> int:
        """The sequences that may run at once to start with."""
        return self.max_running if self.max_running is not None else self.max_sequences


@dataclass(frozen=True)
class EnvelopeSplit:
    """How the device envelope (the gpu budget) is split now: the hot KV tier, and the reserve for running
    sequences: a fixed part (the open pages, and a hybrid model's windows, of every row) and
    ``per_sequence_bytes`` (one decode step buffer) for each of the ``max_running`` sequences."""

    envelope_bytes: int
    hot_bytes: int
    fixed_reserve_bytes: int
    per_sequence_bytes: int
    max_running: int
    max_sequences: int
    pending_max_running: int | None = None  # a smaller limit waiting for running sequences to finish

    @property
    def reserve_bytes(self) -> int:
        return self.fixed_reserve_bytes + self.max_running * self.per_sequence_bytes
