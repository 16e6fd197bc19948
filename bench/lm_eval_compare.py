"""lm-evaluation-harness against `kvdrive serve --full-attention` (its ``local-completions`` model, over HTTP)
and against lm-eval's own ``hf`` backend (transformers, float32) on the same GGUF weights, in one run.

  .venv/bin/pip install "lm-eval[api]"      # the harness is not a dependency of the project
  .venv/bin/python bench/lm_eval_compare.py --out bench/results/lm-eval      (about 15 minutes on 2 cores)

Two tasks on local data files (``bench/eval_tasks.py``): ``kvd_mc`` (multiple choice by log-likelihood:
lm-eval sends ``echo: true, logprobs: 1, max_tokens: 1`` and reads the prompt's log-probabilities) and
``kvd_gen`` (greedy ``generate_until``, exact match). The harness finds the server's tokenizer routes
(``/tokenizer_info``, ``/tokenize``) and uses them ("remote" tokenizer); the hf backend uses transformers'
tokenizer built from the GGUF. Writes ``<out>/results.json`` and ``<out>/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "operator"))  # the live tests' server launcher
sys.path.insert(0, str(ROOT / "bench"))

from eval_tasks import write_tasks  # noqa: E402
from liveservers import start, wait_ready  # noqa: E402

from kvdrive.runtime.model.loader import resolve_model_path  # noqa: E402

METRICS = {"kvd_mc": ("acc,none", "acc_norm,none"), "kvd_gen": ("exact_match,none",)}


def _scores(results: dict[str, Any]) -> dict[str, float]:
    return {f"{task}/{m.split(',')[0]}": round(100 * float(results["results"][task][m]), 2)
            for task, names in METRICS.items() for m in names}


Outcome = tuple[dict[str, float], float, dict[str, list[Any]]]


def _evaluate(model: str, model_args: str, tasks: list[str], include: Path, **extra: Any) -> Outcome:
    """(scores in points, seconds, per task each document's (doc id, the model's answer or choice scores))."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, log_samples=True,
                                  task_manager=TaskManager(include_path=str(include)), **extra)
    assert out is not None
    seconds = time.perf_counter() - t0
    samples = {t: [(d["doc_id"], d["filtered_resps"]) for d in out["samples"][t]] for t in tasks}
    return _scores(out), seconds, samples


def _disagreements(a: dict[str, list[Any]], b: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """The documents whose choice (multiple choice: the best-scored option) or answer differ."""
    out = []
    for task in a:
        for (doc, ra), (_, rb) in zip(sorted(a[task], key=lambda x: x[0]), sorted(b[task], key=lambda x: x[0]),
                                      strict=True):
            if task == "kvd_mc":
                la, lb = [float(r[0]) for r in ra], [float(r[0]) for r in rb]
                if la.index(max(la)) != lb.index(max(lb)):
                    out.append({"task": task, "doc": doc, "kvdrive": la, "hf": lb})
            elif ra != rb:
                out.append({"task": task, "doc": doc, "kvdrive": ra, "hf": rb})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lm-eval")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/kvd-lm-eval"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tasks = write_tasks(args.workdir / "tasks")
    gguf = resolve_model_path("demo")
    server = start(args.workdir / "server", "lm-eval-admin", "--full-attention", "--weights", "fp32",
                   "--gpu-budget", "64MiB", "--dram-budget", "256MiB")
    try:
        asyncio.run(wait_ready(server))
        kv_args = f"model=demo,base_url={server.url}/v1/completions,num_concurrent=1,max_retries=3"
        kvdrive, kv_s, kv_docs = _evaluate("local-completions", kv_args, tasks, args.workdir / "tasks")
    finally:
        server.process.terminate()
        server.process.wait(60)
    hf_args = f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32"
    hf, hf_s, hf_docs = _evaluate("hf", hf_args, tasks, args.workdir / "tasks", device="cpu", batch_size=1)
    differ = _disagreements(kv_docs, hf_docs)
    rows = [{"metric": k, "kvdrive": kvdrive[k], "hf": hf[k], "diff": round(kvdrive[k] - hf[k], 2)} for k in hf]
    report = {"model": str(gguf.name), "kvdrive_args": kv_args + " (server: kvdrive serve --model demo --full-attention --weights fp32)",
              "hf_args": hf_args, "kvdrive_seconds": round(kv_s, 1), "hf_seconds": round(hf_s, 1), "rows": rows,
              "documents_that_differ": differ}
    (args.out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["| metric | kvdrive (local-completions) | lm-eval hf (fp32) | difference (points) |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['metric']} | {r['kvdrive']:.2f} | {r['hf']:.2f} | {r['diff']:+.2f} |" for r in rows]
    (args.out / "README.md").write_text(
        "# lm-evaluation-harness: kvdrive serve against lm-eval's hf backend\n\n"
        f"`.venv/bin/python bench/lm_eval_compare.py --out {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}`\n\n"
        f"- kvdrive: `lm-eval run --model local-completions --model_args {kv_args}` against "
        "`kvdrive serve --model demo --full-attention --weights fp32 --gpu-budget 64MiB --dram-budget 256MiB`\n"
        f"- hf: `lm-eval run --model hf --model_args {hf_args} --device cpu --batch_size 1`\n"
        f"- wall time: kvdrive {kv_s:.0f} s, hf {hf_s:.0f} s\n\n" + "\n".join(lines) + "\n\n"
        f"Documents answered differently: {len(differ)} (listed in results.json with both backends' scores).\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
