"""``--selection-radius``: how much a page's key-box radius counts in its selection score, from the command
line to the engine, refused out of 0..1, and what it changes in the selection."""

from __future__ import annotations

import pytest
import torch

from kvdrive.runtime.attention import SelectionConfig, select_pages, selection_masks
from kvdrive.runtime.cli import engine_config, parse_args


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
