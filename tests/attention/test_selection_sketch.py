"""The key sketch (``--selection-sketch 8|4``): every key kept quantised inside its page's box, so a page is
scored by the attention its keys predict rather than by the box's bound. What it stores, how close its
estimate comes to exact attention, where it picks a different page than the bound, and that the flag runs
end to end."""

from __future__ import annotations

import math

import pytest
import torch
from enginekit import greedy

from kvdrive.runtime.attention import SelectionConfig, SummaryTable, select_pages, selection_masks
from kvdrive.runtime.attention.selection import sketch_weights
from kvdrive.runtime.attention.summaries import key_bounds, key_codes, unpack_codes
from kvdrive.runtime.cli import engine_config, parse_args
from kvdrive.runtime.engine import EngineConfig
from kvdrive.runtime.model import LoadedModel


@pytest.mark.parametrize("bits", [8, 4])
def test_each_key_comes_back_within_half_a_step_of_its_box(bits: int) -> None:
    torch.manual_seed(0)
    k = torch.randn(5, 2, 16, 64) * 3  # [n, Hkv, S, D]
    k[1, 0] = 0.7  # a page whose keys are all equal in head 0: a box of radius 0
    bounds = key_bounds(k)
    codes = key_codes(k, bounds, bits)
    assert codes.dtype == torch.uint8 and codes.shape == (5, 2, 64 * bits // 8, 16)
    c, r = bounds[..., None, :64], bounds[..., None, 64:]
    step = 2 * r / ((1 << bits) - 1)
    back = c - r + unpack_codes(codes, bits).transpose(-1, -2) * step
    assert bool(((back - k).abs() <= step / 2 + 1e-5).all())
    assert torch.equal(back[1, 0], k[1, 0])


@pytest.mark.parametrize(("bits", "tol"), [(8, 0.005), (4, 0.1)])
def test_the_sketch_weights_are_close_to_exact_attention(bits: int, tol: float) -> None:
    torch.manual_seed(1)
    b, hkv, g, p, s, d = 2, 2, 3, 24, 16, 64
    k = torch.randn(b, p, hkv, s, d)
    qg = torch.randn(b, hkv, g, d) / math.sqrt(d)
    bounds = key_bounds(k.flatten(0, 1)).view(b, p, hkv, -1)
    codes = key_codes(k.flatten(0, 1), bounds.flatten(0, 1), bits).view(b, p, hkv, -1, s)
    invalid = torch.zeros(b, p, dtype=torch.bool)
    invalid[1, 20:] = True  # the second sequence has 20 pages
    q = (qg * math.sqrt(d)).reshape(b, hkv * g, d)
    got = sketch_weights(q, bounds.transpose(1, 2), codes.transpose(1, 2), bits, invalid)
    for i, n in enumerate((24, 20)):
        keys = k[i, :n].permute(1, 0, 2, 3).reshape(hkv, n * s, d)
        logits = torch.einsum("hgd,htd->hgt", qg[i], keys)
        exact = torch.softmax(logits, -1).view(hkv, g, n, s).sum(-1)
        assert (got.share[i, :, :, :n] - exact).abs().max().item() < tol
        assert float(got.share[i, :, :, n:].abs().sum()) == 0.0
        assert (got.log_total[i] - torch.logsumexp(logits, -1)).abs().max().item() < 20 * tol  # the softmax's scale


def test_the_sketch_finds_the_one_key_a_loose_box_hides() -> None:
    """Page 1 holds one key aligned with the query among keys pointing away (score 12, bound 12); page 2's
    keys trade one dimension against another, so none scores above 4, but their box's corner bounds 16. The
    bound ranks page 2 first, the sketch page 1 (its key draws the attention)."""
    s, d = 4, 4
    k = torch.zeros(8, 1, s, d)  # [P, Hkv, S, D]
    k[1, 0, :, 0] = torch.tensor([3.0, -3.0, -3.0, -3.0])
    k[2, 0, :, 0] = 1.0
    k[2, 0, :, 1] = torch.tensor([6.0, -6.0, 6.0, -6.0])
    k[2, 0, :, 2] = torch.tensor([-6.0, 6.0, -6.0, 6.0])
    q = torch.tensor([[[4.0, 1.0, 1.0, 0.0]]])  # [B, Hq=1, D]
    bounds = key_bounds(k)
    summ = bounds.transpose(0, 1)[None]  # [1, Hkv, P, 2D]
    codes = key_codes(k, bounds, 8).transpose(0, 1)[None]
    picks = {}
    for bits in (0, 8):
        cfg = SelectionConfig(token_budget=7 * s, page_size=s, sink_pages=1, recent_pages=4, sketch_bits=bits)
        masks = selection_masks(torch.tensor([8]), 8, cfg)
        idx = select_pages(q, summ, masks, cfg, codes=codes if bits else None)[0][0].tolist()
        picks[bits] = ({1, 2} & set(idx)).pop()
    assert picks == {0: 2, 8: 1}


def test_the_table_keeps_codes_for_prompt_and_decode_pages_and_grows() -> None:
    table = SummaryTable(2, 2, 8, torch.device("cpu"), rows=1, pages=2, page_size=4, sketch_bits=4)
    k = torch.randn(3, 2, 4, 8)  # three prompt pages of layer 1
    table.ensure(2, 5)
    table.set(1, 1, 0, k, k)
    last = torch.randn(2, 2, 4, 8)  # a decode page that filled, both layers
    table.set_all_layers(1, 3, last, last)
    rows = torch.tensor([1])
    got = table.sketch(1, rows, 1, 4)
    assert got is not None and got.shape == (1, 2, 4, 8 * 4 // 8, 4)
    assert torch.equal(got[0, :, :3], key_codes(k, key_bounds(k), 4).transpose(0, 1))
    assert torch.equal(got[0, :, 3], key_codes(last[1:], key_bounds(last[1:]), 4)[0])
    assert table.bytes_per_token() == (2 * 2 * 16 * 4 // 4, 2 * 2 * 8 * 4 // 8)  # layers x heads x (box, codes)
    assert SummaryTable(2, 2, 8, torch.device("cpu")).sketch(0, rows, None, 1) is None
    with pytest.raises(ValueError, match="sketch_bits 3"):
        SummaryTable(2, 2, 8, torch.device("cpu"), sketch_bits=3)


def test_the_flag_reaches_the_engine_and_bad_values_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert engine_config(parse_args(["serve"]), max_sequences=1).selection_sketch == 8 == EngineConfig().selection_sketch
    assert engine_config(parse_args(["serve", "--selection-sketch", "0"]), max_sequences=1).selection_sketch == 0
    assert engine_config(parse_args(["serve", "--selection-sketch", "4"]), max_sequences=1).selection_sketch == 4
    with pytest.raises(SystemExit):
        parse_args(["serve", "--selection-sketch", "2"])
    assert "--selection-sketch: invalid choice: 2" in capsys.readouterr().err


def test_sparse_decoding_runs_with_the_sketch(demo: LoadedModel) -> None:
    """~40 pages under a 16-page budget, the sketch choosing the pages: tokens come out, the first (from the
    prompt) is the bound's."""
    prompt = demo.tokenizer.encode("word " * 640)[:640]
    outs = {bits: greedy(demo, prompt, 8, token_budget=256, selection_sketch=bits) for bits in (0, 4)}
    assert len(outs[4]) == 8 and outs[4][0] == outs[0][0]
