"""The engine's KV cache over the three tiers: sequences, their pages, prefix reuse, budgets, counters.

Each sequence is a list of *sealed* pages (full pages, content-addressed: digest = hash of the model
fingerprint and all tokens up to the page end) plus an open tail page being filled, kept per
sequence on the compute device. A sealed page is stored as one block per layer in the
``TieredKVStore`` (gpu -> dram -> ssd) and summarised (key min/max) for page selection. Sealed
pages are shared between sequences with identical token prefixes (reference counts; a block is
``needed`` while any running sequence references it) and written through to the SSD tier, whose
index survives restarts, so a prompt seen before is not recomputed.

The gpu budget covers the store's device tier plus the tails (one page per running sequence,
reserved up front). Scheduler-facing accounting is in logical pages (a page = all layers' blocks).
The per-step attention work (selection, fetch, prefetch) lives in ``tiered_backend``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil

import torch

from kvdrive.runtime.attention import PageSummaries, SelectionConfig
from kvdrive.runtime.engine.kv_state import (
    PREFETCH_MIN_PRECISION,
    PREFETCH_PROBE,
    PROMOTE_MARGIN,
    PROMOTE_MIN_GAIN,
    Admission,
    PageLostError,
    SeqKV,
    StepSeq,
    TierConfig,
    chain_digest,
)
from kvdrive.runtime.kvcache import (
    BlockKey,
    BudgetError,
    KVLayout,
    TierBudgets,
    TieredKVStore,
    TierName,
    TierUsage,
)
from kvdrive.runtime.kvcache.keys import DIGEST_BYTES
from kvdrive.runtime.pipeline.transfer import TransferEngine
from kvdrive.runtime.placement import Hotness, PlacementPolicy, PrefetchLedger, PrefetchThrottle, policy_for

log = logging.getLogger(__name__)

__all__ = ["PageLostError", "StepSeq", "TierConfig", "TieredKVCache"]


class TieredKVCache:
    def __init__(self, layout: KVLayout, config: TierConfig, device: torch.device, fingerprint: str) -> None:
        self.layout = layout
        self.config = config
        self.device = device
        self.policy: PlacementPolicy = policy_for(config.placement, config.full_attention)
        self.selection = SelectionConfig(token_budget=config.token_budget, page_size=layout.page_size)
        self.hotness = Hotness()
        # the device tier is worth promoting into only when it is faster memory than DRAM (CUDA); on a
        # CPU device both are host memory and only reads from the SSD tier are worth moving up
        self.promote_from = ("dram", "ssd") if device.type == "cuda" else ("ssd",)
        self.runners_up = 2 if self.policy.prefetch else 0  # pages beyond the budget prefetched per layer
        self.throttle = PrefetchThrottle(PREFETCH_MIN_PRECISION, PREFETCH_PROBE)
        self.ledger = PrefetchLedger()
        self.root = hashlib.blake2b(fingerprint.encode(), digest_size=DIGEST_BYTES).digest()
        self._sparse_salt = f"sparse:{config.token_budget}:{self.selection.sink_pages}:{self.selection.recent_pages}".encode()
        self.tail_reserve = config.max_sequences * layout.page_bytes
        self.store = TieredKVStore(
            layout, self._store_budgets(config.gpu_bytes, config.dram_bytes, config.ssd_bytes),
            ssd_dir=config.ssd_dir, device=device, hugetlbfs_dir=config.hugetlbfs_dir, ssd_codec=config.ssd_codec,
            victim_order=self.hotness.coldest_first if self.policy.hotness_eviction else None,
            io_threads=config.io_threads)
        self.transfers = TransferEngine(self.store, workers=2)
        self._seqs: dict[int, SeqKV] = {}
        self._refs: dict[bytes, int] = {}
        self._admission: dict[str, Admission] = {}  # tier -> this step's admission state
        self.fetch_wait_seconds = 0.0
        self.decode_steps = 0
        self.prefix_hit_pages = 0
        self.recomputed_pages = 0
        self.pages_lost = 0
        log.info("KV tiers: %s; placement %s, %s attention (token budget %d)",
                 ", ".join(f"{u.tier} {u.capacity_bytes >> 20} MiB ({u.backing})" for u in self.store.usage()),
                 self.policy.name, "sparse" if self.policy.sparse else "full", config.token_budget)

    def _store_budgets(self, gpu: int, dram: int, ssd: int) -> TierBudgets:
        store_gpu = gpu - self.tail_reserve
        if store_gpu < self.layout.page_bytes:
            raise BudgetError(
                f"gpu budget {gpu} bytes leaves no room for KV pages: {self.config.max_sequences} running "
                f"sequences reserve {self.tail_reserve} bytes for their open pages, and one page of all layers "
                f"is {self.layout.page_bytes} bytes (raise the budget or lower --max-running)")
        return TierBudgets(gpu_bytes=store_gpu, dram_bytes=dram, ssd_bytes=ssd)

    # --- scheduler-facing accounting (logical pages) ---------------------------------------------
    @property
    def num_pages(self) -> int:
        """Sealed pages all tiers can hold (the most one request may use)."""
        return self.store.capacity_blocks // self.layout.num_layers

    @property
    def free_pages(self) -> int:
        return max(0, self.num_pages - len(self._refs))

    def pages_needed(self, seq_id: int | None, n: int) -> int:
        s = self.layout.page_size
        start = 0 if seq_id is None else self._seqs[seq_id].length
        return (start + n) // s - start // s

    def length(self, seq_id: int) -> int:
        return self._seqs[seq_id].length

    def num_pages_of(self, seq_id: int) -> int:
        return len(self._seqs[seq_id].digests)

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    # --- sequences ---------------------------------------------------------------------------------
    def add_sequence(self, seq_id: int, prompt: list[int] | None = None) -> int:
        """Open a sequence; reuse stored pages of the longest stored prefix of ``prompt`` (at least one
        prompt token is left to compute). Returns the number of prompt tokens already in the cache."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already exists")
        if len(self._seqs) >= self.config.max_sequences:
            raise RuntimeError(f"{self.config.max_sequences} sequences already hold open pages")
        lay = self.layout
        shape = (lay.num_layers, lay.page_size, lay.num_kv_heads, lay.head_dim)
        seq = SeqKV(tail_k=torch.zeros(shape, dtype=lay.dtype, device=self.device),
                    tail_v=torch.zeros(shape, dtype=lay.dtype, device=self.device),
                    summaries=PageSummaries(lay.num_layers, lay.num_kv_heads, lay.head_dim, self.device),
                    selected=[None] * lay.num_layers, runners_up=[[] for _ in range(lay.num_layers)])
        self._seqs[seq_id] = seq
        matched = self._reuse_prefix(seq, prompt or [])
        self.prefix_hit_pages += matched
        return matched * lay.page_size

    def stored_prefix(self, prompt: list[int]) -> list[bytes]:
        """Digests of the longest run of ``prompt``'s leading pages stored in the tiers (all layers), leaving
        at least one token to compute. Reads nothing."""
        s, L = self.layout.page_size, self.layout.num_layers
        digests, prev = [], self.root
        for p in range((len(prompt) - 1) // s):
            prev = chain_digest(prev, prompt[p * s : (p + 1) * s])
            keys = [BlockKey(prev, layer) for layer in range(L)]
            if prev not in self._refs and any(t is None for t in self.store.where_many(keys)):
                break
            digests.append(prev)
        return digests

    def _reuse_prefix(self, seq: SeqKV, prompt: list[int]) -> int:
        s = self.layout.page_size
        digests = self.stored_prefix(prompt)
        if not digests:
            return 0
        for d in digests:  # reference first, so nothing we read can be evicted as unneeded
            self._ref(d)
        kept = self._load_prefix(seq, digests)
        for d in digests[kept:]:
            self._unref(d)
        digests = digests[:kept]
        if not digests:
            return 0
        seq.digests = list(digests)
        seq.tokens = list(prompt[: len(digests) * s])
        seq.length = len(seq.tokens)
        log.info("prefix reuse: %d of %d prompt tokens already stored", seq.length, len(prompt))
        return len(digests)

    def _load_prefix(self, seq: SeqKV, digests: list[bytes], chunk: int = 32) -> int:
        """Read the stored prefix pages once, page-major in chunks: summarise their keys and give them a
        device-tier copy, as a prefill of these tokens would have left them. Returns how many leading
        pages were readable (a corrupt or lost page ends the prefix there)."""
        lay = self.layout
        assert seq.summaries is not None
        for p0 in range(0, len(digests), chunk):
            part = digests[p0 : p0 + chunk]
            for layer in range(lay.num_layers):
                keys = [BlockKey(d, layer) for d in part]
                raw, served = self.store.fetch(keys)  # needed reads: counted per tier
                good = served.index(None) if None in served else len(part)
                if good:
                    kv = raw[:good].view(lay.dtype).view(good, 2, lay.page_size, lay.num_kv_heads, lay.head_dim)
                    seq.summaries.set(layer, p0, kv[:, 0])
                    self.store.admit(keys[:good], raw[:good], "gpu", served[:good])
                if good < len(part):
                    log.warning("stored prefix page %d unreadable; recomputing from there", p0 + good)
                    return p0 + good
        return len(digests)

    def _keys(self, digest: bytes) -> list[BlockKey]:
        return [BlockKey(digest, layer) for layer in range(self.layout.num_layers)]

    def _ref(self, d: bytes) -> None:
        n = self._refs.get(d, 0)
        self._refs[d] = n + 1
        if n == 0:
            self.store.set_needed(self._keys(d), True)

    def _unref(self, d: bytes) -> None:
        n = self._refs[d] - 1
        if n:
            self._refs[d] = n
            return
        del self._refs[d]
        keys = self._keys(d)
        self.store.set_needed(keys, False)  # stays cached (and persisted) until evicted
        self.hotness.forget(keys)

    def free(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id)
        for d in seq.digests:
            self._unref(d)

    def seq(self, seq_id: int) -> SeqKV:
        return self._seqs[seq_id]

    # --- steps -------------------------------------------------------------------------------------
    def begin(self, seq_id: int, tokens: list[int], decode: bool = False) -> StepSeq:
        """Reserve room for ``tokens`` appended to ``seq_id`` this step; digests of the pages they seal.
        Pages holding KV computed by sparse decode (selection active) are addressed apart from exact
        ones (salted digests): a full-attention run, or a prompt that repeats the text, never reuses them."""
        seq = self._seqs[seq_id]
        s = self.layout.page_size
        start = seq.length
        if decode and self.policy.sparse and start >= self.selection.budget_pages * s:
            seq.inexact = True
        salt = self._sparse_salt if seq.inexact else b""
        seq.tokens.extend(tokens)
        seq.length = start + len(tokens)
        new: list[bytes] = []
        prev = seq.digests[-1] if seq.digests else self.root
        for p in range(start // s, seq.length // s):
            prev = chain_digest(prev, seq.tokens[p * s : (p + 1) * s], salt)
            new.append(prev)
            self._ref(prev)
        seq.digests.extend(new)
        pos = torch.arange(start, seq.length, device=self.device)
        return StepSeq(seq_id, start, len(tokens), pos, decode, tuple(new))

    def update_floors(self) -> None:
        """This step's admission state per tier: its free slots and its residents' scores, coldest first.
        A tier admits freely while it has free slots; after that each admission displaces the coldest
        resident not yet displaced, and only a block hotter than that one (with hysteresis on the device
        tier) is admitted. A working set larger than the tier is then read in place instead of being
        swapped through it every step."""
        tiers: tuple[tuple[TierName, float, float], ...] = (("gpu", PROMOTE_MARGIN, PROMOTE_MIN_GAIN), ("dram", 1.0, 0.0))
        for tier, margin, gain in tiers:
            free = self.store.tiers[tier].allocator.free_count
            self._admission[tier] = Admission(free, lambda t=tier: self._coldest_scores(t), margin, gain)

    def _coldest_scores(self, tier: TierName) -> list[float]:
        """Hotness of the blocks resident in ``tier``, ascending (walks the tier: asked only once it is full)."""
        return sorted(self.hotness.scores(self.store.residents(tier)[0]))

    def target_tier(self, key: BlockKey, served: str) -> str | None:
        """Where a block read from ``served`` should get a copy under the kvdrive policy (None: stay)."""
        s = self.hotness.score(key)
        if served not in self.promote_from:
            return None
        gpu = self._admission.get("gpu")
        if gpu is not None and (served == "ssd" or self.device.type == "cuda") and gpu.admit(s):
            return "gpu"
        dram = self._admission.get("dram")
        if served == "ssd" and dram is not None and self.store.tiers["dram"].allocator.capacity and dram.admit(s):
            return "dram"
        return None

    def finish_step(self, sealed: list[BlockKey], decoded: list[int]) -> None:
        """After a forward step: write sealed blocks through to SSD, advance hotness, prefetch."""
        if sealed and self.config.persist and "ssd" in self.store.tiers:
            self.transfers.replicate(sealed, "ssd")
        if not decoded:
            return
        self.decode_steps += 1
        self.ledger.end_step()
        self.hotness.advance()
        if self.policy.prefetch and self.throttle.allow(self.ledger.counts(), self.decode_steps):
            self._prefetch(decoded)

    def _prefetch(self, decoded: list[int]) -> None:
        """Predicted blocks of the next step move up where admission allows, layer by layer."""
        for layer in range(self.layout.num_layers):
            keys: list[BlockKey] = []
            for seq_id in decoded:
                seq = self._seqs.get(seq_id)
                if seq is not None and seq.selected[layer]:
                    keys.extend(seq.selected[layer] or [])
                    keys.extend(seq.runners_up[layer])
            if not keys:
                continue
            where = self.store.where_many(keys)
            up: dict[str, list[BlockKey]] = {}
            for k, t in zip(keys, where, strict=True):
                if t in self.promote_from:
                    dst = self.target_tier(k, t)
                    if dst is not None and dst != t:
                        up.setdefault(dst, []).append(k)
            for dst, todo in up.items():
                self.ledger.issued(todo, self.transfers.promote(todo, dst))

    # --- tiers -------------------------------------------------------------------------------------
    def usage(self) -> list[TierUsage]:
        out = []
        tails = len(self._seqs) * self.layout.page_bytes
        for u in self.store.usage():
            if u.tier == "gpu":  # the gpu budget includes the reserved open pages
                u = TierUsage(u.tier, u.budget_bytes + self.tail_reserve, u.capacity_bytes + self.tail_reserve,
                              u.used_bytes + tails, u.pages, u.pinned_pages, u.backing, u.page_reads, u.errors,
                              u.cached_bytes)
            out.append(u)
        return out

    @property
    def capacity_bytes(self) -> int:
        return sum(u.capacity_bytes for u in self.usage())

    @property
    def used_bytes(self) -> int:
        """Bytes held for running sequences (open pages and needed blocks; cached pages excluded)."""
        return sum(u.used_bytes - u.cached_bytes for u in self.usage())

    def set_budgets(self, gpu_bytes: int, dram_bytes: int, ssd_bytes: int) -> None:
        """Apply new budgets live (BudgetError, nothing changed, when impossible)."""
        if "ssd" not in self.store.tiers and ssd_bytes:
            raise BudgetError("the server has no SSD tier (start it with --ssd-dir to use one)")
        for tier, want, limit in (("gpu", gpu_bytes, self._memory_limit(self.device)),
                                  ("dram", dram_bytes, self._memory_limit(torch.device("cpu"))),
                                  ("ssd", ssd_bytes, self._disk_limit())):
            if want > limit:
                raise BudgetError(f"{tier} budget {want} bytes exceeds the {limit} bytes this host has for it")
        b = self._store_budgets(gpu_bytes, dram_bytes, ssd_bytes)
        self.store.set_budgets(b.gpu_bytes, b.dram_bytes, b.ssd_bytes if "ssd" in self.store.tiers else None)

    @staticmethod
    def _memory_limit(device: torch.device) -> int:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[1])
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def _disk_limit(self) -> int:
        return shutil.disk_usage(self.config.ssd_dir).total if self.config.ssd_dir else 0

    def close(self) -> None:
        self.transfers.close()
        self.store.close()
