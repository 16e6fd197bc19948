"""``kvdrive bench ruler``: the pairing and its intervals on made-up cells, and a small real run (the 0.5B
Qwen model, RULER's single-needle task at 4K, full attention against one sparse budget) that fails when any
part of the pipeline breaks: the tokenizer folder, lm-eval's local-completions, the servers, SSD reuse."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvdrive.runtime.bench.ruler_bench import (
    Cell,
    RulerResult,
    RulerSetup,
    Sample,
    in_fresh_process,
    load_cell,
    restore_cells,
    ruler_prompts,
    run_ruler_bench,
    serve_args,
    ssd_dir,
)
from kvdrive.runtime.bench.ruler_report import as_dict, averages, markdown, paired

KVDRIVE = str(Path(__file__).resolve().parents[2] / ".venv" / "bin" / "kvdrive")


def _cell(task: str, leg: str, scores: list[float], responses: list[str]) -> Cell:
    samples = tuple(Sample(i, s, r, ("x",)) for i, (s, r) in enumerate(zip(scores, responses, strict=True)))
    return Cell(8192, task, leg, samples, 1.0, 100, 50)


def _result() -> RulerResult:
    setup = RulerSetup("m", (8192,), ("a", "b"), 4, (1024,), 2, "1MiB", "1MiB", "1GiB", sketch=0)
    return RulerResult(setup, {"kvdrive": "0"}, [
        _cell("a", "full", [1, 1, 0, 1], ["p", "q", "r", "s"]),
        _cell("a", "sparse-1024", [1, 0, 0, 1], ["p", "x", "r", "s"]),
        _cell("b", "full", [0.5, 1, 1, 1], ["p", "q", "r", "s"]),
        _cell("b", "sparse-1024", [0.5, 1, 1, 1], ["p", "q", "r", "s"]),
    ])


def test_pairs_are_per_sample_with_bootstrap_intervals() -> None:
    res = _result()
    a, b = paired(res)
    assert (a.task, a.n, a.full, a.sparse, a.diff) == ("a", 4, 75.0, 50.0, -25.0)
    assert a.low <= a.diff <= a.high and a.low >= -100 and a.high <= 0  # one loss, no gain: never above 0
    assert a.identical == 0.75
    assert (b.diff, b.low, b.high, b.identical) == (0.0, 0.0, 0.0, 1.0)
    (avg,) = averages(res)
    assert (avg.task, avg.n, avg.diff) == ("average", 8, -12.5)
    assert avg.low <= -12.5 <= avg.high <= 0
    text = markdown(res, "kvdrive bench ruler")
    assert "| a | sparse-1024 | 4 | 75.0 | 50.0 | -25.0 |" in text and "| average | sparse-1024 | 8 |" in text


def test_legs_name_their_server_flags() -> None:
    setup = RulerSetup("m", (8192,), ("a",), 4, (2048, 1024), 2, "1MiB", "1MiB", "1GiB")
    assert setup.legs == ("full", "sparse-2048-k8-sketch", "sparse-1024-k8-sketch")  # the engine's default rule, named
    bound = RulerSetup("m", (8192,), ("a",), 4, (1024,), 2, "1MiB", "1MiB", "1GiB", sketch=0)
    assert bound.legs == ("full", "sparse-1024")  # as the legs measured before the sketch are named
    rule = RulerSetup("m", (8192,), ("a",), 4, (1024,), 2, "1MiB", "1MiB", "1GiB",
                      sparse_flags=("--selection-radius", "0.5"), tag="r0.5", sketch=0)
    assert rule.legs == ("full", "sparse-1024-r0.5")
    assert serve_args(setup, "full", 1, Path("ssd"))[-1] == "--full-attention"
    assert serve_args(setup, "sparse-1024-k8-sketch", 1, Path("ssd"))[-6:] == [
        "--token-budget", "1024", "--selection-sketch", "8", "--selection-rest", "sketch"]
    assert serve_args(bound, "sparse-1024", 1, Path("ssd"))[-2:] == ["--selection-rest", "drop"]
    assert serve_args(rule, "sparse-1024-r0.5", 1, Path("ssd"))[-8:] == [
        "--token-budget", "1024", "--selection-sketch", "0", "--selection-rest", "drop", "--selection-radius", "0.5"]


def test_a_run_resumes_from_its_result_file(tmp_path: Path) -> None:
    res = _result()
    out = tmp_path / "ruler.json"
    out.write_text(json.dumps(as_dict(res)))
    work = tmp_path / "work"
    assert restore_cells(out, res.setup, work) == 4
    assert load_cell(work / "cells" / "8192" / "a" / "sparse-1024.json") == res.cells[1]
    assert restore_cells(out, res.setup, work) == 0  # present cells are left alone
    report = run_ruler_bench(res.setup, work, measure=False)  # what is measured, nothing run
    assert report.cells == res.cells
    other = RulerSetup("another-model", (8192,), ("a",), 4, (1024,), 2, "1MiB", "1MiB", "1GiB", sketch=0)
    assert restore_cells(out, other, tmp_path / "elsewhere") == 0


@pytest.mark.slow
def test_a_small_real_run(tmp_path: Path) -> None:
    out = tmp_path / "ruler.json"
    run = subprocess.run([KVDRIVE, "bench", "ruler", "--model", "qwen2.5-coder-0.5b", "--contexts", "4096",
                          "--tasks", "niah_single_1", "--limit", "2", "--budgets", "1024", "--ssd-budget", "1GiB",
                          "--work-dir",
                          str(tmp_path / "work"), "--out", str(out)], capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    cells = {c["leg"]: c for c in res["cells"]}
    assert set(cells) == {"full", "sparse-1024-k8-sketch"}
    for cell in cells.values():
        assert len(cell["samples"]) == 2 and cell["prompt_tokens"] > 2 * 3500  # the prompts are ~4K tokens
    full = [s["score"] for s in cells["full"]["samples"]]
    assert sum(full) >= 1, cells["full"]["samples"]  # the model finds a single needle at 4K
    assert cells["full"]["cached_tokens"] < cells["sparse-1024-k8-sketch"]["cached_tokens"]
    assert cells["sparse-1024-k8-sketch"]["cached_tokens"] >= 2 * 3000  # the second leg reused the stored prompt pages
    assert res["paired"][0]["n"] == 2 and out.with_suffix(".png").is_file() and out.with_suffix(".md").is_file()
    assert not ssd_dir(tmp_path / "work", 4096, "niah_single_1").exists()  # the task's stored pages are removed
    assert "removed" in run.stderr and "GiB of stored prompt pages" in run.stderr
    # the selection probe's prompts are the very samples lm-eval sent (same seeds, template and tokenization)
    prompts = ruler_prompts("qwen2.5-coder-0.5b", "niah_single_1", 4096, 2)
    assert [label for label, _ in prompts] == ["niah_single_1#0", "niah_single_1#1"]
    assert sum(len(ids) for _, ids in prompts) == cells["full"]["prompt_tokens"]


def test_every_leg_sees_the_same_cwe_samples() -> None:
    """``ruler_cwe``'s generator shuffles with a module-level ``random.Random(42)`` that lm-eval never reseeds:
    built twice in one process, its prompts differ (the answers do not), so legs evaluated one after another
    in one process were not paired on the same prompts. Built in a fresh process, as each cell's lm-eval run
    now is, they are the same every time (two builds in this process's one child would differ)."""
    fresh = [in_fresh_process(ruler_prompts, "qwen2.5-coder-0.5b", "ruler_cwe", 4096, 1) for _ in range(2)]
    assert len(fresh[0][0][1]) > 2000
    assert fresh[0] == fresh[1]
