"""Run the accuracy benchmark (issue #4) on the demo model; write bench/results/accuracy.{json,md,png}.

Usage (from any directory; the repository's operator/ folder shadows the stdlib when it is the cwd):
    cd /tmp && /work/main/.venv/bin/python /work/main/bench/run_accuracy.py --ssd-dir /work/.kvbench-acc
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvdrive.runtime.bench.accuracy_bench import (
    CHAT_PROMPTS,
    DEPTHS,
    AccuracyBenchResult,
    CaseResult,
    run_accuracy_benches,
)
from kvdrive.runtime.bench.accuracy_report import as_dict, plot, table
from kvdrive.runtime.sizes import parse_size

REPO = Path(__file__).resolve().parent.parent
RUN = "cd /tmp && /work/main/.venv/bin/python /work/main/bench/run_accuracy.py"


def provenance() -> dict[str, Any]:
    """The commit and the runtime files that differ from it (the engine may change under the benchmark)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=False).stdout

    dirty = [line[3:] for line in git("status", "--porcelain", "--", "runtime").splitlines()]
    return {"commit": git("rev-parse", "HEAD").strip(), "runtime_changes_not_committed": dirty}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ssd-dir", default="/work/.kvbench-acc")
    ap.add_argument("--out-dir", default=str(REPO / "bench" / "results"),
                    help="with several --token-budget values it must contain {budget}")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--token-budget", type=int, nargs="+", default=[1024],
                    help="one or more: each runs the sparse candidate against the same prefill and reference")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 7168])
    ap.add_argument("--depths", type=float, nargs="+", default=list(DEPTHS))
    ap.add_argument("--keys-per-depth", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=len(CHAT_PROMPTS), help="chat prompts used (first N)")
    ap.add_argument("--doc-tokens", type=int, nargs=2, default=[2048, 4096])
    ap.add_argument("--chat-tokens", type=int, default=48)
    ap.add_argument("--ssd-budget", type=parse_size, default=None,
                    help="SSD tier size (default: what the prompts need; a hybrid model's window snapshots get "
                         "1/8 of it, at least 1 GiB)")
    ap.add_argument("--render", metavar="JSON", help="only rewrite the table and plot from a saved accuracy.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        cmd = saved.get("command") or f"{RUN} --ssd-dir /work/.kvbench-acc"
        return write(load_result(saved), saved["provenance"], cmd, Path(args.out_dir))
    if len(args.token_budget) > 1 and "{budget}" not in args.out_dir:
        ap.error("several --token-budget values need an --out-dir with {budget} in it")
    before = provenance()
    cmd = f"{RUN} " + " ".join(argv or sys.argv[1:])
    results = run_accuracy_benches(args.ssd_dir, model=args.model, contexts=tuple(args.contexts),
                                   depths=tuple(args.depths), keys_per_depth=args.keys_per_depth,
                                   chat_prompts=CHAT_PROMPTS[: args.prompts], token_budgets=tuple(args.token_budget),
                                   doc_tokens=tuple(args.doc_tokens), chat_tokens=args.chat_tokens,
                                   ssd_budget=args.ssd_budget)
    for result in results:
        write(result, before, cmd.strip(), Path(args.out_dir.format(budget=result.token_budget)))
    return 0


def load_result(saved: dict[str, Any]) -> AccuracyBenchResult:
    fields = {k: v for k, v in saved.items() if k in AccuracyBenchResult.__dataclass_fields__}
    cases = tuple(CaseResult(**{**c, "kl": tuple(c["kl"])}) for c in saved["cases"])
    return AccuracyBenchResult(**{**fields, "cases": cases})


def write(result: AccuracyBenchResult, prov: dict[str, Any], cmd: str, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / "accuracy.json").write_text(json.dumps({**as_dict(result), "provenance": prov, "command": cmd}, indent=2)
                                       + "\n")
    md = table(result)
    (out / "accuracy.md").write_text(
        f"# Accuracy: sparse decoding vs full attention ({result.model})\n\n{md}\n\n"
        f"Command: `{cmd}`; commit {prov['commit']}; runtime files changed and not committed at the "
        f"start: {prov['runtime_changes_not_committed'] or 'none'}. Phase seconds: {result.seconds} "
        f"({result.threads} threads); prefill computed {result.prefill_tokens_computed} tokens "
        f"(shared prefixes once).\n")
    plot(result, str(out / "accuracy.png"))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
