"""The attention backend of one engine step over the tiered KV cache: it writes, selects, reads and attends.

Decode (one generated token per sequence), per layer, for the whole batch at once::

    q, k, v ──► write k, v into each sequence's open page (one index_put into the device pool's tail rows)
            ──► select: Quest bounds from the row summaries, softmax over pages,
                 + the mass each page drew at this layer's last step, topk              [B, K] page indices
            ──► page ids = page_table[rows].gather(idx)                                    [B, K]
            ──► read, where the pages are:
                 a CPU host (the paged kernels, ``attention.paged_kernels``): each page's slot in the host
                   arena; misses only: read by the Mover into a staging buffer               slots [B, K+1]
                 elsewhere (PageReader.read): device-tier pages + open page, one index_select [2, B, Hkv, K+1, S*D]
                   misses only: DRAM rows by tensor gather, the rest through the Mover (host code)
            ──► attend: on a CPU host one kernel reads the pages in place (no gathered copy); elsewhere one
                 masked matmul / softmax / matmul over the buffer                            [B, Hq, D]
                 + the attention mass each page drew                                          [B, K]

Everything that does not change between layers (rows, page-table view, masks, the open pages' rows) is
computed once per step. What each layer attended to is kept and recorded once, at the end of the step, for
all layers: the mass each page drew (for the next step's selection) and the placer's scores. Prompt chunks
attend exactly to every earlier page (read the same way) plus their own tokens; the pages they fill are
sealed into the store. A decode page that fills is sealed at the end of the step, for all layers at once.
Where a page lives, and what moves, placement decides: the copies that the step's lower-tier reads earned
are decided in one batch at the end of the step (``promotions``, timed as bookkeeping).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

import torch

from kvdrive.runtime.attention import (
    causal_attention,
    decode_attention,
    paged_kernels,
    rest_of_pages,
    select_pages,
    selection_masks,
    sketch_weights,
    sketched_rest,
)
from kvdrive.runtime.kvcache.sequence import StepSeq
from kvdrive.runtime.kvcache.step_reads import PageReader, StepReadParts
from kvdrive.runtime.kvcache.store import BlockKey

if TYPE_CHECKING:
    from kvdrive.runtime.kvcache.cache import KVCache

PHASES = ("selection", "gather", "misses", "attention", "bookkeeping")


class StepPlacement(Protocol):
    """What a step tells placement and asks of it (``placement.Placer``)."""

    @property
    def scratch(self) -> int: ...  # the page id that padding entries point at

    @property
    def wants_mass(self) -> bool: ...  # record the attention mass (hotness), or only which pages were read

    @property
    def prefetching(self) -> bool: ...  # the policy prefetches the next step's pages

    @property
    def runners_up(self) -> int: ...  # pages ranked after the selection kept warm, per sequence and layer

    @property
    def width(self) -> int: ...  # page ids the scores cover (the scratch id included)

    def record(self, pids: torch.Tensor, mass: torch.Tensor | None) -> None: ...

    def predicted(self, pids: torch.Tensor) -> None: ...

    def settle_prefetch(self, selected: torch.Tensor) -> None: ...

    def prefetch_allowed(self) -> bool: ...


class _DecodeBatch:
    """What the decode sequences of one step share across layers."""

    def __init__(self, cache: KVCache, placement: StepPlacement, reads: StepReadParts, steps: list[StepSeq],
                 q_rows: list[int]) -> None:
        lay, dev = cache.layout, cache.device
        s, L = lay.page_size, lay.num_layers
        order = sorted(range(len(steps)), key=lambda i: steps[i].row)
        self.steps = [steps[i] for i in order]
        rows = [st.row for st in self.steps]
        self.q_rows = [q_rows[i] for i in order]
        self.q_index = None if self.q_rows == list(range(len(rows))) else torch.tensor(self.q_rows, device=dev)
        self.seq_ids = [st.seq_id for st in self.steps]
        self.rows = torch.tensor(rows, dtype=torch.int64, device=dev)
        self.first_row = rows[0] if rows == list(range(rows[0], rows[0] + len(rows))) else None
        npages = [st.start // s for st in self.steps]  # sealed before the step (decode seals at its end)
        self.npages = torch.tensor(npages, dtype=torch.int64, device=dev)
        self.pmax = max(npages)
        self.sparse = cache.policy.sparse and self.pmax > cache.selection.budget_pages
        k = cache.selection.budget_pages if cache.policy.sparse else self.pmax
        self.k = k = max(1, min(k, max(self.pmax, 1)))
        b = len(rows)
        ar = torch.arange(k, device=dev)
        self.valid = ar[None, :] < self.npages[:, None]  # [B, K]: a short sequence has its pages first
        self.n_valid = sum(min(n, k) for n in npages)
        self.all_valid = self.n_valid == b * k
        self.idx = ar.expand(b, k)  # the selection when nothing needs selecting
        pt, width = cache.page_table, max(self.pmax, 1)
        self.table = pt[self.first_row : self.first_row + b, :width] if self.first_row is not None \
            else pt.index_select(0, self.rows)[:, :width]
        self.masks = selection_masks(self.npages, self.pmax, cache.selection) if self.sparse else None
        sel = cache.selection  # the previous step's mass shared by the layers: one [B, P] for the whole step
        self.shared = cache.summaries.shared_drawn(self.rows, self.first_row, self.pmax, sel.neighbour_carry) \
            if self.sparse and sel.shared_carry else None
        self.positions = torch.tensor([st.start for st in self.steps], dtype=torch.int64, device=dev)  # [B]
        offs = self.positions % s
        self.offs = offs
        # [L, B]: the device pool row of each sequence's open page, per layer
        self.tails = cache.tail_base + self.rows[None, :] * L + torch.arange(L, device=dev)[:, None]
        tok = torch.arange(s, device=dev)
        tail_mask = tok[None, :] > offs[:, None]  # [B, S]: the open page's tokens not written yet
        page_mask = (~self.valid)[:, :, None].expand(b, k, s)
        self.mask = torch.cat([page_mask, tail_mask[:, None, :]], dim=1).reshape(b, 1, 1, (k + 1) * s)
        # a CPU host: selection and attention run in the paged kernels, reading pages in place in the arena
        self.in_place = cache.store.arena is not None and paged_kernels.available(dev)
        # [B, K + 1]: tokens attended in each column (a selected page's S, none for padding; the open page's
        # written tokens last)
        self.ntok = torch.cat([torch.where(self.valid, s, 0), (offs + 1)[:, None]], dim=1)
        self.reader = PageReader(reads, b, k, tail=True, storage=cache.envelope.step_storage(b, k + 1))
        self.scratch = placement.scratch
        self.mass = placement.wants_mass
        self.prefetch = placement.prefetching
        # what each layer attended to, recorded for placement and the next step's selection once per step
        # (``TieredAttentionBackend.finish``): the pages [L, B, K], then the runners-up's indices [L, B, R]
        r = placement.runners_up if self.sparse else 0
        self.chosen = torch.full((L, b, k + r), self.scratch, dtype=torch.int64, device=dev)
        self.near = torch.full((L, b, r), self.pmax, dtype=torch.int64, device=dev)  # >= every row's pages: none
        self.idx_seen = torch.empty((L, b, k), dtype=torch.int64, device=dev) if self.sparse else None
        self.mass_seen = torch.empty((L, b, k), dtype=torch.float32, device=dev) if self.mass or self.sparse else None


class TieredAttentionBackend:
    """Implements ``kvdrive.runtime.model.AttentionBackend`` over a ``KVCache`` (built by ``KVCache.backend``)."""

    def __init__(self, cache: KVCache, placement: StepPlacement, reads: StepReadParts, steps: list[StepSeq],
                 timings: dict[str, float] | None = None, products: str = "fp32") -> None:
        """``placement``: what the step records and asks; ``reads``: what reading pages needs; ``products``: the
        dtype of the prompt chunks' products with earlier keys (``causal_attention``)."""
        self.cache = cache
        self.placement = placement
        self.reads = reads
        self.products = products
        self.steps = steps
        self.sealed: list[BlockKey] = []  # blocks stored this step (for write-through)
        self.timings = timings
        self.decoded = [s.seq_id for s in steps if s.decode]
        starts, n = [], 0
        for st in steps:
            starts.append(n)
            n += st.num_new
        self.num_tokens = n
        self.starts = starts
        dec = [i for i, st in enumerate(steps) if st.decode]
        self.prompts = [i for i, st in enumerate(steps) if not st.decode]
        self.dec = _DecodeBatch(cache, placement, reads, [steps[i] for i in dec], [starts[i] for i in dec]) if dec else None
        lay = cache.layout
        self._pool_shape = (-1, *lay.block_shape)
        self._window_masks: tuple[list[torch.Tensor], torch.Tensor | None] | None = None  # sliding layers, per step

    def _pool(self) -> torch.Tensor:
        """The device pool as blocks [rows, 2, Hkv, S, D] in the cache dtype."""
        pool = self.cache.store.device_tier.pool
        return pool.view(self.cache.layout.dtype).view(self._pool_shape)

    def _mark(self, phase: str, t0: float) -> float:
        t = time.perf_counter()
        if self.timings is not None:
            if self.cache.device.type == "cuda":
                torch.cuda.synchronize(self.cache.device)
                t = time.perf_counter()
            self.timings[phase] = self.timings.get(phase, 0.0) + t - t0
        return t

    # --- prompt tokens: exact attention to every earlier page ------------------------------------
    def _prompt(self, layer: int, st: StepSeq, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache, lay = self.cache, self.cache.layout
        s, dtype = lay.page_size, lay.dtype
        seq = cache.seq(st.seq_id)
        o, first = st.start % s, st.start // s
        tail = self._pool()[cache.tail_base + st.row * lay.num_layers + layer]  # [2, Hkv, S, D]
        ck = torch.cat([tail[0, :, :o], k.to(dtype).transpose(0, 1)], dim=1)  # [Hkv, o + n, D]
        cv = torch.cat([tail[1, :, :o], v.to(dtype).transpose(0, 1)], dim=1)
        if first:
            reader = PageReader(self.reads, 1, first, tail=False)
            pids = cache.page_table[st.row, :first].view(1, first)
            valid = torch.ones((1, first), dtype=torch.bool, device=cache.device)
            ek, ev = reader.read(layer, pids, valid, first, None, [st.seq_id])
            ak, av = torch.cat([ek[0], ck], dim=1), torch.cat([ev[0], cv], dim=1)
        else:
            ak, av = ck, cv
        out = causal_attention(q, ak, av, st.positions, products=self.products)
        full = len(st.new_digests)
        if full:
            hkv, d = lay.num_kv_heads, lay.head_dim
            pk = ck[:, : full * s].reshape(hkv, full, s, d).transpose(0, 1)  # [full, Hkv, S, D]
            pv = cv[:, : full * s].reshape(hkv, full, s, d).transpose(0, 1)
            kv = torch.stack([pk, pv], dim=1).contiguous()  # [full, 2, Hkv, S, D]
            self.sealed += cache.seal(seq, layer, first, kv, kv.view(torch.uint8).view(full, -1))
        rem = ck.shape[1] - full * s
        if rem:
            tail[0, :, :rem] = ck[:, full * s :]
            tail[1, :, :rem] = cv[:, full * s :]
        return out

    # --- decode: the batched hot path ------------------------------------------------------------
    def _decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, D], k, v [B, Hkv, D] of the decode sequences, in row order -> [B, Hq, D]."""
        cache, dec = self.cache, self.dec
        assert dec is not None
        t0 = time.perf_counter()
        tails = dec.tails[layer]
        self._pool()[tails, :, :, dec.offs] = torch.stack([k, v], dim=1).to(cache.layout.dtype)  # [B, 2, Hkv, D]
        in_place = dec.in_place and paged_kernels.fits(q, cache.layout.num_kv_heads)
        near = None
        rest: tuple[torch.Tensor, torch.Tensor] | None = None  # the pages left out, as one column
        if dec.sparse:
            assert dec.masks is not None
            summ = cache.summaries.batch(layer, dec.rows, dec.first_row, dec.pmax)
            drawn = cache.summaries.drawn(layer, dec.rows, dec.first_row, dec.pmax)
            if dec.shared is not None:
                drawn = drawn + dec.shared
            codes = cache.summaries.sketch(layer, dec.rows, dec.first_row, dec.pmax)
            vsum = cache.summaries.value_summary(layer, dec.rows, dec.first_row, dec.pmax)  # --selection-rest
            bits = cache.selection.sketch_bits
            if in_place and (codes is None or cache.layout.page_size == paged_kernels.SKETCH_PAGE):
                vsketch = (vsum[0], vsum[1]) if vsum is not None and vsum[1] is not None else None
                got = paged_kernels.select(q, summ, drawn, dec.npages, cache.selection, self.placement.runners_up,
                                           codes, weights=vsum is not None and vsketch is None, values=vsketch)
                idx, near, weights, rest = got.pages, got.near, got.weights, got.rest
            else:
                weights = sketch_weights(q, summ, codes, bits, dec.masks.invalid) \
                    if vsum is not None and codes is not None else None
                idx, near, _ = select_pages(q, summ, dec.masks, cache.selection, self.placement.runners_up, drawn, codes,
                                            weights)
                if vsum is not None and vsum[1] is not None and codes is not None:
                    rest = sketched_rest(q, summ, codes, bits, vsum[0], vsum[1], idx, dec.masks.invalid)
            if vsum is not None and vsum[1] is None and weights is not None:  # "means"
                rest = rest_of_pages(weights, idx, vsum[0])
        else:
            idx = dec.idx
        pids = dec.table.gather(1, idx)
        if not dec.all_valid:
            pids = torch.where(dec.valid, pids, dec.scratch)
        t0 = self._mark("selection", t0)
        missed = dec.reader.miss_seconds
        if in_place:
            rows, slots, stage = dec.reader.locate(layer, pids, dec.valid, tails, dec.seq_ids)
        else:
            kk, vv = dec.reader.read(layer, pids, dec.valid, dec.n_valid, tails, dec.seq_ids)
        if self.timings is not None:
            miss = dec.reader.miss_seconds - missed
            self.timings["misses"] = self.timings.get("misses", 0.0) + miss
            t0 += miss
        t0 = self._mark("gather", t0)
        b, kk_ = pids.shape
        mass: torch.Tensor | None
        if in_place:
            out, mass_all = paged_kernels.attend(q, rows, stage, slots, dec.ntok, cache.layout.num_kv_heads,
                                                 cache.layout.page_size, rest)
            mass = mass_all[:, :kk_]  # [B, K]: each attended page's mass, summed over heads
        else:
            out, probs = decode_attention(q, kk, vv, dec.mask, rest)
            mass = probs.view(b, -1, kk_ + 1, cache.layout.page_size).sum(dim=(1, 3))[:, :kk_] \
                if dec.mass or dec.sparse else None  # [B, K]: each attended page's mass, summed over heads
        t0 = self._mark("attention", t0)
        dec.chosen[layer, :, :kk_] = pids
        if dec.mass_seen is not None:
            assert mass is not None
            dec.mass_seen[layer] = mass
        if dec.idx_seen is not None:
            dec.idx_seen[layer] = idx
        if near is not None and near.shape[1]:
            dec.near[layer, :, : near.shape[1]] = near
        self._mark("bookkeeping", t0)
        return out

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [N, Hq, D]; k, v: [N, Hkv, D] -> [N, Hq, D]
        kv_layer = self.cache.kv_layer.get(layer)
        if kv_layer is None:
            return self._sliding(layer, q, k, v)
        layer = kv_layer  # the tiers' index of this global layer
        dec = self.dec
        if dec is not None and not self.prompts and dec.q_index is None:
            return self._decode(layer, q, k, v)  # the common step: decodes only, already in row order
        out = torch.empty_like(q)
        for i in self.prompts:
            st = self.steps[i]
            rows = slice(self.starts[i], self.starts[i] + st.num_new)
            out[rows] = self._prompt(layer, st, q[rows], k[rows], v[rows])
        if dec is not None:
            idx = dec.q_index if dec.q_index is not None else torch.tensor(dec.q_rows, device=q.device)
            qd, kd, vd = q.index_select(0, idx), k.index_select(0, idx), v.index_select(0, idx)
            out.index_copy_(0, idx, self._decode(layer, qd, kd, vd))
        return out

    def _sliding(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A sliding-window layer: exact attention over each sequence's window ring (``sliding``)."""
        win, dec = self.cache.windows, self.dec
        assert win is not None
        t0 = time.perf_counter()
        if self._window_masks is None:  # the step's positions, so the same masks for every sliding layer
            self._window_masks = ([win.prompt_mask(self.steps[i].start, self.steps[i].num_new) for i in self.prompts],
                                  win.decode_mask(dec.positions) if dec is not None else None)
        prompt_masks, decode_mask = self._window_masks
        if dec is not None and not self.prompts and dec.q_index is None:
            assert decode_mask is not None
            out = win.decode(layer, dec.rows, dec.positions, decode_mask, q, k, v)
        else:
            out = torch.empty_like(q)
            for i, visible in zip(self.prompts, prompt_masks, strict=True):
                st = self.steps[i]
                rows = slice(self.starts[i], self.starts[i] + st.num_new)
                out[rows] = win.prompt(layer, st.row, st.start, visible, q[rows], k[rows], v[rows])
            if dec is not None:
                assert decode_mask is not None
                idx = dec.q_index if dec.q_index is not None else torch.tensor(dec.q_rows, device=q.device)
                out.index_copy_(0, idx, win.decode(layer, dec.rows, dec.positions, decode_mask, q.index_select(0, idx),
                                                   k.index_select(0, idx), v.index_select(0, idx)))
        self._mark("attention", t0)
        return out

    # --- after the forward pass ------------------------------------------------------------------
    def finish(self) -> None:
        """Seal the decode pages that filled (all layers at once), settle and plan prefetch; then decide the
        copies the step's lower-tier reads earned (placement, in one batch, after the prefetch plan has had
        its share of each tier's admissions, as measured in bench/results/decode-ab.md; the Mover makes them
        in the next step's load phase)."""
        cache, dec = self.cache, self.dec
        t0 = time.perf_counter()
        try:
            if dec is not None:
                self._finish_decode(cache, dec)
            cache.promotions.plan()
        finally:
            self._mark("bookkeeping", t0)

    def _record_attention(self, cache: KVCache, dec: _DecodeBatch) -> None:
        """What every layer attended to this step, in one batch: the mass each page drew (the next step's
        selection adds it), the placer's scores of the pages read and of the runners-up."""
        k = dec.k
        if dec.idx_seen is not None:
            assert dec.mass_seen is not None
            cache.summaries.record_drawn(dec.rows, dec.idx_seen, dec.mass_seen)
        L, b = dec.chosen.shape[:2]
        mass = dec.mass_seen.view(L, b * k) if dec.mass_seen is not None and dec.mass else None
        self.placement.record(dec.chosen[:, :, :k].reshape(L, b * k), mass)
        if dec.prefetch and dec.near.shape[2]:
            near = dec.near.permute(1, 0, 2).reshape(b, -1)  # [B, L * R]
            pids = torch.where(near < dec.npages[:, None], dec.table.gather(1, near.clamp(max=dec.table.shape[1] - 1)),
                               dec.scratch)
            near_pids = pids.view(b, L, -1).permute(1, 0, 2)  # [L, B, R]
            dec.chosen[:, :, k:] = near_pids
            self.placement.predicted(near_pids.reshape(L, -1))

    def _finish_decode(self, cache: KVCache, dec: _DecodeBatch) -> None:
        lay = cache.layout
        s, L = lay.page_size, lay.num_layers
        self._record_attention(cache, dec)
        for st in dec.steps:
            if st.new_digests:  # the token filled the open page
                seq = cache.seq(st.seq_id)
                base = cache.tail_base + st.row * L
                blocks = cache.store.device_tier.pool[base : base + L].clone()
                self.sealed += cache.seal(seq, None, st.start // s, lay.typed(blocks), blocks)
        if dec.prefetch:
            placer = self.placement
            width = placer.width
            chosen = dec.chosen
            k = dec.k
            sel = chosen[:, :, :k]
            layer_ids = torch.arange(L, device=cache.device)[:, None, None]
            mark = torch.zeros((L, width), dtype=torch.bool, device=cache.device)
            mark.view(-1)[(layer_ids * width + sel).view(-1)] = True
            placer.settle_prefetch(mark)
            if placer.prefetch_allowed():
                layers = layer_ids.expand_as(chosen).reshape(-1)
                pids = chosen.reshape(-1)
                keep = pids != placer.scratch
                cache.prefetch(layers[keep], pids[keep])

