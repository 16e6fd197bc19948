"""Page summaries, page selection and sparse decode attention on constructed cases (pure torch)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvdrive.runtime.attention import SelectionConfig, decode_attention, key_bounds, page_scores, select_pages

S, HKV, G, D = 4, 2, 3, 8  # page size, KV heads, query heads per KV head, head dim


def _pages(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, S, HKV, D), generator=g) * 0.3  # [n, S, Hkv, D]


def test_summary_bound_is_an_upper_bound_of_every_key_score() -> None:
    """For any query, a page's bound is >= the best q.k/sqrt(D) of its keys (per head)."""
    k = _pages(20, seed=1)
    kmin, kmax = key_bounds(k)
    q = torch.randn((HKV * G, D), generator=torch.Generator().manual_seed(2))
    qg = q.view(HKV, G, D)
    true = torch.einsum("hgd,pshd->phgs", qg, k).amax(-1) / math.sqrt(D)  # [P, Hkv, G]
    lo = torch.einsum("hgd,phd->phg", qg.clamp(max=0), kmin)
    hi = torch.einsum("hgd,phd->phg", qg.clamp(min=0), kmax)
    assert torch.all((lo + hi) / math.sqrt(D) >= true - 1e-6)


def test_selection_finds_the_pages_that_match_the_query() -> None:
    """Three pages hold a key aligned with the query of one head: they are selected, along with the
    sink page and the recent window, and nothing beyond the budget."""
    n = 40
    k = _pages(n, seed=3)
    q = torch.zeros((HKV * G, D))
    q[4, :] = 1.0  # query head 4 (KV head 1) looks along the all-ones direction
    hot = [7, 19, 26]
    for p in hot:
        k[p, 2, 1, :] = 3.0  # one key of KV head 1 in each hot page
    kmin, kmax = key_bounds(k)
    cfg = SelectionConfig(token_budget=12 * S, page_size=S, sink_pages=1, recent_pages=4)
    sel = select_pages(q, kmin, kmax, cfg).tolist()
    assert len(sel) == cfg.budget_pages == 11 and sel == sorted(sel)
    assert set(hot) <= set(sel)
    assert 0 in sel and set(range(n - 4, n)) <= set(sel)
    scores = page_scores(q, kmin, kmax)
    assert scores[hot].min() > scores[[p for p in range(1, n - 4) if p not in hot]].max()


def test_everything_is_selected_when_it_fits_the_budget() -> None:
    k = _pages(5)
    kmin, kmax = key_bounds(k)
    cfg = SelectionConfig(token_budget=1024, page_size=S)
    assert select_pages(torch.randn(HKV * G, D), kmin, kmax, cfg).tolist() == [0, 1, 2, 3, 4]


def test_sparse_attention_over_all_pages_equals_dense_attention() -> None:
    """Batched decode attention with padding equals SDPA per sequence; mass sums to the head count."""
    g = torch.Generator().manual_seed(5)
    lens = [13, 7, 21]
    q = torch.randn((3, HKV * G, D), generator=g)
    ks = [torch.randn((t, HKV, D), generator=g) for t in lens]
    vs = [torch.randn((t, HKV, D), generator=g) for t in lens]
    out, mass = decode_attention(q, ks, vs)
    for i, t in enumerate(lens):
        ref = F.scaled_dot_product_attention(q[i][:, None], ks[i].transpose(0, 1), vs[i].transpose(0, 1),
                                             enable_gqa=True)[:, 0]
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)
        assert mass[i].shape == (t,)
        assert abs(float(mass[i].sum()) - HKV * G) < 1e-4
