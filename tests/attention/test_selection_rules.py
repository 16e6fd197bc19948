"""The selection rules a server can be given: ``--selection-radius`` (how much a page's key-box radius counts
in its score) and ``--selection-carry`` (which previous-step attention a page carries): from the command line
to the engine, bad values refused, and what each changes."""

from __future__ import annotations

import pytest
import torch
from enginekit import greedy

from kvdrive.runtime.attention import SelectionConfig, SummaryTable, select_pages, selection_masks
from kvdrive.runtime.cli import engine_config, parse_args
from kvdrive.runtime.model import LoadedModel


def test_the_flag_reaches_the_engine_and_bad_values_are_refused() -> None:
    assert engine_config(parse_args(["serve"]), max_sequences=1).selection_radius == 1.0
    assert engine_config(parse_args(["serve", "--selection-radius", "0.5"]), max_sequences=1).selection_radius == 0.5
    with pytest.raises(ValueError, match="--selection-radius 1.5: expected a number from 0 to 1"):
        engine_config(parse_args(["serve", "--selection-radius", "1.5"]), max_sequences=1)


def test_a_smaller_radius_trusts_the_box_centers() -> None:
    """A page whose box is wide but whose center is far from the query wins under the bound; with the radius
    weighed less, the page whose center the query meets wins."""
    d = 4
    q = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]]) * 2.0  # [B=1, Hq=1, D]
    summ = torch.zeros(1, 1, 8, 2 * d)  # [B, Hkv, P, 2D]: pages 0 (sink) and 4..7 (recent) are forced anyway
    summ[0, 0, 1, :d] = torch.tensor([0.5, 0, 0, 0])  # center meets q, tight box
    summ[0, 0, 2, :d] = torch.tensor([-3.0, 0, 0, 0])  # center opposite q ...
    summ[0, 0, 2, d:] = torch.tensor([4.0, 0, 0, 0])  # ... but a box wide enough to bound a key at +1.0
    picks = {}
    for radius in (1.0, 0.25):
        cfg = SelectionConfig(token_budget=7 * 4, page_size=4, sink_pages=1, recent_pages=4, radius_scale=radius)
        masks = selection_masks(torch.tensor([8]), 8, cfg)
        idx = select_pages(q, summ, masks, cfg)[0][0].tolist()
        picks[radius] = ({1, 2} & set(idx)).pop()
    assert picks == {1.0: 2, 0.25: 1}


def test_the_carry_flag_reaches_the_engine_and_bad_values_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert engine_config(parse_args(["serve"]), max_sequences=1).selection_carry == "layer"
    args = parse_args(["serve", "--selection-carry", "shared+neighbours"])
    assert engine_config(args, max_sequences=1).selection_carry == "shared+neighbours"
    with pytest.raises(SystemExit):
        parse_args(["serve", "--selection-carry", "all"])
    assert "--selection-carry: invalid choice: 'all'" in capsys.readouterr().err


def test_the_shared_carry_is_the_most_any_layer_drew_plus_its_neighbours_share() -> None:
    table = SummaryTable(3, 1, 4, torch.device("cpu"), rows=2, pages=6)
    table.mass[0, 1] = torch.tensor([0.0, 2.0, 0.0, 0.0, 0.0, 0.0])
    table.mass[2, 1] = torch.tensor([0.0, 0.5, 0.0, 0.0, 3.0, 0.0])
    rows = torch.tensor([1])
    assert table.shared_drawn(rows, 1, 6, 0.0).tolist() == [[0.0, 2.0, 0.0, 0.0, 3.0, 0.0]]
    assert table.shared_drawn(rows, None, 6, 0.5).tolist() == [[1.0, 2.0, 1.0, 1.5, 3.0, 1.5]]


@pytest.mark.parametrize("carry", ["shared", "shared+neighbours"])
def test_sparse_decoding_runs_under_each_carry(demo: LoadedModel, carry: str) -> None:
    """A prompt of ~40 pages under a 16-page budget decodes with the shared carry (the native kernels where this
    host has them): tokens come out, and the first two (from the prompt, then from the first decode step, when
    no layer has drawn anything yet) are the default rule's."""
    prompt = demo.tokenizer.encode("word " * 640)[:640]
    outs = {rule: greedy(demo, prompt, 8, token_budget=256, selection_carry=rule) for rule in ("layer", carry)}
    assert len(outs[carry]) == 8 and outs[carry][:2] == outs["layer"][:2]
