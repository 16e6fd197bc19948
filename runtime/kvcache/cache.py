"""The engine's KV cache over the three tiers: sequences, their page tables, budgets.

Each sequence is a list of *sealed* pages (full pages, content-addressed: digest = hash of the model
fingerprint and all tokens up to the page end) plus an open page being filled. A sealed page is stored
as one block per layer in the ``BlockStore`` (gpu -> dram -> ssd) and summarised (key min/max) for
page selection. Sealed pages are shared between sequences with identical token prefixes (reference
counts; a block is ``needed`` while any running sequence references it) and written through to the SSD
tier, whose index survives restarts, so a prompt seen before is not recomputed: the page references and
prefix reuse are ``PrefixPages`` (``prefix.py``).

Hot-path state is tensors indexed by the sequence's *row*: its page ids (``page_table [rows, Pcap]``), its
summaries (``SummaryTable``) and its open page, which lives in the device pool's tail rows (one per row
and layer) so that one gather reads it with the selected pages. The gpu budget covers the store's
device tier plus those tail rows (reserved up front). Every tier decision belongs to the ``Placer``;
the per-step attention work lives in ``backend``.
"""

from __future__ import annotations

import heapq
import logging
from pathlib import Path

import torch

from kvdrive.runtime.attention import (
    NEIGHBOUR_SHARE,
    SELECTION_CARRIES,
    SELECTION_RESTS,
    SelectionConfig,
    SummaryTable,
    resolve_rest,
)
from kvdrive.runtime.kvcache.backend import TieredAttentionBackend
from kvdrive.runtime.kvcache.config import EngineConfig, EnvelopeSplit
from kvdrive.runtime.kvcache.counters import CacheCounters
from kvdrive.runtime.kvcache.envelope import Envelope, step_columns
from kvdrive.runtime.kvcache.live_budgets import LiveBudgets, store_budgets
from kvdrive.runtime.kvcache.mover import Mover, TransferQueue
from kvdrive.runtime.kvcache.mover.shared import SharedMoves
from kvdrive.runtime.kvcache.mover.transfer import Priority
from kvdrive.runtime.kvcache.placement import PlacementPolicy, Placer, policy_for
from kvdrive.runtime.kvcache.prefix import PrefixPages
from kvdrive.runtime.kvcache.promotions import PromotionQueue
from kvdrive.runtime.kvcache.sequence import PageLostError, SeqKV, StepSeq
from kvdrive.runtime.kvcache.shared_prefix import PrefixWarmup, SharedPrefix
from kvdrive.runtime.kvcache.step_reads import ReadCounters, StepReadParts
from kvdrive.runtime.kvcache.store import (
    BlockIndex,
    BlockKey,
    BlockStore,
    KVLayout,
    TierUsage,
    build_tiers,
    device_tier,
)
from kvdrive.runtime.kvcache.store.page_events import PageEvents
from kvdrive.runtime.kvcache.store.shared import PageFormat, SharedTier, cache_identity
from kvdrive.runtime.kvcache.store.tiers.window_files import WindowFiles
from kvdrive.runtime.kvcache.windows.ring import SlidingWindows
from kvdrive.runtime.kvcache.windows.snapshots import WindowKeeper, WindowSnapshots
from kvdrive.runtime.prompt.digests import chain_digest, root_digest, salted_root

log = logging.getLogger(__name__)

__all__ = ["PageLostError", "StepSeq", "KVCache"]

SNAPSHOT_SSD_SHARE = 8  # sliding-window snapshots may take 1/8 of the SSD budget on its disk ...
SNAPSHOT_MIN_DISK_BYTES = 1 << 30  # ... and at least 1 GiB (a Gemma 3 270M window is 15 MiB at fp32)
SNAPSHOT_MEMORY_BYTES = 256 << 20  # in host memory when there is no SSD tier


class KVCache:
    def __init__(self, layout: KVLayout, config: EngineConfig, device: torch.device, fingerprint: str,
                 windows: SlidingWindows | None = None, global_layers: tuple[int, ...] | None = None) -> None:
        self.layout = layout
        self.windows = windows  # the sliding-window layers' rings (hybrid models), outside the tiers
        # model layer -> the tiers' layer (its index among the global layers)
        self.kv_layer = {m: i for i, m in enumerate(global_layers if global_layers is not None
                                                     else range(layout.num_layers))}
        self.config = config
        self.device = device
        tiers = config.tiers
        self.policy: PlacementPolicy = policy_for(config.placement, config.full_attention)
        carry = config.selection_carry
        if carry not in SELECTION_CARRIES:
            raise ValueError(f"selection_carry {carry!r}: expected one of {', '.join(SELECTION_CARRIES)}")
        rest = resolve_rest(config.selection_rest, config.selection_sketch)
        if rest not in SELECTION_RESTS:
            raise ValueError(f"selection_rest {rest!r}: expected auto or one of {', '.join(SELECTION_RESTS)}")
        if rest != "drop" and not config.selection_sketch:
            raise ValueError(f"selection_rest {rest!r} weighs the pages left out by the key sketch: it needs "
                             "selection_sketch 4 or 8, not 0")
        self.selection = SelectionConfig(token_budget=config.token_budget, page_size=layout.page_size,
                                         radius_scale=config.selection_radius, shared_carry=carry != "layer",
                                         neighbour_carry=NEIGHBOUR_SHARE if carry.endswith("+neighbours") else 0.0,
                                         sketch_bits=config.selection_sketch,
                                         rest=rest)
        self.root = root_digest(fingerprint)
        sel = self.selection  # pages written after a sparse decode depend on everything that picks the pages
        rule = ("" if sel.radius_scale == 1.0 else f":r{sel.radius_scale:g}") + \
            ("" if carry == "layer" else f":{carry}") + \
            (f":k{sel.sketch_bits}" if sel.sketch_bits else "") + \
            ("" if sel.rest == "drop" else f":rest-{sel.rest}")  # (the defaults add nothing: the keys stored before them)
        self._sparse_salt = f"sparse:{config.token_budget}:{sel.sink_pages}:{sel.recent_pages}{rule}".encode()
        # each running sequence's open page (all global layers) and, for a hybrid model, its sliding window
        self.seq_reserve = layout.page_bytes + (windows.bytes_per_sequence() if windows is not None else 0)
        self.tail_reserve = config.max_sequences * self.seq_reserve
        self.envelope = Envelope(self.tail_reserve, step_columns(config), layout.block_bytes, config.max_sequences,
                                 config.start_running, device)
        gpu = tiers.envelope_bytes if tiers.envelope_bytes is not None else self.envelope.reserve() + layout.page_bytes
        self.envelope.envelope_bytes = gpu
        budgets = store_budgets(self.envelope, gpu, tiers.dram_bytes, tiers.ssd_bytes)
        tier_map = build_tiers(layout, budgets, ssd_dir=tiers.ssd_dir, device=device,
                               hugetlbfs_dir=tiers.hugetlbfs_dir, ssd_codec=tiers.ssd_codec,
                               ssd_backend=tiers.ssd_backend, io_threads=tiers.io_threads,
                               device_extra_rows=config.max_sequences * layout.num_layers)
        index = BlockIndex(layout.num_layers, device_tier(tier_map).device)
        self.placer = Placer(self.policy, index, tier_map)  # every tier choice ...
        self.store = BlockStore(layout, budgets, tier_map, self.placer.eviction, index)  # ... applied here
        self.mover = Mover(self.store)  # the only caller of the tiers' I/O
        self.placer.begin_step(self.store.drain_freed())  # its scores cover the page ids the SSD index recovered
        # a hybrid model's prefix reuse restores the sliding layers' window from snapshots (``windows.snapshots``)
        self.snapshots = WindowSnapshots(
            WindowFiles(Path(tiers.ssd_dir) / "windows" if tiers.ssd_dir else None, writable=tiers.persist),
            self.mover, self.placer.eviction.window_victims,
            max(SNAPSHOT_MIN_DISK_BYTES, tiers.ssd_bytes // SNAPSHOT_SSD_SHARE) if tiers.ssd_dir
            else SNAPSHOT_MEMORY_BYTES) if windows is not None else None
        self.keeper = WindowKeeper(windows, self.snapshots, layout.page_size, config.window_checkpoint) \
            if windows is not None and self.snapshots is not None else None
        self._stepping: list[SeqKV] = []  # sequences begun and not yet settled by finish_step
        self.promotions = PromotionQueue(self.placer, self.mover)  # copies the step's lower-tier reads earn
        self.transfers = TransferQueue(self.mover, workers=1)
        self.budgets = LiveBudgets(self.envelope, self.store, self.mover, self.transfers, tiers.ssd_dir,
                                   lambda: len(self._seqs) * (self.seq_reserve + self.envelope.per_sequence_bytes))
        self.summaries = SummaryTable(layout.num_layers, layout.num_kv_heads, layout.head_dim, device,
                                      page_size=layout.page_size,
                                      sketch_bits=sel.sketch_bits if self.policy.sparse else 0,
                                      rest=sel.rest if self.policy.sparse else "drop")
        self.prefix = PrefixPages(layout, self.store, self.mover, self.placer, self.summaries, self.keeper)
        self.read_counters = ReadCounters()
        self._reads = StepReadParts(self.store, self.mover, self.placer.ledger, self.promotions, self.read_counters)
        self.page_table = self._table(1, self.summaries.pages)
        self._seqs: dict[int, SeqKV] = {}
        self._rows = list(range(config.max_sequences))  # free rows, lowest first
        self.page_events: PageEvents | None = None  # KV events on: sealed pages are described to it
        self.decode_steps = 0
        # the fleet's shared tier (Valkey / Redis), with its own transfer queue: network round trips never
        # queue behind local write-backs
        self.shared_tier: SharedTier | None = None
        self.shared: SharedPrefix | None = None
        self._exact_pages: set[bytes] = set()  # pages begun by exact (not sparse) KV since the last finish_step
        if tiers.shared is not None:
            self.shared_tier = SharedTier(tiers.shared, PageFormat(cache_identity(fingerprint), layout.num_layers,
                                                                   layout.block_bytes))
            self.shared_queue = TransferQueue(self.mover, workers=2)
            self.shared = SharedPrefix(layout, self.store, SharedMoves(self.mover, self.shared_tier, layout.num_layers),
                                       self.placer, self.shared_queue, tiers.shared.stage_bytes)
        log.info("KV tiers: %s; placement %s, %s attention (token budget %d)",
                 ", ".join(f"{u.tier} {u.capacity_bytes >> 20} MiB ({u.backing})" for u in self.store.usage()),
                 self.policy.name, "sparse" if self.policy.sparse else "full", config.token_budget)
        if self.summaries.sketch_bits:
            box, sketch = self.summaries.bytes_per_token()
            rest = {"drop": "dropped", "means": "attended as their mean values",
                    "sketch": "attended from an 8-bit value sketch"}[self.summaries.rest]
            log.info("selection: pages scored by a %d-bit key sketch, the pages left out %s; %d bytes a token on "
                     "the %s beside the summaries' %d, outside the tier budgets", self.summaries.sketch_bits, rest,
                     sketch, device, box)

    def watch_pages(self, events: PageEvents) -> None:
        """Turn KV events on: ``events`` hears of every page a tier gains or loses, with its tokens."""
        self.page_events = events
        self.store.watch_pages(events)
        if self.shared_tier is not None:
            self.shared_tier.watch(events)

    def _table(self, rows: int, pages: int) -> torch.Tensor:
        with torch.inference_mode(False):
            return torch.zeros((rows, pages), dtype=torch.int64, device=self.device)

    # --- scheduler-facing accounting (logical pages) ---------------------------------------------
    @property
    def num_pages(self) -> int:
        """Sealed pages all tiers can hold (the most one request may use)."""
        return self.store.capacity_blocks // self.layout.num_layers

    @property
    def device_pages(self) -> int:
        """Sealed pages the device tier holds now."""
        gpu = self.store.tiers.get("gpu")
        return gpu.allocator.capacity // self.layout.num_layers if gpu is not None else 0

    @property
    def memory_pages(self) -> int:
        """Sealed pages the memory tiers (device and DRAM) hold."""
        tiers = self.store.tiers
        return sum(tiers[t].allocator.capacity for t in ("gpu", "dram") if t in tiers) // self.layout.num_layers

    @property
    def free_pages(self) -> int:
        """Pages the scheduler may still promise: counted over the tiers that can take new blocks now, so
        that while the SSD tier fails (EIO, a full disk) requests run as the memory tiers allow and the
        others wait, instead of being admitted into pages no tier can take."""
        healthy = self.store.healthy_capacity_blocks // self.layout.num_layers
        return max(0, healthy - self.prefix.referenced)

    def pages_needed(self, seq_id: int | None, n: int) -> int:
        s = self.layout.page_size
        start = 0 if seq_id is None else self._seqs[seq_id].length
        return (start + n) // s - start // s

    def length(self, seq_id: int) -> int:
        return self._seqs[seq_id].length

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def seq(self, seq_id: int) -> SeqKV:
        return self._seqs[seq_id]

    @property
    def tail_base(self) -> int:
        """The device pool row of row 0's open page in layer 0 (row r, layer l: + r * L + l)."""
        return self.store.device_tier.extra_base

    # --- sequences ---------------------------------------------------------------------------------
    def add_sequence(self, seq_id: int, prompt: list[int] | None = None, load: bool = True,
                     salt: str | None = None) -> int:
        """Open a sequence on the longest stored prefix of ``prompt`` (at least one prompt token is left to
        compute). Returns the number of prompt tokens already in the cache. ``load``: read those pages now;
        otherwise they are only looked up and referenced (no tier I/O: the scheduler's call), and
        ``load_prefix`` reads them before the sequence's first forward step. ``salt``: the request's
        cache_salt; its pages are addressed apart (``salted_root``): shared only with the same salt."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already exists")
        if not self._rows:
            raise RuntimeError(f"{self.config.max_sequences} sequences already hold open pages")
        seq = SeqKV(row=heapq.heappop(self._rows), root=salted_root(self.root, salt))
        self._seqs[seq_id] = seq
        matched = self._match_prefix(seq, prompt or [])
        self.placer.hold(seq.pids)  # every chunk of the prompt attends to them: kept up until it is in
        if load and not self.load_prefix(seq_id):
            return seq.length
        return matched * self.layout.page_size

    def stored_prefix(self, prompt: list[int], salt: str | None = None) -> list[bytes]:
        """Digests of the longest run of ``prompt``'s leading pages stored in the tiers (reads nothing)."""
        return self.prefix.stored_prefix(prompt, salted_root(self.root, salt))

    def _match_prefix(self, seq: SeqKV, prompt: list[int]) -> int:
        """Reference the stored prefix pages of ``prompt`` for ``seq`` (reads nothing); returns how many."""
        digests = self.prefix.stored_prefix(prompt, seq.root)
        if not digests:
            return 0
        pids = [self.prefix.ref(d) for d in digests]  # referenced first: nothing we read can be evicted as unneeded
        self._grow(seq.row + 1, len(digests))
        seq.digests, seq.pids = list(digests), pids
        self.page_table[seq.row, : len(pids)] = torch.tensor(pids, dtype=torch.int64, device=self.device)
        seq.tokens = list(prompt[: len(digests) * self.layout.page_size])
        seq.length = len(seq.tokens)
        seq.unloaded = len(digests)
        return len(digests)

    def warm_prefix(self, prompt: list[int], salt: str | None = None) -> PrefixWarmup | None:
        """Start fetching ``prompt``'s stored prefix from the shared tier, ahead of its prefill (None: no shared
        tier, or nothing to fetch). Admit the request once ``done()``, after ``land_prefix``."""
        if self.shared is None:
            return None
        return self.shared.warm(prompt, salted_root(self.root, salt))

    def land_prefix(self, warmup: PrefixWarmup) -> None:
        """Store what a done warm-up fetched, before the request's prefix lookup (engine thread)."""
        if self.shared is not None:
            self.shared.land(warmup)

    def load_prefix(self, seq_id: int) -> bool:
        """Read the pages ``add_sequence`` matched and did not read (``PrefixPages.load``). False when some
        could not be read: the sequence is cut back to the pages before it, and its caller must treat the
        tokens after them as not computed."""
        return self.prefix.load(self._seqs[seq_id])

    def free(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id)
        try:
            if self.keeper is not None and seq.settled:  # a step that failed may have left its window half written
                self.keeper.keep(seq)
            if seq.prefilling:
                self.placer.release(seq.pids)
            for d in seq.digests:
                self.prefix.unref(d)
        finally:
            heapq.heappush(self._rows, seq.row)  # its row is free whatever failed above

    def _grow(self, rows: int, pages: int) -> None:
        """Room in the row-indexed tensors for ``rows`` rows of ``pages`` pages (between steps)."""
        self.summaries.ensure(rows, pages)
        r, p = self.summaries.rows, self.summaries.pages
        if self.page_table.shape != (r, p):
            new = self._table(r, p)
            new[: self.page_table.shape[0], : self.page_table.shape[1]] = self.page_table
            self.page_table = new

    # --- steps -------------------------------------------------------------------------------------
    def begin(self, seq_id: int, tokens: list[int], decode: bool = False) -> StepSeq:
        """Reserve room for ``tokens`` appended to ``seq_id`` this step; digests of the pages they seal.
        Pages holding KV computed by sparse decode (selection active) are addressed apart from exact
        ones (salted digests): a full-attention run, or a prompt that repeats the text, never reuses them."""
        seq = self._seqs[seq_id]
        s = self.layout.page_size
        start = seq.length
        if decode and seq.prefilling:  # the prompt is in: its pages rank by attention from now on
            self.placer.release(seq.pids)
            seq.prefilling = False
            if self.keeper is not None:
                self.keeper.keep(seq)
        if decode and self.policy.sparse and start >= self.selection.budget_pages * s:
            seq.inexact = True
        salt = self._sparse_salt if seq.inexact else b""
        seq.settled = False
        self._stepping.append(seq)
        seq.tokens.extend(tokens)
        seq.length = start + len(tokens)
        new: list[bytes] = []
        prev = seq.digests[-1] if seq.digests else seq.root
        for p in range(start // s, seq.length // s):
            prev = chain_digest(prev, seq.tokens[p * s : (p + 1) * s], salt)
            new.append(prev)
        if new and self.page_events is not None:
            first_page = start // s
            self.page_events.describe(
                (d, (new[i - 1] if i else seq.digests[-1] if seq.digests else None),
                 tuple(seq.tokens[(first_page + i) * s : (first_page + i + 1) * s])) for i, d in enumerate(new))
        if new and not seq.inexact and self.shared is not None:
            self._exact_pages.update(new)
        pids = [self.prefix.ref(d) for d in new]
        first = len(seq.digests)
        seq.digests.extend(new)
        seq.pids.extend(pids)
        if seq.prefilling:
            self.placer.hold(pids)
        if new:
            self._grow(seq.row + 1, len(seq.digests))
            self.page_table[seq.row, first : first + len(new)] = torch.tensor(pids, dtype=torch.int64,
                                                                             device=self.device)
        pos = torch.arange(start, seq.length, device=self.device)
        return StepSeq(seq_id, seq.row, start, len(tokens), pos, decode, tuple(new))

    def backend(self, steps: list[StepSeq], timings: dict[str, float] | None = None,
                products: str = "fp32") -> TieredAttentionBackend:
        """The attention backend of one forward step over ``steps`` (``begin``), wired to this cache's parts."""
        return TieredAttentionBackend(self, self.placer, self._reads, steps, timings, products)

    def prepare_step(self) -> None:
        """Before a forward step (engine thread): the store's owner is this thread; the load phase makes the
        copies the last step's reads earned (the Mover); placement's tensors follow the page ids."""
        self.store.bind_owner()
        rows = max((s.row for s in self._seqs.values()), default=0) + 1
        self._grow(rows, 1)
        self.promotions.drop_unplanned()  # left by a step that failed
        self.promotions.run()
        self.placer.begin_step(self.store.drain_freed())

    def seal(self, seq: SeqKV, layer: int | None, first: int, kv: torch.Tensor, blocks: torch.Tensor) -> list[BlockKey]:
        """Store full pages of ``seq`` on placement's initial tier and summarise them: pages first.. of one
        ``layer`` (kv [n, 2, Hkv, S, D], blocks [n, block_bytes]), or page ``first`` of every layer when
        ``layer`` is None (kv [L, 2, Hkv, S, D], blocks [L, block_bytes])."""
        if layer is None:
            keys = self.prefix.keys(seq.digests[first])
            self.summaries.set_all_layers(seq.row, first, kv[:, 0], kv[:, 1])
            pids = seq.pids[first : first + 1]
        else:
            n = kv.shape[0]
            keys = [BlockKey(d, layer) for d in seq.digests[first : first + n]]
            self.summaries.set(layer, seq.row, first, kv[:, 0], kv[:, 1])
            pids = seq.pids[first : first + n]
        self.mover.put(keys, blocks, self.placer.initial_tier, needed=True, persistent=True)
        self.placer.stored(layer, pids)
        return keys

    def finish_step(self, sealed: list[BlockKey], decoded: list[int]) -> None:
        """After a forward step: write sealed blocks through to SSD; placement's end of a decode step."""
        for seq in self._stepping:
            seq.settled = True
            if self.keeper is not None and seq.prefilling:
                self.keeper.checkpoint(seq)
        self._stepping.clear()
        dst = self.placer.write_through_tier(self.config.tiers.persist)
        if sealed and dst is not None:
            self.transfers.replicate(sealed, dst)
        if self.shared is not None:
            exact, self._exact_pages = self._exact_pages, set()
            if sealed:
                self.shared.publish(self.placer.shared_publish([k.digest for k in sealed if k.layer == 0], exact))
        if decoded:
            self.decode_steps += 1
            self.placer.end_decode_step()

    def prefetch(self, layers: torch.Tensor, pids: torch.Tensor) -> None:
        """Move the predicted blocks (layers[i], pids[i]) of the next step up where placement admits them:
        prepared here (room made, slots reserved), run by the transfer workers."""
        for plan in self.placer.prefetch_plan(layers, pids):
            moves = self.mover.prepare_promote(list(plan.keys), plan.dst)
            if moves:
                self.placer.ledger.issued([m.block.key for m in moves], self.transfers.run(moves))

    # --- tiers -------------------------------------------------------------------------------------
    @property
    def prefix_hit_pages(self) -> int:
        """Pages reused from the tiers instead of recomputed."""
        return self.prefix.hit_pages

    def usage(self) -> list[TierUsage]:
        """Each tier's budget, capacity and use (``LiveBudgets.usage``)."""
        return self.budgets.usage()

    def bytes_by_layer_kind(self) -> dict[str, int]:
        """Distinct KV bytes the running sequences hold, by layer kind (a page with copies in two tiers
        counts once): ``global`` (their sealed pages and open pages) and ``sliding`` (the window rings of a
        hybrid model; 0 otherwise)."""
        sliding = len(self._seqs) * self.windows.bytes_per_sequence() if self.windows is not None else 0
        return {"global": (self.prefix.referenced + len(self._seqs)) * self.layout.page_bytes, "sliding": sliding}

    def page_reads(self) -> dict[str, int]:
        """Needed pages read, by the tier they were found in (in place by the decode loop, or by the store)."""
        return self._page_reads(self.store.counters().page_reads)

    def _page_reads(self, store_reads: dict[str, int]) -> dict[str, int]:
        """``store_reads`` (the Mover's, per tier) plus the decode loop's reads in place."""
        reads = dict(store_reads)
        for t, n in self.read_counters.hot_reads.items():
            reads[t] = reads.get(t, 0) + n
        return reads

    # --- the budgets (``live_budgets``) and the envelope's split (``envelope``) --------------------
    @property
    def max_running(self) -> int:
        """Sequences the envelope reserves decode buffers for now."""
        return self.envelope.max_running

    def set_max_running(self, n: int, running: int) -> bool:
        """Move the split to ``n`` running sequences (``running`` run now; ``Envelope.set_max_running``)."""
        return self.envelope.set_max_running(n, running)

    def settle_running(self, running: int) -> None:
        """After a step: apply a pending smaller limit once at most that many sequences run."""
        self.envelope.settle(running)

    def split(self) -> EnvelopeSplit:
        """How the device envelope is split now."""
        return self.envelope.split()

    def set_budgets(self, envelope_bytes: int, dram_bytes: int, ssd_bytes: int, defer_ssd_shrink: bool = False) -> bool:
        """``LiveBudgets.set_budgets``: new budgets live, between steps; whether an SSD shrink is left pending."""
        return self.budgets.set_budgets(envelope_bytes, dram_bytes, ssd_bytes, defer_ssd_shrink)

    def shrink_ssd(self, ssd_bytes: int) -> None:
        """``LiveBudgets.shrink_ssd``: the deferred SSD shrink, any thread."""
        self.budgets.shrink_ssd(ssd_bytes)

    def has_tier(self, tier: str) -> bool:
        """Whether the cache runs ``tier`` (the SSD tier needs an SSD directory)."""
        return tier in self.store.tiers

    def health(self) -> dict[str, str]:
        """The degraded tiers and why (empty when every tier is healthy). A failing shared tier is probed
        again in the background (its breakers' cooldowns over)."""
        out = dict(self.store.health())
        if self.shared_tier is not None:
            why = self.shared_tier.degraded()
            if why is not None:
                out["shared"] = why
                tier = self.shared_tier
                self.shared_queue.submit(tier.probe, Priority.PREFETCH, dedupe=("probe",))
        return out

    def page_digests(self) -> list[bytes]:
        """Digests of the pages some tier holds (what a router indexes)."""
        return self.store.page_digests()

    def drain_transfers(self) -> None:
        """Wait until the queued prefetches and write-backs have run."""
        self.transfers.drain()

    def counters(self) -> CacheCounters:
        """Every counter of the cache's parts, read now."""
        store, reads = self.store.counters(), self.read_counters
        found = self._page_reads(store.page_reads)  # the store's counters read once, at one instant
        return CacheCounters(
            page_reads={t: found.get(t, 0) for t in ("gpu", "dram", "ssd")}, transfer_bytes=store.transfer_bytes,
            prefetch=self.placer.ledger.counts(), fetch_wait_seconds=reads.fetch_wait_seconds,
            decode_steps=self.decode_steps, prefix_hit_pages=self.prefix.hit_pages, misses=store.misses,
            pages_lost=reads.pages_lost, prefetch_throttled=self.placer.throttle.throttled, faults=self.store.faults(),
            degraded=frozenset(self.health()), prompt_rereads=reads.prompt_store_reads,
            layer_kind_bytes=self.bytes_by_layer_kind(), split=self.envelope.split(),
            shared=self.shared_tier.counters() if self.shared_tier is not None else None,
            shared_prefix_pages=self.shared.warmed_pages if self.shared is not None else 0,
            spilled_blocks=self.mover.spilled)

    def close(self) -> None:
        self.transfers.close()
        if self.shared_tier is not None:
            self.shared_queue.close()  # queued publishes finish first
            self.shared_tier.close()
        self.mover.close()
