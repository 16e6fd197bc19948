"""The pages a decode step leaves out (``--selection-rest means|sketch``): attended as one column instead of
being dropped from the softmax, either each page as its mean value at the weight the key sketch predicts
for it, or each of their keys and values as 8-bit sketches give them. What the table keeps, how close each
brings sparse attention to full attention where attention is spread thin, and that the flag runs end to
end and is refused without a key sketch."""

from __future__ import annotations

import math

import pytest
import torch
from enginekit import greedy

from kvdrive.runtime.attention import (
    SelectionConfig,
    SummaryTable,
    decode_attention,
    resolve_rest,
    rest_of_pages,
    select_pages,
    selection_masks,
    sketch_weights,
    sketched_rest,
)
from kvdrive.runtime.attention.summaries import key_bounds, key_codes, value_codes
from kvdrive.runtime.cli import engine_config, parse_args
from kvdrive.runtime.model import LoadedModel

HKV, G, D, S = 2, 3, 32, 16


def _paged(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [P, Hkv, S, D] -> summaries [1, Hkv, P, 2D] and the 8-bit sketch [1, Hkv, P, D, S]."""
    bounds = key_bounds(keys)
    return bounds.transpose(0, 1)[None], key_codes(keys, bounds, 8).transpose(0, 1)[None]


@pytest.mark.parametrize("rest", ["means", "sketch"])
def test_the_table_keeps_each_pages_values_summary_for_prompt_and_decode_pages(rest: str) -> None:
    table = SummaryTable(2, HKV, D, torch.device("cpu"), rows=1, pages=2, page_size=S, sketch_bits=8, rest=rest)
    k, v = torch.randn(3, HKV, S, D), torch.randn(3, HKV, S, D)  # three prompt pages of layer 1
    table.ensure(2, 5)
    table.set(1, 1, 0, k, v)
    lk, lv = torch.randn(2, HKV, S, D), torch.randn(2, HKV, S, D)  # a decode page that filled, both layers
    table.set_all_layers(1, 3, lk, lv)
    table.ensure(2, 9)  # growing keeps them
    got = table.value_summary(1, torch.tensor([1]), 1, 4)
    assert got is not None
    vals, vcodes = got
    box, sketch = table.bytes_per_token()
    if rest == "means":
        assert vcodes is None and vals.shape == (1, HKV, 4, D)
        assert torch.allclose(vals[0, :, :3], v.mean(dim=2).transpose(0, 1), atol=1e-6)
        assert torch.allclose(vals[0, :, 3], lv[1].mean(dim=1), atol=1e-6)
        assert box == 2 * HKV * (2 * D + D) * 4 // S and sketch == 2 * HKV * D  # + the mean value; the key sketch
    else:
        assert vcodes is not None and vals.shape == (1, HKV, 4, 2 * D) and vcodes.shape == (1, HKV, 4, S, D)
        both = torch.cat([v, lv[1:]])  # [4, Hkv, S, D]
        assert torch.equal(vals[0], key_bounds(both).transpose(0, 1))
        assert torch.equal(vcodes[0], key_codes(both, key_bounds(both), 8).transpose(-1, -2).transpose(0, 1))
        assert box == 2 * HKV * 4 * D * 4 // S and sketch == 2 * HKV * 2 * D  # key and value boxes; both sketches
    assert SummaryTable(2, HKV, D, torch.device("cpu")).value_summary(0, torch.tensor([0]), None, 1) is None
    with pytest.raises(ValueError, match="rest 'guess'"):
        SummaryTable(2, HKV, D, torch.device("cpu"), rest="guess")


def test_attention_spread_over_many_pages_comes_back_with_the_rest_and_not_without_it() -> None:
    """Every page holds keys of about the same score and one value per page (what counting and aggregation
    look like): a 12-page selection of 96 keeps an eighth of the mass, so dropping the rest gives the mean of
    the kept pages' values; the rest column brings the output to full attention's, within the sketch's error."""
    g = torch.Generator().manual_seed(0)
    p = 96
    keys = torch.randn(p, HKV, S, D, generator=g) * 0.3
    vals = torch.randn(p, HKV, 1, D, generator=g).expand(p, HKV, S, D).contiguous()  # one value per page
    q = torch.randn(1, HKV * G, D, generator=g)
    summ, codes = _paged(keys)
    cfg = SelectionConfig(token_budget=13 * S, page_size=S, sketch_bits=8)
    masks = selection_masks(torch.tensor([p]), p, cfg)
    weights = sketch_weights(q, summ, codes, 8, masks.invalid)
    idx, _, _ = select_pages(q, summ, masks, cfg, weights=weights)
    assert idx.shape == (1, 12)
    k_all = keys.transpose(0, 1).reshape(1, HKV, p * S, D)
    v_all = vals.transpose(0, 1).reshape(1, HKV, p * S, D)
    full, _ = decode_attention(q, k_all, v_all)
    kept_k = keys[idx[0]].transpose(0, 1).reshape(1, HKV, -1, D)
    kept_v = vals[idx[0]].transpose(0, 1).reshape(1, HKV, -1, D)
    dropped, _ = decode_attention(q, kept_k, kept_v)
    means = vals.mean(dim=2).transpose(0, 1)[None]  # [1, Hkv, P, D]
    estimated, probs = decode_attention(q, kept_k, kept_v, rest=rest_of_pages(weights, idx, means))
    vbox = key_bounds(vals)
    vcodes = value_codes(vals, vbox).transpose(0, 1)[None]
    sketched, _ = decode_attention(q, kept_k, kept_v,
                                   rest=sketched_rest(q, summ, codes, 8, vbox.transpose(0, 1)[None], vcodes, idx, None))

    def err(x: torch.Tensor) -> float:
        return float(((x - full).norm(dim=-1) / full.norm(dim=-1)).mean())

    assert err(estimated) < 0.02 < 0.3 < err(dropped)
    assert err(sketched) < 0.02
    assert float(probs.sum(dim=-1).max()) < 0.5  # the kept pages' share: the rest drew most of it


def test_the_sketched_rest_keeps_what_each_left_out_token_holds() -> None:
    """Values that vary inside a page (one token of each page carries the signal): page means blur it, the
    value sketch keeps it, so the sketched rest stays within the 8-bit sketches' error of full attention
    where the means do not."""
    g = torch.Generator().manual_seed(2)
    p = 64
    keys = torch.randn(p, HKV, S, D, generator=g) * 0.5
    vals = torch.randn(p, HKV, S, D, generator=g) * 0.1
    vals[:, :, 3] += 4.0 * torch.randn(p, HKV, D, generator=g)  # token 3 of each page
    q = torch.randn(1, HKV * G, D, generator=g)
    keys[:, :, 3] += 0.5 * q.view(HKV, G, D).mean(dim=1)[None]  # ... which the query attends most
    summ, codes = _paged(keys)
    cfg = SelectionConfig(token_budget=9 * S, page_size=S, sketch_bits=8)
    masks = selection_masks(torch.tensor([p]), p, cfg)
    weights = sketch_weights(q, summ, codes, 8, masks.invalid)
    idx, _, _ = select_pages(q, summ, masks, cfg, weights=weights)
    full, _ = decode_attention(q, keys.transpose(0, 1).reshape(1, HKV, -1, D), vals.transpose(0, 1).reshape(1, HKV, -1, D))
    kept_k = keys[idx[0]].transpose(0, 1).reshape(1, HKV, -1, D)
    kept_v = vals[idx[0]].transpose(0, 1).reshape(1, HKV, -1, D)
    vbox = key_bounds(vals)
    rest = sketched_rest(q, summ, codes, 8, vbox.transpose(0, 1)[None], value_codes(vals, vbox).transpose(0, 1)[None],
                         idx, masks.invalid)
    sketched, _ = decode_attention(q, kept_k, kept_v, rest=rest)
    meaned, _ = decode_attention(q, kept_k, kept_v,
                                 rest=rest_of_pages(weights, idx, vals.mean(dim=2).transpose(0, 1)[None]))

    def err(x: torch.Tensor) -> float:
        return float(((x - full).norm(dim=-1) / full.norm(dim=-1)).mean())

    assert err(sketched) < 0.03 < 3 * 0.03 < err(meaned)


def test_nothing_left_out_changes_nothing() -> None:
    """A selection that keeps every page leaves a rest of weight 0 (logit -inf): the output is plain attention's."""
    g = torch.Generator().manual_seed(1)
    p = 6
    keys, vals = torch.randn(p, HKV, S, D, generator=g), torch.randn(p, HKV, S, D, generator=g)
    q = torch.randn(1, HKV * G, D, generator=g)
    summ, codes = _paged(keys)
    weights = sketch_weights(q, summ, codes, 8, None)
    lse, mean = rest_of_pages(weights, torch.arange(p)[None], vals.mean(dim=2).transpose(0, 1)[None])
    assert bool(torch.isneginf(lse).all()) and float(mean.abs().sum()) == 0.0
    k_all = keys.transpose(0, 1).reshape(1, HKV, p * S, D)
    v_all = vals.transpose(0, 1).reshape(1, HKV, p * S, D)
    plain, _ = decode_attention(q, k_all, v_all)
    with_rest, _ = decode_attention(q, k_all, v_all, rest=(lse, mean))
    assert torch.allclose(with_rest, plain, atol=1e-6)
    assert math.isfinite(float(with_rest.sum()))


def test_the_flag_reaches_the_engine_and_needs_a_sketch(capsys: pytest.CaptureFixture[str], tiny: LoadedModel) -> None:
    assert engine_config(parse_args(["serve"]), max_sequences=1).selection_rest == "auto"
    assert resolve_rest("auto", 8) == "sketch" and resolve_rest("auto", 4) == "sketch" and resolve_rest("auto", 0) == "drop"
    assert resolve_rest("means", 8) == "means"
    assert engine_config(parse_args(["serve", "--selection-rest", "means"]), max_sequences=1).selection_rest == "means"
    with pytest.raises(SystemExit):
        parse_args(["serve", "--selection-rest", "guess"])
    assert "--selection-rest: invalid choice: 'guess'" in capsys.readouterr().err
    assert engine_config(parse_args(["serve", "--selection-rest", "sketch"]), max_sequences=1).selection_rest == "sketch"
    with pytest.raises(ValueError, match="needs selection_sketch 4 or 8"):
        greedy(tiny, [1, 2, 3], 1, selection_sketch=0, selection_rest="means")


def test_an_engine_attends_the_left_out_pages_from_their_sketches_by_default(tiny: LoadedModel) -> None:
    """The default (``auto``) keeps RULER's aggregation tasks (docs/attention.md): the value sketch is kept
    and the left-out pages are attended; without a key sketch there is nothing to attend them from."""
    from kvdrive.runtime.engine import EngineConfig, ModelRunner

    for sketch, rest in ((8, "sketch"), (0, "drop")):
        gen = ModelRunner(tiny, EngineConfig(selection_sketch=sketch))
        try:
            assert gen.cache.summaries.rest == rest and (gen.cache.summaries.vcodes is not None) == (rest == "sketch")
        finally:
            gen.close()


def test_sparse_decoding_runs_with_the_rest_attended(demo: LoadedModel) -> None:
    """~40 pages under a 16-page budget, on the native kernels where they are built: tokens come out, and the
    first (from the prompt, exact) is the same as without the estimate."""
    prompt = demo.tokenizer.encode("word " * 640)[:640]
    outs = {rest: greedy(demo, prompt, 8, token_budget=256, selection_rest=rest) for rest in ("drop", "means", "sketch")}
    for rest in ("means", "sketch"):
        assert len(outs[rest]) == 8 and outs[rest][0] == outs["drop"][0]
