"""The one owner of every tier decision. Pure bookkeeping: it decides, it never moves bytes.

| decision | kvdrive | lru | ondemand / fullfetch |
| --- | --- | --- | --- |
| where a new page goes | device tier | device tier | device tier |
| what a read from a lower tier promotes | admission by hotness, per destination | everything, to the device tier | nothing |
| eviction order (the store asks) | coldest by attention hotness | least recently used | least recently used |
| prefetch for the next step | predicted blocks that admission accepts | none | none |
| pages of a prompt in progress | held: ranked above every other block | held | held |
| a full tier's victim (``eviction.py``, passed to the store) | dropped if a clean copy is right below, else demoted to the next tier with room, else dropped if nobody needs it | same | same |
| write-through of sealed pages | to the SSD tier when persisting | same | same |
| a put over a stored page | only touched, unless its fastest copy lies in a failing tier (replaced) | same | same |

Scores are tensors (``scores``): the decode loop adds each page's attention mass (or its read time) with
one ``index_add_`` per layer. Admission compares against the coldest residents found by one ``topk``
per tier and step. A prompt in progress is *held*: each of its chunks attends exactly to all its earlier
pages, so ranking them by attention (they have none yet) would send them down the tiers between chunks and
every later chunk would read them back (the soak's multi-second steps); held pages rank above every other
block until the prompt is in, for eviction and admission alike. On a CPU host the device tier and DRAM
are the same memory, so only SSD reads are worth promoting; on CUDA, DRAM reads are too. The store (``kvcache.store``) stores and evicts in the order
given here (``eviction``, passed in when it is built); the Mover moves bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from kvdrive.runtime.kvcache.contract import Block, CopyPlan
from kvdrive.runtime.kvcache.placement.admission import Admission
from kvdrive.runtime.kvcache.placement.eviction import TierEviction
from kvdrive.runtime.kvcache.placement.policy import PlacementPolicy
from kvdrive.runtime.kvcache.placement.predictor import PrefetchLedger, PrefetchThrottle
from kvdrive.runtime.kvcache.placement.scores import BlockScores, Hotness, HotnessConfig, Recency
from kvdrive.runtime.kvcache.store.block_index import BlockIndex
from kvdrive.runtime.kvcache.store.budgets import TierName
from kvdrive.runtime.kvcache.store.keys import BlockKey
from kvdrive.runtime.kvcache.store.tiers.base import Tier


@dataclass(frozen=True)
class PlacerConfig:
    runners_up: int = 4  # pages ranked after the selection that are kept warm and prefetched, per sequence and layer
    # (4 against 2: demo 7K decode steps 33.9 -> 30.6 ms at batch 1, 72.7 -> 65.4 at batch 4, fewer misses)
    promote_margin: float = 1.5  # a block replaces the device tier's coldest only when 1.5x hotter
    promote_min_gain: float = 0.05  # ... and by at least this much attention mass (scores are in [0, Hq] per step)
    prefetch_min_precision: float = 0.5  # prefetch while at least half of what it moves is then used
    prefetch_probe: int = 8  # while prefetch does not pay, try it every 8th step
    hotness: HotnessConfig = field(default_factory=HotnessConfig)


class Placer:
    initial_tier: TierName = "gpu"  # sealed pages start on the device tier, as a prefill leaves them

    def __init__(self, policy: PlacementPolicy, index: BlockIndex, tiers: Mapping[TierName, Tier],
                 config: PlacerConfig | None = None) -> None:
        """``index``: the page ids the store keeps (scores are indexed by them); ``tiers``: the tiers whose
        room admission weighs (read, never written)."""
        self.policy = policy
        self.config = c = config or PlacerConfig()
        self.index = index
        self.tiers = tiers
        self.device = device = index.device
        layers = index.num_layers
        self.scores: BlockScores = Hotness(layers, device, self.index.capacity, c.hotness) \
            if policy.hotness_eviction else Recency(layers, device, self.index.capacity)
        self.promote_from: tuple[TierName, ...] = ("dram", "ssd") if device.type == "cuda" else ("ssd",)
        self.runners_up = c.runners_up if policy.prefetch else 0
        self.ledger = PrefetchLedger()
        self.throttle = PrefetchThrottle(c.prefetch_min_precision, c.prefetch_probe)
        self.decode_steps = 0
        self._admission: dict[TierName, Admission] = {}
        self._held = self._zeros_held(self.index.capacity + 1, device)  # [Pcap + 1]
        # a full tier's victims: coldest first by these scores (held pages last), demoted down the hierarchy
        self.eviction = TierEviction(self.victim_order, self.coldest_of)

    def write_through_tier(self, persist: bool) -> TierName | None:
        """Where sealed pages get a write-through copy (persisted prefix pages survive restarts): the SSD tier
        when the server persists and has one."""
        return "ssd" if persist and "ssd" in self.tiers else None

    # --- the shared tier --------------------------------------------------------------------------
    @staticmethod
    def shared_publish(digests: list[bytes], exact: set[bytes]) -> list[bytes]:
        """Which sealed pages go to the shared tier: those whose KV was computed exactly (prompt pages and
        full-attention decode), written through as they seal. Pages of a sparse decode are addressed apart
        and never reused by another prompt: not published."""
        return [d for d in digests if d in exact]

    def shared_landing_tier(self, blocks: int) -> TierName:
        """Where ``blocks`` fetched from the shared tier land before the prefix load reads them: DRAM when it
        can hold them all (the load then reads them from memory), else the SSD tier (the largest), else the
        device."""
        for tier in ("dram", "ssd"):
            if tier in self.tiers and self.tiers[tier].allocator.capacity >= blocks:
                return tier
        return "ssd" if "ssd" in self.tiers else "gpu"

    # --- the store's eviction order ---------------------------------------------------------------
    def victim_order(self, tier: TierName, cands: list[Block]) -> list[Block]:
        """Coldest first (a stable sort: ties keep the store's least-recently-used order)."""
        dev = self.scores.device
        layers = torch.tensor([b.key.layer for b in cands], dtype=torch.int64, device=dev)
        pids = torch.tensor([b.pid for b in cands], dtype=torch.int64, device=dev)
        order = torch.sort(self._rank(layers, pids), stable=True).indices.tolist()
        return [cands[i] for i in order]

    def coldest_of(self, tier: TierName, k: int) -> list[tuple[int, int]]:
        """The ``k`` coldest residents of memory tier ``tier`` as (page id, layer), coldest first."""
        layers, pids = self.index.residents(tier)
        if pids.numel() == 0:
            return []
        top = torch.topk(self._rank(layers, pids), min(k, pids.numel()), largest=False, sorted=True).indices
        return list(zip(pids[top].tolist(), layers[top].tolist(), strict=True))

    def _rank(self, layers: torch.Tensor, pids: torch.Tensor) -> torch.Tensor:
        """Scores of blocks (layers[i], pids[i]) with held pages ranked above everything: [n] float32."""
        self._grow_held()
        # page ids made since the step began (the scores follow them in begin_step) rank as new pages: cold
        cap = self.scores.scratch
        known = pids < cap
        scores = self.scores.of(layers, torch.where(known, pids, cap))
        return torch.where(self._held.index_select(0, pids) > 0, torch.inf, torch.where(known, scores, 0.0))

    # --- prompts in progress ---------------------------------------------------------------------
    @staticmethod
    def _zeros_held(n: int, device: torch.device) -> torch.Tensor:
        """A normal tensor, also when made inside the forward (inference mode): ``release`` updates it in place
        outside it (a request freed by the server's thread of control, between steps)."""
        with torch.inference_mode(False):
            return torch.zeros(n, dtype=torch.int32, device=device)

    def _grow_held(self) -> None:
        cap = self.index.capacity + 1
        if self._held.shape[0] < cap:
            new = self._zeros_held(cap, self._held.device)
            with torch.inference_mode(False):
                new[: self._held.shape[0]] = self._held
            self._held = new

    def hold(self, pids: list[int]) -> None:
        """Pages of a prompt in progress (counted: prompts sharing a prefix hold it twice)."""
        if pids:
            self._grow_held()
            self._held.index_add_(0, torch.tensor(pids, device=self._held.device),
                                  torch.ones(len(pids), dtype=torch.int32, device=self._held.device))

    def release(self, pids: list[int]) -> None:
        """The prompt holding ``pids`` is in (or was freed): they rank by their scores again."""
        if pids:
            self._held.index_add_(0, torch.tensor(pids, device=self._held.device),
                                  torch.full((len(pids),), -1, dtype=torch.int32, device=self._held.device))

    @property
    def held_pages(self) -> int:
        return int((self._held > 0).sum())

    # --- a step ----------------------------------------------------------------------------------
    def begin_step(self, freed: list[int]) -> None:
        """Before a forward step: scores follow the page ids (new capacity; ``freed``, the ids freed since the
        last step, reset); this step's admission state is computed lazily, once per tier."""
        self.scores.ensure(self.index.capacity)
        self.scores.forget(freed)
        self._admission = {}

    @property
    def wants_mass(self) -> bool:
        """Whether ``record`` needs the attention mass (hotness) or only which pages were read (recency)."""
        return isinstance(self.scores, Hotness)

    def record(self, pids: torch.Tensor, mass: torch.Tensor | None) -> None:
        """A decode step's attention read pages ``pids`` [L, n] of every layer (padding at ``scratch``) with
        ``mass`` [L, n]."""
        self.scores.record(pids, mass)

    def predicted(self, pids: torch.Tensor) -> None:
        """Pages ``pids`` [L, n] of every layer (padding at ``scratch``) ranked just below a decode step's
        selection (the runners-up): they get the credit of a selection without attention mass. Selection
        is a per-row rank, so the pages worth keeping above the SSD are the ones ranked near the cut in
        every row, not the globally heaviest; this is what keeps them there, and what prefetch admits them
        by."""
        if isinstance(self.scores, Hotness):
            self.scores.estimate(pids, self.config.hotness.selection_weight)

    def stored(self, layer: int | None, pids: list[int]) -> None:
        """Pages ``pids`` were sealed in ``layer`` (None: every layer)."""
        self.scores.touch(layer, pids)

    def end_decode_step(self) -> None:
        self.decode_steps += 1
        self.scores.advance()

    @property
    def scratch(self) -> int:
        return self.scores.scratch

    @property
    def width(self) -> int:
        """Page ids the scores cover (the scratch id included)."""
        return self.scores.values.shape[1]

    @property
    def prefetching(self) -> bool:
        return self.policy.prefetch

    # --- promotion -------------------------------------------------------------------------------
    def _tier_admission(self, tier: TierName) -> Admission:
        adm = self._admission.get(tier)
        if adm is None:
            alloc = self.tiers[tier].allocator
            c = self.config

            def coldest(tier: TierName = tier) -> torch.Tensor:
                layers, pids = self.index.residents(tier)
                return torch.sort(self._rank(layers, pids)).values

            # hysteresis on the device tier (a block must be clearly hotter than the one it displaces);
            # DRAM takes any block hotter than its coldest (the SSD read it saves is the expensive one)
            margin, gain = (c.promote_margin, c.promote_min_gain) if tier == "gpu" else (1.0, 0.0)
            adm = self._admission[tier] = Admission(alloc.free_count, coldest, margin, gain)
        return adm

    def promotion(self, keys: list[BlockKey], pids: list[int], served: list[TierName | None]) -> list[CopyPlan]:
        """Blocks a step just read from lower tiers (``keys``, their page ids, the tier each came from): where each
        gets a copy, if anywhere, one plan per destination (its ``rows`` index ``keys``)."""
        if not self.policy.promote_on_read or not keys:
            return []
        if not self.policy.hotness_eviction:  # lru: everything read goes to the device tier
            rows = [i for i, t in enumerate(served) if t is not None and t != "gpu"]
            return [_plan("gpu", keys, rows)] if rows else []
        rows = [i for i, t in enumerate(served) if t in self.promote_from]
        if not rows:
            return []
        dev = self.scores.device
        layers = torch.tensor([keys[i].layer for i in rows], dtype=torch.int64, device=dev)
        ids = torch.tensor([pids[i] for i in rows], dtype=torch.int64, device=dev)
        from_ssd = torch.tensor([served[i] == "ssd" for i in rows], dtype=torch.bool, device=dev)
        return [_plan(t, keys, [rows[j] for j in js]) for t, js in self._admit(layers, ids, from_ssd).items()]

    def _admit(self, layers: torch.Tensor, pids: torch.Tensor, from_ssd: torch.Tensor) -> dict[TierName, list[int]]:
        """Where candidate blocks (layers[i], pids[i]) from DRAM or (``from_ssd``) the SSD get a copy: hottest
        first, into the device tier while it admits them, the SSD ones that it does not into DRAM while
        that admits them. Returns destination tier -> candidate indices."""
        scores = self._rank(layers, pids)
        order = torch.sort(scores, descending=True).indices
        cuda = self.device.type == "cuda"
        to_gpu = order if cuda else order[from_ssd[order]]  # on a CPU host only SSD reads are worth moving up
        out: dict[TierName, list[int]] = {}
        n_gpu = self._tier_admission("gpu").admit(scores[to_gpu])
        if n_gpu:
            out["gpu"] = to_gpu[:n_gpu].tolist()
        rest = to_gpu[n_gpu:]
        rest = rest[from_ssd[rest]]
        if rest.numel() and "dram" in self.tiers and self.tiers["dram"].allocator.capacity:
            n_dram = self._tier_admission("dram").admit(scores[rest])
            if n_dram:
                out["dram"] = rest[:n_dram].tolist()
        return out

    # --- prefetch --------------------------------------------------------------------------------
    def prefetch_allowed(self) -> bool:
        return self.policy.prefetch and self.throttle.allow(self.ledger.counts(), self.decode_steps)

    def prefetch_plan(self, layers: torch.Tensor, pids: torch.Tensor) -> list[CopyPlan]:
        """The predicted blocks (layers[i], pids[i]) of the next step not yet in a tier worth reading from: one
        plan per destination tier, as admission allows (hottest first)."""
        if not self.policy.prefetch or pids.numel() == 0:
            return []
        gpu, dram = self.index.slots("gpu"), self.index.slots("dram")
        width = gpu.shape[1]
        flat = torch.unique(layers * width + pids)
        in_dram = dram.view(-1).index_select(0, flat) >= 0
        away = gpu.view(-1).index_select(0, flat) < 0
        if "dram" not in self.promote_from:
            away &= ~in_dram
        flat, in_dram = flat[away], in_dram[away]
        if flat.numel() == 0:
            return []
        ls, ps = flat // width, flat % width
        plan = self._admit(ls, ps, ~in_dram)
        chosen = sorted({i for js in plan.values() for i in js})
        if not chosen:
            return []
        lsl, psl = ls.tolist(), ps.tolist()
        out: list[CopyPlan] = []
        for t, js in plan.items():
            keys = tuple(BlockKey(d, lsl[j]) for j in js if (d := self.index.digests[psl[j]]) is not None)
            if keys:
                out.append(CopyPlan(t, keys))
        return out

    def settle_prefetch(self, selected: torch.Tensor) -> None:
        """After a decode step: classify the last plan's prefetches. ``selected`` [L, Pcap + 1] bool marks
        the blocks this step attended to."""
        issued = self.ledger.outstanding
        if not issued:
            self.ledger.settle(set())
            return
        dev = selected.device
        layers = torch.tensor([k.layer for k in issued], dtype=torch.int64, device=dev)
        pids = torch.tensor([self.index.find(k.digest) if self.index.find(k.digest) is not None else self.scratch
                             for k in issued], dtype=torch.int64, device=dev)
        hit = selected.view(-1)[layers * selected.shape[1] + pids].tolist()
        self.ledger.settle({k for k, h in zip(issued, hit, strict=True) if h})


def _plan(dst: TierName, keys: list[BlockKey], rows: list[int]) -> CopyPlan:
    return CopyPlan(dst, tuple(keys[i] for i in rows), tuple(rows))
