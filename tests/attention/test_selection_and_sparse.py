"""Page summaries, batched page selection and masked decode attention on constructed cases (pure torch)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvdrive.runtime.attention import (
    SelectionConfig,
    SummaryTable,
    decode_attention,
    key_bounds,
    page_scores,
    select_pages,
    selection_masks,
)

S, HKV, G, D = 4, 2, 3, 8  # page size, KV heads, query heads per KV head, head dim


def _pages(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, HKV, S, D), generator=g) * 0.3  # [n, Hkv, S, D] head-major


def _summaries(*pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch summaries [B, Hkv, Pmax, 2D] (zero padded) and page counts [B]."""
    pmax = max(p.shape[0] for p in pages)
    out = torch.zeros((len(pages), HKV, pmax, 2 * D))
    for i, p in enumerate(pages):
        out[i, :, : p.shape[0]] = key_bounds(p).transpose(0, 1)
    return out, torch.tensor([p.shape[0] for p in pages])


def test_summary_bound_is_an_upper_bound_of_every_key_score() -> None:
    """For any query, a page's bound is >= the best q.k/sqrt(D) of its keys (per head)."""
    k = _pages(20, seed=1)
    b = key_bounds(k)  # [P, Hkv, 2D]: center then radius
    kmax, kmin = b[..., :D] + b[..., D:], b[..., :D] - b[..., D:]
    q = torch.randn((HKV * G, D), generator=torch.Generator().manual_seed(2))
    qg = q.view(HKV, G, D)
    true = torch.einsum("hgd,phsd->phgs", qg, k).amax(-1) / math.sqrt(D)  # [P, Hkv, G]
    lo = torch.einsum("hgd,phd->phg", qg.clamp(max=0), kmin)
    hi = torch.einsum("hgd,phd->phg", qg.clamp(min=0), kmax)
    assert torch.all((lo + hi) / math.sqrt(D) >= true - 1e-6)
    assert torch.allclose(kmax, k.amax(dim=2)) and torch.allclose(kmin, k.amin(dim=2))


def test_selection_finds_the_pages_that_match_the_query() -> None:
    """Three pages hold a key aligned with the query of one head: they are selected, along with the
    sink page and the recent window, and nothing beyond the budget."""
    n = 40
    k = _pages(n, seed=3)
    q = torch.zeros((1, HKV * G, D))
    q[0, 4, :] = 1.0  # query head 4 (KV head 1) looks along the all-ones direction
    hot = [7, 19, 26]
    for p in hot:
        k[p, 1, 2, :] = 3.0  # one key of KV head 1 in each hot page
    summ, npages = _summaries(k)
    cfg = SelectionConfig(token_budget=12 * S, page_size=S, sink_pages=1, recent_pages=4)
    masks = selection_masks(npages, n, cfg)
    idx, near, _ = select_pages(q, summ, masks, cfg, runners_up=2)
    sel = idx[0].tolist()
    assert len(sel) == cfg.budget_pages == 11 and sel == sorted(sel)
    assert set(hot) <= set(sel)
    assert 0 in sel and set(range(n - 4, n)) <= set(sel)
    assert near.shape == (1, 2) and not set(near[0].tolist()) & set(sel)
    scores = page_scores(q, summ, masks)[0]
    assert scores[hot].min() > scores[[p for p in range(1, n - 4) if p not in hot]].max()


def test_a_short_sequence_in_a_long_batch_takes_all_its_pages_first() -> None:
    """Batched selection: a 5-page sequence next to a 40-page one selects its 5 pages (in order, first),
    the rest of its row points past its pages; the long one selects budget_pages distinct pages."""
    long, short = _pages(40, seed=4), _pages(5, seed=5)
    summ, npages = _summaries(long, short)
    cfg = SelectionConfig(token_budget=12 * S, page_size=S)
    q = torch.randn((2, HKV * G, D), generator=torch.Generator().manual_seed(6))
    idx, _, _ = select_pages(q, summ, selection_masks(npages, 40, cfg), cfg)
    assert idx[1, :5].tolist() == [0, 1, 2, 3, 4] and bool((idx[1, 5:] >= 5).all())
    assert len(set(idx[0].tolist())) == cfg.budget_pages and bool((idx[0] < 40).all())


def test_decode_attention_with_masks_equals_dense_attention_per_sequence() -> None:
    """Batched masked decode attention equals SDPA over each sequence's own keys; each head's
    probabilities over the attended keys sum to 1 and masked keys get none."""
    g = torch.Generator().manual_seed(5)
    lens, t = [13, 7, 21], 24
    q = torch.randn((3, HKV * G, D), generator=g)
    k = torch.randn((3, HKV, t, D), generator=g)
    v = torch.randn((3, HKV, t, D), generator=g)
    mask = torch.arange(t)[None, :] >= torch.tensor(lens)[:, None]  # [B, T]
    out, probs = decode_attention(q, k, v, mask[:, None, None, :])
    for i, n in enumerate(lens):
        ref = F.scaled_dot_product_attention(q[i][:, None], k[i, :, :n], v[i, :, :n], enable_gqa=True)[:, 0]
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)
        assert torch.allclose(probs[i].sum(-1), torch.ones(HKV, G), atol=1e-5)
        assert float(probs[i, :, :, n:].abs().sum()) == 0.0


def test_a_16_bit_cache_attends_like_float32_over_the_same_rounded_values() -> None:
    """K and V kept in float16 or bfloat16: the result is float32 attention over those values (float16 is
    computed in float32 on a CPU; bfloat16 multiplies in its own dtype), returned in the query's dtype."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn((2, HKV * G, D), generator=g)
    k, v = torch.randn((2, HKV, 40, D), generator=g), torch.randn((2, HKV, 40, D), generator=g)
    for dtype, tol in ((torch.float16, 1e-5), (torch.bfloat16, 2e-2)):
        k16, v16 = k.to(dtype), v.to(dtype)
        out, probs = decode_attention(q, k16, v16)
        ref, _ = decode_attention(q, k16.float(), v16.float())
        assert out.dtype == torch.float32 and probs.dtype == torch.float32
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_a_page_that_drew_attention_last_step_keeps_its_place_when_its_bound_ranks_low() -> None:
    """The pass-key case at 32K in miniature: one page's box is tight around a key that matches the query a
    little, while looser boxes elsewhere have bounds above it, so the bounds alone leave it out. Given the
    mass it drew at the previous step it is selected; the carried mass only adds to the estimate, so the
    pages the bounds favour most are still selected."""
    n, needle = 40, 17
    k = _pages(n, seed=7) * 4.0  # loose boxes: spread keys
    k[needle] = 0.0
    k[needle, 0, :, :] = 0.4  # a tight box whose keys align with the query
    q = torch.zeros((1, HKV * G, D))
    q[0, :G, :] = 1.0  # the query heads of KV head 0 look along the all-ones direction
    summ, npages = _summaries(k)
    cfg = SelectionConfig(token_budget=10 * S, page_size=S, sink_pages=1, recent_pages=4)
    masks = selection_masks(npages, n, cfg)
    alone, _, bounds_only = select_pages(q, summ, masks, cfg)
    assert needle not in alone[0].tolist()  # the bounds rank it below the budget
    drawn = torch.zeros((1, n))
    drawn[0, needle] = 1.5  # it drew half of three heads' attention at the previous step
    idx, _, scores = select_pages(q, summ, masks, cfg, drawn=drawn)
    assert needle in idx[0].tolist()
    assert torch.equal(scores[0, needle], bounds_only[0, needle] + 1.5)
    free = [p for p in range(1, n - 4) if p != needle]  # pages neither forced nor carried
    best = max(free, key=lambda p: float(bounds_only[0, p]))
    assert best in idx[0].tolist()


def test_the_summary_table_keeps_the_last_steps_mass_per_row_and_forgets_it_when_a_page_is_rewritten() -> None:
    """``record_drawn`` replaces a row's mass (only the last step counts); writing a page's summary zeroes
    its mass, so a row reused by another sequence starts clean; growing the table keeps both."""
    t = SummaryTable(num_layers=2, num_kv_heads=HKV, head_dim=D, device=torch.device("cpu"), rows=2, pages=8)
    rows = torch.tensor([0, 1])
    # a step's attention in both layers: layer 0's pages drew nothing, layer 1's drew these
    t.record_drawn(rows, torch.tensor([[[0, 1], [0, 1]], [[1, 3], [2, 5]]]),
                   torch.tensor([[[0.0, 0.0], [0.0, 0.0]], [[0.5, 2.0], [1.0, 0.25]]]))
    assert t.drawn(1, rows, 0, 8)[0, [1, 3]].tolist() == [0.5, 2.0] and float(t.drawn(0, rows, 0, 8).abs().sum()) == 0
    t.record_drawn(torch.tensor([0]), torch.tensor([[[0, 1]], [[4, 6]]]), torch.tensor([[[0.0, 0.0]], [[0.75, 0.125]]]))
    assert t.drawn(1, torch.tensor([0]), None, 8)[0].tolist() == [0, 0, 0, 0, 0.75, 0, 0.125, 0]
    assert t.drawn(1, torch.tensor([1]), None, 8)[0, [2, 5]].tolist() == [1.0, 0.25]  # the other row is kept
    t.ensure(rows=4, pages=16)
    assert t.drawn(1, torch.tensor([1]), None, 16)[0, [2, 5]].tolist() == [1.0, 0.25]
    t.set(1, 1, 2, _pages(1), _pages(1))  # row 1's page 2 is written again (a new sequence in the row)
    assert t.drawn(1, torch.tensor([1]), None, 16)[0, [2, 5]].tolist() == [0.0, 0.25]
    t.set_all_layers(1, 5, _pages(2), _pages(2))  # a decode page that filled, every layer at once
    assert float(t.drawn(1, torch.tensor([1]), None, 16)[0, 5]) == 0.0
