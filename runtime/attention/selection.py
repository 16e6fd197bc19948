"""Page selection under a token budget, batched: which sealed pages each decode query attends to.

Per (sequence, layer): the first ``sink_pages`` pages (attention sinks) and the last ``recent_pages``
sealed pages are always kept; the rest of the budget goes to the pages with the highest estimated
attention mass. Pages are shared by all KV heads, so a page's score adds up, over the query heads, the
mass the head's Quest bounds give it (a softmax of the bounds over the pages): a head that attends
sharply puts its whole weight on few pages, a head that attends evenly spreads it thin, so a page
matters when some head may attend to it strongly. To that estimate each page adds the mass it really drew
at the layer's previous decode step (``drawn``, exact for the pages that step selected, zero for the rest):
a bound over a 16-key box is loose, and at 32K tokens (~2,000 pages) the page holding a pass key ranked
below the 63 a 1,024-token budget keeps in 5 of 27 (step, layer) cases of one prompt although it drew
over half of a layer's attention one step before; carried over, it stays while it still draws attention
(docs/attention.md). The open (partial) tail page is always attended and not counted here. One layer's
selection for the whole decode batch is one ``bmm``, one softmax and one ``topk``; sequences shorter than
the budget take all their pages, in order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .summaries import unpack_codes

SELECTION_CARRIES = ("layer", "shared", "shared+neighbours")  # what --selection-carry names
SELECTION_RESTS = ("drop", "means", "sketch")  # what --selection-rest names: the pages a decode step leaves out
NEIGHBOUR_SHARE = 0.5  # shared+neighbours: the share of a neighbour page's carried mass a page adds


def resolve_rest(rest: str, sketch_bits: int) -> str:
    """``--selection-rest`` in effect: ``auto`` is ``sketch`` (the left-out pages from their sketches: RULER's
    aggregation tasks need them, docs/attention.md) where there is a key sketch, ``drop`` under the box bound
    (``sketch_bits`` 0); anything else as given (``KVCache`` checks it)."""
    if rest == "auto":
        return "sketch" if sketch_bits else "drop"
    return rest


@dataclass(frozen=True)
class SelectionConfig:
    token_budget: int = 1024  # tokens attended per decode query, sinks, recent window and tail included
    page_size: int = 16
    sink_pages: int = 1
    recent_pages: int = 4
    radius_scale: float = 1.0  # the box radius' weight in a page's bound (1: Quest's upper bound; docs/attention.md)
    shared_carry: bool = False  # each page also carries the most mass it drew at any layer's previous step
    neighbour_carry: float = 0.0  # and this share of that of the pages before and after it (with shared_carry)
    sketch_bits: int = 0  # 8 or 4: score pages by the attention the quantised keys predict (summaries.py), not bounds
    rest: str = "drop"  # the pages left out: dropped, or one column from their mean values or their sketches

    @property
    def budget_pages(self) -> int:
        """Sealed pages that may be selected (one page of the budget is the open tail)."""
        return max(self.sink_pages + self.recent_pages, self.token_budget // self.page_size - 1)


@dataclass(frozen=True)
class SelectionMasks:
    """The parts of a batch's selection fixed for a whole step: which pages exist and which are forced."""

    invalid: torch.Tensor | None  # [B, Pmax] bool: page index >= the sequence's sealed pages (None: none is)
    forced: torch.Tensor  # [B, Pmax] bool: sinks and the recent window (of existing pages)


def selection_masks(npages: torch.Tensor, pmax: int, cfg: SelectionConfig) -> SelectionMasks:
    """npages [B] int64 (sealed pages per sequence) -> the step's masks."""
    p = torch.arange(pmax, device=npages.device)[None, :]
    n = npages[:, None]
    forced = (p < cfg.sink_pages) | ((p >= n - cfg.recent_pages) & (p < n))
    invalid = p >= n
    return SelectionMasks(invalid if bool(invalid.any()) else None, forced)


def sketch_logits(qg: torch.Tensor, summaries: torch.Tensor, codes: torch.Tensor, bits: int) -> torch.Tensor:
    """qg [B, Hkv, G, D] (scaled queries); summaries [B, Hkv, P, 2D]; codes [B, Hkv, P, D * bits / 8, S] (the
    key sketch) -> [B, Hkv, G, P]: each page's log-sum-exp of its sketched keys' scores, the log of the
    unnormalised attention weight the sketch predicts for it (a key is ``kmin + code * step``, so
    q.k = q.kmin + (q * step).code)."""
    d = qg.shape[-1]
    c, r = summaries[..., :d], summaries[..., d:]  # [B, Hkv, P, D]
    step = r * (2.0 / ((1 << bits) - 1))
    base = torch.matmul(qg, (c - r).transpose(-1, -2))  # [B, Hkv, G, P]: q . kmin
    qs = qg[:, :, None] * step[:, :, :, None]  # [B, Hkv, P, G, D]
    tok = torch.matmul(qs, unpack_codes(codes, bits))  # [B, Hkv, P, G, S]
    return torch.logsumexp(tok, dim=-1).transpose(2, 3) + base  # [B, Hkv, G, P]


@dataclass(frozen=True)
class SketchWeights:
    """The softmax over every sealed page's keys that the key sketch predicts for a batch's decode queries."""

    share: torch.Tensor  # [B, Hkv, G, P] float32: each page's share (0 for the pages a sequence lacks)
    log_total: torch.Tensor  # [B, Hkv, G] float32: log of the sketched keys' sum of exp(q.k / sqrt(D))


def sketch_weights(q: torch.Tensor, summaries: torch.Tensor, codes: torch.Tensor, bits: int,
                   invalid: torch.Tensor | None) -> SketchWeights:
    """q [B, Hq, D]; summaries [B, Hkv, P, 2D]; codes [B, Hkv, P, D * bits / 8, S]; invalid [B, P] or None ->
    each page's share of a softmax over every sketched key (the softmax over pages of their log-sum-exps),
    and that softmax's log normaliser."""
    b, hq, d = q.shape
    hkv = summaries.shape[1]
    qg = q.float().view(b, hkv, hq // hkv, d) * (1.0 / math.sqrt(d))
    lse = sketch_logits(qg, summaries, codes, bits)
    if invalid is not None:
        lse.masked_fill_(invalid[:, None, None, :], float("-inf"))
    total = torch.logsumexp(lse, dim=-1)  # [B, Hkv, G]
    return SketchWeights(torch.exp(lse - total[..., None]), total)


def rest_of_pages(weights: SketchWeights, selected: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``--selection-rest means``. weights (``sketch_weights``); selected [B, K] page indices; values [B, Hkv,
    P, D] (each page's mean value, ``SummaryTable.value_summary``) -> (lse [B, Hkv, G], mean [B, Hkv, G, D]):
    the pages a selection left out as one attention column, its logit the log of the weight the sketch
    predicts they draw together and its value their mean values weighed by it (-inf and 0 when nothing was
    left out).

    Why: a top-K selection renormalises attention over what it kept, so whatever the query spreads thinly over
    many pages (counting, aggregation) is dropped. Attention over kept pages and this column is exact for the
    kept ones and, for the rest, right to within how far a page's values stray from their mean
    (docs/attention.md)."""
    b, hkv, g, _ = weights.share.shape
    left = weights.share.scatter(3, selected[:, None, None, :].expand(b, hkv, g, selected.shape[1]), 0.0)
    w = left.sum(dim=-1)  # [B, Hkv, G]
    mean = torch.matmul(left, values.float()) / w.clamp_min(1e-30)[..., None]
    return weights.log_total + torch.log(w), mean


def sketched_rest(q: torch.Tensor, summaries: torch.Tensor, codes: torch.Tensor, bits: int, vbox: torch.Tensor,
                  vcodes: torch.Tensor, selected: torch.Tensor,
                  invalid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``--selection-rest sketch``. q [B, Hq, D]; summaries [B, Hkv, P, 2D] and codes [B, Hkv, P, D * bits / 8,
    S] (the key sketch); vbox [B, Hkv, P, 2D] and vcodes [B, Hkv, P, S, D] (the values' 8-bit sketch);
    selected [B, K]; invalid [B, P] or None -> (lse [B, Hkv, G], mean [B, Hkv, G, D]): the pages a selection
    left out as one attention column, every one of their keys and values as its sketch gives it: attention
    over the kept pages and this column is full attention over a KV whose left-out part is quantised to the
    sketches' bits (-inf and 0 when nothing was left out)."""
    b, hq, d = q.shape
    hkv, p = summaries.shape[1], summaries.shape[2]
    g = hq // hkv
    qg = q.float().view(b, hkv, g, d) * (1.0 / math.sqrt(d))
    c, r = summaries[..., :d], summaries[..., d:]
    base = torch.matmul(qg, (c - r).transpose(-1, -2))  # [B, Hkv, G, P]: q . kmin
    qs = qg[:, :, None] * (r * (2.0 / ((1 << bits) - 1)))[:, :, :, None]  # [B, Hkv, P, G, D]
    tok = torch.matmul(qs, unpack_codes(codes, bits)) + base.transpose(2, 3)[..., None]  # [B, Hkv, P, G, S]
    out = torch.zeros(b, p, dtype=torch.bool, device=q.device).scatter_(1, selected.clamp(max=p - 1), True)
    if invalid is not None:
        out |= invalid
    tok.masked_fill_(out[:, None, :, None, None], float("-inf"))
    m = tok.amax(dim=(2, 4)).clamp_min(-1e30)  # [B, Hkv, G] (finite when nothing is left)
    e = torch.exp(tok - m[:, :, None, :, None])  # [B, Hkv, P, G, S]
    w = e.sum(dim=(2, 4))  # [B, Hkv, G]
    vc, vr = vbox[..., :d], vbox[..., d:]  # [B, Hkv, P, D]
    vstep = vr * (2.0 / 255)
    ec = torch.matmul(e, vcodes.float())  # [B, Hkv, P, G, D]: sum_t e_t code_t
    num = torch.einsum("bhpg,bhpd->bhgd", e.sum(dim=-1), vc - vr) + torch.einsum("bhpgd,bhpd->bhgd", ec, vstep)
    return m + torch.log(w), num / w.clamp_min(1e-30)[..., None]


def page_scores(q: torch.Tensor, summaries: torch.Tensor, masks: SelectionMasks,
                drawn: torch.Tensor | None = None, radius_scale: float = 1.0,
                codes: torch.Tensor | None = None, bits: int = 0,
                weights: SketchWeights | None = None) -> torch.Tensor:
    """q [B, Hq, D]; summaries [B, Hkv, P, 2D] (center, radius); drawn [B, P] (the mass each page drew at the
    previous step, or None); codes [B, Hkv, P, D * bits / 8, S] (the key sketch, or None); weights (the
    sketch's, computed already, or None) -> score [B, P] float32: estimated attention mass summed over heads,
    plus ``drawn``; forced pages +inf, missing pages -inf. Without a sketch a head's mass is a softmax of the
    pages' bounds (``radius_scale`` weighs the radius term; 1: the bound); with one, its softmax over the
    sketched keys, summed per page."""
    b, hq, d = q.shape
    hkv = summaries.shape[1]
    qg = q.float().view(b, hkv, hq // hkv, d) * (1.0 / math.sqrt(d))
    if weights is None and codes is not None:
        weights = sketch_weights(q, summaries, codes, bits, masks.invalid)
    if weights is not None:
        mass = weights.share.sum(dim=(1, 2))
    else:
        qa = qg.abs() if radius_scale == 1.0 else qg.abs() * radius_scale
        qc = torch.cat([qg, qa], dim=-1)  # [B, Hkv, G, 2D]: q meets the center, |q| the radius
        bound = torch.matmul(qc, summaries.transpose(-1, -2))  # [B, Hkv, G, P]: at scale 1, >= every q.k / sqrt(D)
        if masks.invalid is not None:
            bound.masked_fill_(masks.invalid[:, None, None, :], float("-inf"))
        mass = torch.softmax(bound, dim=-1).sum(dim=(1, 2))
    if drawn is not None:
        mass += drawn
    if masks.invalid is not None:
        mass.masked_fill_(masks.invalid, float("-inf"))
    return mass.masked_fill_(masks.forced, float("inf"))


def select_pages(q: torch.Tensor, summaries: torch.Tensor, masks: SelectionMasks, cfg: SelectionConfig,
                 runners_up: int = 0, drawn: torch.Tensor | None = None,
                 codes: torch.Tensor | None = None,
                 weights: SketchWeights | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Selected pages [B, K] int64 ascending (K = budget_pages; a sequence with fewer pages has them all
    first, then indices >= its page count), the next ``runners_up`` pages by score [B, R] (the pages most
    likely to enter the selection at the next step: what prefetch fetches from the slow tiers) and every
    page's score [B, Pmax] (``page_scores``; ``codes`` the key sketch when ``cfg.sketch_bits``, or its
    ``weights`` computed already)."""
    k = cfg.budget_pages
    scores = page_scores(q, summaries, masks, drawn, cfg.radius_scale, codes, cfg.sketch_bits, weights)
    top = torch.topk(scores, min(scores.shape[1], k + runners_up), dim=1, sorted=True).indices
    return torch.sort(top[:, :k], dim=1).values, top[:, k:], scores
