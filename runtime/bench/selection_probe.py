"""Where sparse selection loses attention: the pages it keeps against where full attention puts its weight
(``kvdrive bench selection``, issue 44 item 4).

Owns the probe (its report: ``selection_report``). A prompt is prefilled and decoded greedily with exact full attention. At
every decode step and layer the probe also computes, from the same query, what each selection rule
(``SELECTORS``) would keep under the token budget, and scores it against full attention's probabilities:

- **cover**: the share of a query head's attention that falls on the kept pages and the open tail page (what
  sparse attention renormalises over; 1.0 means sparse equals full at this step and layer);
- **top kept**: whether the head's heaviest page is among the kept ones;
- the same cover for an **oracle** that keeps the pages with the most exact mass (what no bound can beat);
- **budget across layers** (``allocation``): the oracle's cover when the step's pages (layers x budget) are
  shared out among the layers by their exact masses instead of evenly, with this step's masses (what no
  per-layer budget can beat) and with the previous step's (what a rule could know when it sets a layer's
  budget), beside the oracle at twice the budget;
- **output error** (``OutputError``, for the first sketch rule scored): how far the attention output over the
  kept pages is from full attention's (relative L2), renormalised over the kept pages as sparse decode does,
  and completed with the pages left out, each as its mean value weighed by its mass: the exact mass (what the
  completion could reach) and the mass the key sketch predicts (what it can know without reading the page).

Every rule sees the very same queries, so rules compare without sampling noise; each carries its own
previous-step mass (what the engine's ``drawn`` holds: the renormalised attention its own selection drew).
Sliding-window layers are not probed (they attend a window, not a selection); a model with them is refused.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvdrive.runtime.attention import (
    NEIGHBOUR_SHARE,
    SelectionConfig,
    SelectionMasks,
    causal_attention,
    decode_attention,
    key_bounds,
    key_codes,
    select_pages,
    selection_masks,
    sketch_logits,
    spread_to_neighbours,
)
from kvdrive.runtime.model.config import ModelConfig
from kvdrive.runtime.model.loader import LoadedModel

PREFILL_CHUNK = 512

# q [1, Hq, D], summaries [1, Hkv, P, 2D], masks, drawn [1, P] float32 (the layer's previous-step mass), cross
# [1, P] float32 (each page's largest mass over every layer's latest step), config, keys [P, Hkv, S, D] (the
# sealed pages' keys, for a rule that keeps a sketch of them) -> kept pages [1, K] int64
Selector = Callable[[torch.Tensor, torch.Tensor, SelectionMasks, torch.Tensor, torch.Tensor, SelectionConfig,
                     torch.Tensor], torch.Tensor]


def _bounds_only(q: torch.Tensor, summ: torch.Tensor, masks: SelectionMasks, drawn: torch.Tensor,
                 cross: torch.Tensor, cfg: SelectionConfig, keys: torch.Tensor) -> torch.Tensor:
    return select_pages(q, summ, masks, cfg, 0, None)[0]


def _engine_rule(radius: float = 1.0, carry: str = "layer") -> Selector:
    """The engine's rule under ``--selection-radius radius --selection-carry carry``: the box radius weighed by
    ``radius`` (0: the box centers alone; below 1 no longer an upper bound), and to the layer's own
    previous-step mass, unless ``carry`` is "layer", the most each page drew at any layer's latest step
    (``cross``), spread to the pages beside it under "+neighbours". A retrieval head in one layer that never
    selected the needle's page then still gets it from the layers that found it, and a value that runs on
    past a page boundary brings the next page along."""
    neighbours = NEIGHBOUR_SHARE if carry.endswith("+neighbours") else 0.0

    def rule(q: torch.Tensor, summ: torch.Tensor, masks: SelectionMasks, drawn: torch.Tensor,
             cross: torch.Tensor, cfg: SelectionConfig, keys: torch.Tensor) -> torch.Tensor:
        carried = drawn if carry == "layer" else drawn + spread_to_neighbours(cross, neighbours)
        return select_pages(q, summ, masks, replace(cfg, radius_scale=radius), 0, carried)[0]

    return rule


def _sketch_rule(bits: int) -> Selector:
    """The engine's rule under ``--selection-sketch bits``: pages scored by the attention their keys, quantised
    to ``bits`` in the page's box, predict (plus the layer's own previous-step mass)."""

    def rule(q: torch.Tensor, summ: torch.Tensor, masks: SelectionMasks, drawn: torch.Tensor,
             cross: torch.Tensor, cfg: SelectionConfig, keys: torch.Tensor) -> torch.Tensor:
        codes = key_codes(keys, summ[0].transpose(0, 1), bits).transpose(0, 1)[None]  # [1, Hkv, P, D*bits/8, S]
        return select_pages(q, summ, masks, replace(cfg, sketch_bits=bits), 0, drawn, codes)[0]

    return rule


def _per_head(q: torch.Tensor, summ: torch.Tensor, masks: SelectionMasks, drawn: torch.Tensor,
              cross: torch.Tensor, cfg: SelectionConfig, keys: torch.Tensor) -> torch.Tensor:
    """Each query head ranks the pages by its own bound softmax plus the carried mass; the budget is filled
    rank by rank across heads (every head's first choice, then every head's second, ...), so a head whose
    attention is spread thin still gets its best pages instead of losing them to sharper heads."""
    _, hq, dim = q.shape
    hkv = summ.shape[1]
    qg = q.float().view(1, hkv, hq // hkv, dim) * (1.0 / math.sqrt(dim))
    bound = torch.matmul(torch.cat([qg, qg.abs()], dim=-1), summ.transpose(-1, -2)).reshape(hq, -1)  # [Hq, P]
    score = torch.softmax(bound, dim=-1) + drawn / hq
    score = score.masked_fill(masks.forced[0], float("inf"))
    order = torch.argsort(score, dim=-1, descending=True).t().reshape(-1)  # rank-major: [P * Hq]
    seen: dict[int, None] = {}  # insertion-ordered: a page counts at its best rank
    for page in order.tolist():
        seen.setdefault(page, None)
        if len(seen) == cfg.budget_pages:
            break
    return torch.tensor(sorted(seen), dtype=torch.int64, device=q.device)[None]


SELECTORS: dict[str, Selector] = {
    "bounds+carry": _engine_rule(),  # the engine's default rule (selection.select_pages with drawn)
    "bounds": _bounds_only,  # without the previous step's mass
    "half-radius+carry": _engine_rule(0.5),
    "centers+carry": _engine_rule(0.0),
    "per-head+carry": _per_head,
    "layers-carry": _engine_rule(carry="shared"),
    "layers-carry+neighbours": _engine_rule(carry="shared+neighbours"),
    "half-radius+layers-carry+neighbours": _engine_rule(0.5, "shared+neighbours"),
    "sketch8+carry": _sketch_rule(8),
    "sketch4+carry": _sketch_rule(4),
}


@dataclass(frozen=True)
class StepLayer:
    """One (prompt, decode step, layer, rule)."""

    prompt: int
    step: int
    layer: int
    rule: str  # a SELECTORS key or "oracle"
    cover_mean: float  # mean over query heads of the attention share on kept pages + tail
    cover_min: float  # the worst head's
    top_kept: float  # share of query heads whose heaviest page was kept


@dataclass(frozen=True)
class CoverCurve:
    """One (prompt, decode step, layer): the oracle's mean cover by how many pages it keeps besides the forced
    ones (sinks, recent window; the open tail always), the heaviest first."""

    prompt: int
    step: int
    layer: int
    cover: tuple[float, ...]  # [j]: keeping the j heaviest unforced pages (j = 0 .. 4x the budget's)


@dataclass(frozen=True)
class OutputError:
    """One (prompt, decode step, layer): the relative L2 distance of an estimated attention output from full
    attention's, mean over query heads, for one selection."""

    prompt: int
    step: int
    layer: int
    rule: str  # whose kept pages
    renormalised: float  # sparse decode: the kept pages and the tail, renormalised
    completed_exact: float  # + each page left out as its mean value weighed by its exact mass
    completed_sketch: float  # + the same, weighed by the mass the key sketch predicts for it


@dataclass
class ProbeResult:
    model: str
    token_budget: int
    page_size: int
    steps: int
    prompts: list[dict[str, Any]] = field(default_factory=list)  # label, tokens, pages, seconds, output
    rows: list[StepLayer] = field(default_factory=list)
    curves: list[CoverCurve] = field(default_factory=list)
    errors: list[OutputError] = field(default_factory=list)


class _ProbeBackend:
    """An ``AttentionBackend`` that attends exactly over one sequence's contiguous K/V and, at decode steps,
    scores every selection rule against the exact probabilities."""

    def __init__(self, cfg: ModelConfig, sel: SelectionConfig, capacity: int, rules: Sequence[str],
                 device: torch.device, dtype: torch.dtype) -> None:
        if cfg.sliding_layers:
            raise ValueError("the selection probe takes models whose every layer attends globally "
                             f"(this one has sliding-window layers {list(cfg.sliding_layers)})")
        shape = (cfg.num_layers, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.len = [0] * cfg.num_layers
        self.sel = sel
        self.rules = tuple(rules)
        self.summ: list[torch.Tensor] = [torch.zeros(cfg.num_kv_heads, 0, 2 * cfg.head_dim, device=device)
                                         for _ in range(cfg.num_layers)]  # [Hkv, P, 2D] per layer
        self.drawn: dict[tuple[str, int], torch.Tensor] = {}  # (rule, layer) -> [P] float32
        self.prompt = 0
        self.step = -1  # -1 while prefilling
        self.rows: list[StepLayer] = []
        self.curves: list[CoverCurve] = []
        self.errors: list[OutputError] = []
        self.error_rule = next((r for r in self.rules if r.startswith("sketch")), None)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t0, n = self.len[layer], q.shape[0]
        t = t0 + n
        self.k[layer, :, t0:t] = k.transpose(0, 1)
        self.v[layer, :, t0:t] = v.transpose(0, 1)
        self.len[layer] = t
        keys, values = self.k[layer, :, :t], self.v[layer, :, :t]  # [Hkv, T, D]
        if self.step < 0:
            pos = torch.arange(t0, t, device=q.device)
            return causal_attention(q, keys, values, pos)
        out, probs = decode_attention(q, keys[None], values[None])  # q [1, Hq, D]; probs [1, Hkv, G, T]
        self._score(layer, q, keys, probs[0].reshape(-1, t))
        return out

    def _score(self, layer: int, q: torch.Tensor, keys: torch.Tensor, probs: torch.Tensor) -> None:
        """q [1, Hq, D]; keys [Hkv, T, D]; probs [Hq, T] exact full-attention probabilities."""
        s, t = self.sel.page_size, probs.shape[1]
        pages = (t - 1) // s  # sealed pages; the page holding the current token is the open tail
        k_pages = self.sel.budget_pages
        if pages <= k_pages:
            return  # the budget holds every page: sparse is full attention here
        have = self.summ[layer].shape[1]
        if pages > have:
            hkv, _, d = keys.shape
            fresh = keys[:, have * s: pages * s].reshape(hkv, pages - have, s, d).transpose(0, 1)
            self.summ[layer] = torch.cat([self.summ[layer], key_bounds(fresh).transpose(0, 1)], dim=1)
        summ = self.summ[layer][None]  # [1, Hkv, P, 2D]
        mass = probs[:, : pages * s].reshape(-1, pages, s).sum(-1)  # [Hq, P]
        tail = probs[:, pages * s:].sum(-1)  # [Hq]
        heaviest = mass.argmax(dim=-1)  # [Hq]
        masks = selection_masks(torch.tensor([pages], device=q.device), pages, self.sel)
        hkv, _, d = keys.shape
        paged = keys[:, : pages * s].reshape(hkv, pages, s, d).transpose(0, 1)  # [P, Hkv, S, D]
        for rule in self.rules:
            drawn = self.drawn.get((rule, layer), torch.zeros(0, device=q.device))
            drawn = torch.cat([drawn, torch.zeros(pages - drawn.shape[0], device=q.device)])[None]
            kept = SELECTORS[rule](q, summ, masks, drawn, self._cross(rule, pages, q.device), self.sel, paged)[0]
            kept = kept[kept < pages]
            cover = tail + mass[:, kept].sum(-1)  # [Hq]
            new = torch.zeros(pages, device=q.device)
            new[kept] = (mass[:, kept] / cover[:, None]).sum(0)  # what sparse attention's probabilities draw
            self.drawn[(rule, layer)] = new
            self._row(layer, rule, cover, kept, heaviest, pages)
            if rule == self.error_rule:
                self._output_error(layer, rule, q, keys, probs, kept, summ, paged)
        oracle = torch.topk(mass.sum(0), k_pages).indices
        self._row(layer, "oracle", tail + mass[:, oracle].sum(-1), oracle, heaviest, pages)
        self._curve(layer, mass, tail, masks.forced[0])

    def _output_error(self, layer: int, rule: str, q: torch.Tensor, keys: torch.Tensor, probs: torch.Tensor,
                      kept: torch.Tensor, summ: torch.Tensor, paged: torch.Tensor) -> None:
        """q [1, Hq, D]; keys [Hkv, T, D]; probs [Hq, T]; kept [K] page indices; summ [1, Hkv, P, 2D]; paged
        [P, Hkv, S, D] -> an ``OutputError`` row."""
        s = self.sel.page_size
        hkv, t, d = keys.shape
        pages = paged.shape[0]
        hq = probs.shape[0]
        g = hq // hkv
        vals = self.v[layer, :, :t].float()  # [Hkv, T, D]
        pv = probs.view(hkv, g, t)
        full = torch.einsum("hgt,htd->hgd", pv, vals)
        page_in = torch.zeros(pages, dtype=torch.bool, device=q.device)
        page_in[kept] = True
        tok_in = torch.cat([page_in.repeat_interleave(s), torch.ones(t - pages * s, dtype=torch.bool, device=q.device)])
        part = torch.einsum("hgt,htd->hgd", pv * tok_in, vals)  # the kept tokens' share of the output
        cover = (pv * tok_in).sum(-1, keepdim=True)  # [Hkv, G, 1]
        vbar = vals[:, : pages * s].reshape(hkv, pages, s, d).mean(2)  # [Hkv, P, D]
        out = (~page_in).float()
        mass = pv[..., : pages * s].reshape(hkv, g, pages, s).sum(-1) * out  # [Hkv, G, P] exact, left-out pages
        exact = part + torch.einsum("hgp,hpd->hgd", mass, vbar)
        # the sketch's unnormalised page weights, on full attention's scale: exp(lse_p - log Z)
        qg = q.float().view(1, hkv, g, d) * (1.0 / math.sqrt(d))
        logits = torch.einsum("hgd,htd->hgt", qg[0], keys.float())
        log_z = torch.logsumexp(logits, dim=-1, keepdim=True)  # [Hkv, G, 1]
        codes = key_codes(paged, summ[0].transpose(0, 1), 8).transpose(0, 1)[None]
        est = torch.exp(sketch_logits(qg, summ, codes, 8)[0] - log_z) * out  # [Hkv, G, P]
        sketched = (part + torch.einsum("hgp,hpd->hgd", est, vbar)) / (cover + est.sum(-1, keepdim=True))
        norm = full.norm(dim=-1).clamp_min(1e-12)

        def err(x: torch.Tensor) -> float:
            return float(((x - full).norm(dim=-1) / norm).mean())

        self.errors.append(OutputError(self.prompt, self.step, layer, rule, err(part / cover), err(exact), err(sketched)))

    def _curve(self, layer: int, mass: torch.Tensor, tail: torch.Tensor, forced: torch.Tensor) -> None:
        """mass [Hq, P], tail [Hq], forced [P] bool -> the layer's ``CoverCurve`` at this step."""
        free = self.sel.budget_pages - int(forced.sum())
        rest = mass.masked_fill(forced[None, :], 0.0)
        order = torch.argsort(rest.sum(0), descending=True)[: 4 * free]
        base = tail + mass[:, forced].sum(-1)  # [Hq]
        cum = torch.cat([base[:, None], base[:, None] + torch.cumsum(rest[:, order], dim=1)], dim=1)
        self.curves.append(CoverCurve(self.prompt, self.step, layer, tuple(cum.mean(0).tolist())))

    def _cross(self, rule: str, pages: int, device: torch.device) -> torch.Tensor:
        """[1, P]: each page's largest mass over the layers' latest steps under ``rule`` (this step's for the
        layers before this one, the previous step's for the rest)."""
        cross = torch.zeros(pages, device=device)
        for (r, _), m in self.drawn.items():
            if r == rule:
                n = min(pages, m.shape[0])
                cross[:n] = torch.maximum(cross[:n], m[:n])
        return cross[None]

    def _row(self, layer: int, rule: str, cover: torch.Tensor, kept: torch.Tensor, heaviest: torch.Tensor,
             pages: int) -> None:
        is_kept = torch.zeros(pages, dtype=torch.bool, device=cover.device)
        is_kept[kept] = True
        self.rows.append(StepLayer(self.prompt, self.step, layer, rule, float(cover.mean()), float(cover.min()),
                                   float(is_kept[heaviest].float().mean())))

    def next_prompt(self) -> None:
        self.len = [0] * len(self.len)
        self.summ = [s[:, :0] for s in self.summ]
        self.drawn.clear()
        self.prompt += 1
        self.step = -1


def run_probe(loaded: LoadedModel, prompts: Sequence[tuple[str, Sequence[int]]], token_budget: int,
              steps: int = 8, rules: Sequence[str] = tuple(SELECTORS), page_size: int = 16,
              progress: Callable[[str], None] | None = None) -> ProbeResult:
    """Prefill each (label, token ids) prompt, then ``steps`` greedy decode steps under full attention,
    scoring every rule at every step and layer."""
    cfg = loaded.config
    sel = SelectionConfig(token_budget=token_budget, page_size=page_size)
    res = ProbeResult(loaded.model_id, token_budget, page_size, steps)
    capacity = max(len(p) for _, p in prompts) + steps
    backend = _ProbeBackend(cfg, sel, capacity, rules, loaded.device, loaded.dtype)
    model = loaded.model
    with torch.inference_mode():
        for i, (label, ids) in enumerate(prompts):
            if i:
                backend.next_prompt()
            t0 = time.perf_counter()
            hidden = None
            for a in range(0, len(ids), PREFILL_CHUNK):
                chunk = torch.tensor(ids[a: a + PREFILL_CHUNK], device=loaded.device)
                hidden = model(chunk, torch.arange(a, a + len(chunk), device=loaded.device), backend)
            assert hidden is not None
            out: list[int] = []
            token = int(model.logits(hidden[-1:]).argmax(-1))
            for step in range(steps):
                out.append(token)
                backend.step = step
                pos = len(ids) + step
                hidden = model(torch.tensor([token], device=loaded.device), torch.tensor([pos], device=loaded.device),
                               backend)
                token = int(model.logits(hidden[-1:]).argmax(-1))
            res.prompts.append({"label": label, "tokens": len(ids), "pages": len(ids) // page_size,
                                "seconds": round(time.perf_counter() - t0, 1), "output": loaded.tokenizer.decode(out)})
            if progress is not None:
                progress(f"{label}: {len(ids)} tokens, {time.perf_counter() - t0:.0f} s")
    res.rows = backend.rows
    res.curves = backend.curves
    res.errors = backend.errors
    return res
