"""``kvdrive bench selection``: the probe attends exactly (its greedy tokens are the engine's with full
attention), scores every rule at every probed step and layer, and no rule covers more attention than the
oracle that keeps the pages with the most exact mass."""

from __future__ import annotations

from collections import Counter

import pytest

from kvdrive.runtime.bench.selection_probe import SELECTORS, run_probe
from kvdrive.runtime.bench.selection_report import (
    _share_out,
    allocation,
    by_layer,
    markdown,
    output_errors,
    summary,
)
from kvdrive.runtime.bench.texts import filler_tokens
from kvdrive.runtime.engine import EngineConfig, LLMEngine, ModelRunner, SamplingParams, TierConfig
from kvdrive.runtime.model import LoadedModel


def _prompt(demo: LoadedModel, tokens: int) -> list[int]:
    return filler_tokens(demo.tokenizer, tokens, seed=3)


def test_probe_decodes_like_full_attention_and_no_rule_beats_the_oracle(demo: LoadedModel) -> None:
    ids = _prompt(demo, 400)
    res = run_probe(demo, [("doc#0", ids)], token_budget=128, steps=4)
    runner = ModelRunner(demo, EngineConfig(tiers=TierConfig(), full_attention=True, max_sequences=1))
    try:
        expected = list(LLMEngine(runner).generate_tokens(ids, SamplingParams(max_tokens=4, temperature=0.0)))
    finally:
        runner.close()
    assert res.prompts[0]["output"] == demo.tokenizer.decode(expected)
    layers = demo.config.num_layers
    assert Counter(r.rule for r in res.rows) == {rule: 4 * layers for rule in [*SELECTORS, "oracle"]}
    cover = {(r.step, r.layer, r.rule): r for r in res.rows}
    for (step, layer, rule), row in cover.items():
        assert 0.0 < row.cover_min <= row.cover_mean <= 1.0 + 1e-5 and 0.0 <= row.top_kept <= 1.0
        assert row.cover_mean <= cover[(step, layer, "oracle")].cover_mean + 1e-5, (step, layer, rule)
    rules = {s["rule"] for s in summary(res)}
    assert rules == {*SELECTORS, "oracle"} and "| doc | bounds+carry | " in markdown(res, "probe")
    layer_rows = by_layer(res)
    assert len(layer_rows) == layers * (len(SELECTORS) + 1) and all(r["cases"] == 4 for r in layer_rows)
    # the oracle's cover curves: one per (step, layer), from the forced pages' share up, never past 1
    assert len(res.curves) == 4 * layers
    for c in res.curves:
        steps = zip(c.cover, c.cover[1:], strict=False)
        assert 0.0 < c.cover[0] and all(a <= b + 1e-6 for a, b in steps) and c.cover[-1] <= 1 + 1e-5
    (shares,) = allocation(res)
    assert shares["group"] == "doc" and shares["cases"] == 3  # the steps after the first
    # sharing the same pages out by this step's masses never covers less than an even split, nor more than an
    # even split of twice the pages
    assert shares["even"] <= shares["shared"] + 1e-6 and shares["even"] <= shares["even_2x"] + 1e-6
    assert shares["shared_prev"] <= shares["shared"] + 1e-6
    assert "Budget across layers" in markdown(res, "probe")
    # the output error of the first sketch rule's selection, at every probed step and layer
    assert len(res.errors) == 4 * layers and {e.rule for e in res.errors} == {"sketch8+carry"}
    for e in res.errors:
        assert 0.0 < e.renormalised < 1.0 and 0.0 <= e.completed_exact < 1.0 and 0.0 <= e.completed_sketch < 1.0
    (errs,) = output_errors(res)
    assert errs["cases"] == 4 * layers and "+ left-out pages at exact mass" in markdown(res, "probe")


def test_pages_go_to_the_largest_gains_in_cover() -> None:
    # gains: layer 0 +0.5, +0.1, +0.02; layer 1 +0.3, +0.15, +0.05 -> three pages: 0.5, 0.3, 0.15
    assert _share_out([(0.0, 0.5, 0.6, 0.62), (0.0, 0.3, 0.45, 0.5)], 3) == [1, 2]
    assert _share_out([(0.0, 0.5, 0.6, 0.62), (0.0, 0.3, 0.45, 0.5)], 6) == [3, 3]


def test_a_budget_that_holds_the_prompt_probes_nothing(demo: LoadedModel) -> None:
    res = run_probe(demo, [("short", _prompt(demo, 100))], token_budget=1024, steps=2)
    assert res.rows == [] and res.prompts[0]["tokens"] == 100


def test_models_with_sliding_window_layers_are_refused(demo: LoadedModel) -> None:
    from dataclasses import replace

    sliding = replace(demo, config=replace(demo.config, sliding_layers=(0,), sliding_window=8))
    with pytest.raises(ValueError, match="sliding-window layers"):
        run_probe(sliding, [("x", _prompt(demo, 50))], token_budget=32)
