"""Page selection under a token budget: which sealed pages a decode query attends to.

Per (sequence, layer): the first ``sink_pages`` pages (attention sinks) and the last
``recent_pages`` sealed pages are always kept; the rest of the budget goes to the pages with the
highest upper bound of q.k (``summaries``). Pages are shared by all KV heads, so a page's score adds up,
over the query heads, the attention mass the head's bounds give it (a softmax of the bounds over the
pages): a head that attends sharply puts its whole weight on few pages, a head that attends evenly
spreads it thin, so a page matters when some head may attend to it strongly. The open (partial) tail page is always attended and not counted here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SelectionConfig:
    token_budget: int = 1024  # tokens attended per decode query, sinks, recent window and tail included
    page_size: int = 16
    sink_pages: int = 1
    recent_pages: int = 4

    @property
    def budget_pages(self) -> int:
        """Sealed pages that may be selected (one page of the budget is the open tail)."""
        return max(self.sink_pages + self.recent_pages, self.token_budget // self.page_size - 1)


def page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """q [Hq, D]; kmin, kmax [P, Hkv, D] -> score [P] (float32): estimated attention mass, summed over heads."""
    hq, d = q.shape
    hkv = kmin.shape[1]
    qg = q.float().view(hkv, hq // hkv, d)  # [Hkv, G, D]
    lo = torch.einsum("hgd,phd->phg", qg.clamp(max=0), kmin)  # negative q_d pair with kmin
    hi = torch.einsum("hgd,phd->phg", qg.clamp(min=0), kmax)
    bound = (lo + hi) / math.sqrt(d)  # [P, Hkv, G]: max over the page's keys of q.k / sqrt(D) is <= bound
    return torch.softmax(bound.flatten(1), dim=0).sum(dim=1)  # per head: mass estimate over pages; summed


def select_pages(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, cfg: SelectionConfig) -> torch.Tensor:
    """Indices of the selected sealed pages, ascending: [k] int64 (all pages when they fit the budget)."""
    return select_with_runners_up(q, kmin, kmax, cfg, 0)[0]


def select_with_runners_up(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, cfg: SelectionConfig,
                           runners_up: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Selected pages (ascending, [k] int64) and the next ``runners_up`` pages by score: the pages most
    likely to enter the selection at the next step (what prefetch fetches from the slow tiers)."""
    p = kmin.shape[0]
    budget = cfg.budget_pages
    empty = torch.empty(0, dtype=torch.int64, device=kmin.device)
    if p <= budget:
        return torch.arange(p, device=kmin.device), empty
    scores = page_scores(q, kmin, kmax)
    forced = torch.zeros(p, dtype=torch.bool, device=kmin.device)
    forced[: cfg.sink_pages] = True
    forced[max(0, p - cfg.recent_pages) :] = True
    scores = scores.masked_fill(forced, float("inf"))
    top = torch.topk(scores, min(p, budget + runners_up)).indices
    return torch.sort(top[:budget]).values, top[budget:]
