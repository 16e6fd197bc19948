"""`kvdrive bench decode`, small and without llama.cpp: the decode rows and kvdrive's time to first token of a
prompt nothing of which was stored before, reported beside each other."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvdrive.runtime.bench.decode_bench import run_decode_bench, split_mode
from kvdrive.runtime.bench.decode_report import markdown


def test_the_decode_bench_times_a_fresh_prompt_to_its_first_token(tmp_path: Path) -> None:
    """With a bfloat16 KV cache (``--kv-dtype bfloat16``): the prompts are stored in it, so the decode rows reuse
    them; a prefill in another dtype would store pages those rows never find."""
    saved: list[int] = []  # rows in the result each time a case is done (the CLI writes its files then)
    res = run_decode_bench(str(tmp_path / "ssd"), "demo", contexts=(256,), batches=(1,), modes=("kvdrive",),
                           steps=2, warmup=1, token_budget=128, with_llama_cpp=False, prefill_contexts=(128, 256),
                           on_case=lambda r: saved.append(len(r.results)), kv_dtype=torch.bfloat16)
    assert res.kv_dtype == "bfloat16" and res.kv_bytes_per_token == 30 * 2 * 3 * 64 * 2  # layers, K/V, heads, dim
    assert saved == [2]
    assert {(r.mode, r.context, r.batch) for r in res.results} == {("kvdrive", 256, 1), ("floor", 256, 1)}
    kv = next(r for r in res.results if r.mode == "kvdrive")
    assert kv.tokens_per_s > 0 and kv.prefilled_tokens <= 16  # all but its last page came back from the SSD tier
    assert [(p.engine, p.context) for p in res.prefill] == [("kvdrive", 128), ("kvdrive", 256)]
    assert all(p.seconds > 0 for p in res.prefill)
    assert not (tmp_path / "ssd" / "ttft").exists()  # its own SSD tier is gone with the measurement
    assert res.device.startswith("cpu")
    report = markdown(res)
    assert "device cpu" in report and "KV cache bfloat16 (23040 bytes a token)" in report
    assert "## Time to first token" in report
    assert "| 256 | " in report.split("## Time to first token")[1].split("##")[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_decode_bench_computes_on_the_gpu_it_is_given(tmp_path: Path) -> None:
    res = run_decode_bench(str(tmp_path / "ssd"), "demo", contexts=(512,), batches=(2,),
                           modes=("full-gpu", "kvdrive", "ondemand"), steps=2, warmup=1, token_budget=128,
                           with_llama_cpp=False, device="cuda")
    assert res.device.startswith("cuda") and "cuda" in markdown(res)
    assert {r.mode for r in res.results} == {"full-gpu", "kvdrive", "ondemand", "floor"}
    assert all(r.tokens_per_s > 0 for r in res.results)


def test_the_sketch_rows_run_beside_the_bound_rows_and_unknown_modes_are_refused(tmp_path: Path) -> None:
    """``kvdrive-k4`` is the ``kvdrive`` row with pages chosen by the 4-bit key sketch (the plain row: the
    engine's default rule): both are measured on the same prompts and appear in the report's tables; a mode
    nobody defined is refused before anything loads."""
    res = run_decode_bench(str(tmp_path / "ssd"), "demo", contexts=(512,), batches=(1,),
                           modes=("kvdrive", "kvdrive-k4", "kvdrive-sketch"), steps=2, warmup=1, token_budget=128,
                           with_llama_cpp=False)
    assert {r.mode for r in res.results} == {"kvdrive", "kvdrive-k4", "kvdrive-sketch", "floor"}
    assert all(r.tokens_per_s > 0 for r in res.results)
    report = markdown(res)
    assert report.count("| 512 | 1 | kvdrive-k4 |") == 2  # the throughput table and the step breakdown
    assert report.count("| 512 | 1 | kvdrive-sketch |") == 2
    assert split_mode("sparse-gpu-k0") == ("sparse-gpu", 0, "drop") and split_mode("lru") == ("lru", 8, "sketch")
    assert split_mode("kvdrive-drop") == ("kvdrive", 8, "drop")
    assert split_mode("kvdrive-sketch") == ("kvdrive", 8, "sketch") and split_mode("sparse-gpu-means")[2] == "means"
    with pytest.raises(ValueError, match="mode 'lru-k8': expected one of"):
        run_decode_bench(str(tmp_path / "ssd"), "demo", modes=("lru-k8",))
