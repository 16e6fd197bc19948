"""The accuracy benchmark on a tiny random model: structure, the full-vs-full self-check, sparse is active."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvdrive.runtime.bench.accuracy_bench import (
    AccuracyBenchResult,
    kl_divergence,
    run_accuracy_benches,
)
from kvdrive.runtime.bench.accuracy_report import as_dict, plot, table
from kvdrive.runtime.model import LoadedModel, load_model

TINY = dict(contexts=(320, 448), depths=(0.25, 0.75), keys_per_depth=1, chat_prompts=("Hi?", "Why?", "Who?"),
            doc_tokens=(160, 240), passkey_tokens=6, chat_tokens=8, page_size=16)


@pytest.fixture
def tiny(hf_model_factory: Callable[..., tuple[Path, torch.nn.Module]]) -> Iterator[LoadedModel]:
    path, _ = hf_model_factory(max_position_embeddings=1024, num_hidden_layers=2, seed=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model gains nothing from more; on a busy host they only contend
    try:
        yield load_model(str(path), progress=False)
    finally:
        torch.set_num_threads(threads)


def _check_structure(r: AccuracyBenchResult) -> None:
    kinds = [c.kind for c in r.cases]
    assert kinds.count("passkey") == 4 and kinds.count("chat") == 3 and kinds.count("document") == 3
    for c in r.cases:
        assert len(c.kl) == c.reference_tokens >= 1
        assert (c.first_divergence is None) == c.identical
        assert (c.reference_correct is None) == (c.kind != "passkey")
        assert c.replay_diff is None or not c.identical
    assert {c.context for c in r.cases if c.kind == "passkey"} == {320, 448}
    doc = [c.prompt_tokens for c in r.cases if c.kind == "document"]
    assert doc == sorted(doc) and doc[-1] - doc[0] >= 60  # documents grow from 160 to 240 tokens


def test_full_candidate_matches_reference_exactly(tiny: LoadedModel, tmp_path: Path) -> None:
    (r,) = run_accuracy_benches(str(tmp_path / "kv"), loaded=tiny, token_budgets=(64,), candidate_full_attention=True,
                                **TINY)  # type: ignore[arg-type]
    _check_structure(r)
    assert r.candidate == "full"
    assert all(c.identical and c.candidate_text == c.reference_text for c in r.cases)
    assert all(x == 0.0 for c in r.cases for x in c.kl)
    assert r.prefill_tokens_computed < sum(c.prompt_tokens for c in r.cases)  # shared prefixes computed once
    d = as_dict(r)
    json.dumps(d)
    s = d["summary"]
    assert s["chat"]["identical_rate"] == 1.0 and s["kl_mean_all"] == 0.0  # type: ignore[index]
    assert s["passkey"]["candidate_accuracy"] == s["passkey"]["reference_accuracy"]  # type: ignore[index]
    assert "| 320 |" in table(r) and "| document |" in table(r)
    assert plot(r, str(tmp_path / "acc.png")) and (tmp_path / "acc.png").stat().st_size > 1000


def _long_kl(r: AccuracyBenchResult) -> list[float]:
    return [x for c in r.cases if c.kind != "chat" for x in c.kl[1:]]


def test_sparse_candidate_is_exact_within_budget_and_approximate_beyond(tiny: LoadedModel, tmp_path: Path) -> None:
    # two budgets against one prefill and one reference: 64 (selection active) and 512, which covers every
    # prompt here (at most 448 tokens + 6 generated), so that candidate must be exact everywhere. The pages
    # left out are dropped, so the candidate is visibly approximate (the default attends them from their
    # sketches, which on this model is within float noise: the next test)
    r, wide = run_accuracy_benches(str(tmp_path / "kv"), loaded=tiny, token_budgets=(64, 512), selection_rest="drop",
                                   **TINY)  # type: ignore[arg-type]
    assert (r.token_budget, wide.token_budget) == (64, 512)
    assert r.prefill_tokens_computed == wide.prefill_tokens_computed
    assert [c.reference_text for c in r.cases] == [c.reference_text for c in wide.cases]
    assert all(c.identical and all(x == 0.0 for x in c.kl) for c in wide.cases)
    _check_structure(r)
    assert r.candidate == "sparse"
    for c in r.cases:
        if c.kind == "chat":  # prompt + answer fit the 64-token budget: every page selected, exact
            assert c.prompt_tokens + c.reference_tokens < 64
            assert c.identical and all(x == 0.0 for x in c.kl)
        else:
            assert c.kl[0] == pytest.approx(0.0, abs=1e-9) or c.prompt_tokens % 16 == 1  # first token: exact prefill
    assert max(_long_kl(r)) > 1e-6  # selection drops pages: the distributions move
    replayed = [c for c in r.cases if c.replay_diff is not None]
    assert replayed  # some outputs diverge: the teacher-forced pass ran, aligned with the free run
    assert all(c.replay_diff == 0.0 for c in replayed)
    assert all(c.first_divergence is not None and c.first_divergence + 1 < c.reference_tokens for c in replayed)


def test_the_default_attends_the_left_out_pages_and_moves_the_distributions_far_less(tiny: LoadedModel,
                                                                                    tmp_path: Path) -> None:
    """``--selection-rest`` auto (sketch): the same 64-token budget, the left-out pages attended from their 8-bit
    sketches, stays orders of magnitude closer to full attention than dropping them."""
    (drop,) = run_accuracy_benches(str(tmp_path / "a"), loaded=tiny, token_budgets=(64,), selection_rest="drop",
                                   **TINY)  # type: ignore[arg-type]
    (sketch,) = run_accuracy_benches(str(tmp_path / "b"), loaded=tiny, token_budgets=(64,), **TINY)  # type: ignore[arg-type]
    assert max(_long_kl(sketch)) < 0.01 * max(_long_kl(drop))
    assert sum(c.identical for c in sketch.cases) >= sum(c.identical for c in drop.cases)


def test_kl_divergence_values() -> None:
    a = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
    b = torch.tensor([[0.0, 0.0], [0.0, 2.0]])
    kl = kl_divergence(a, b)
    p = torch.softmax(torch.tensor([2.0, 0.0], dtype=torch.float64), 0)
    assert kl[0] == 0.0
    assert kl[1] == pytest.approx(float((p * (p.log() - p.flip(0).log())).sum()))
