"""Fair admission benchmark: short requests' TTFT under a mixed load, ``--scheduling fifo`` vs ``fair``.

Runs a real `kvdrive serve` (demo model, the tiers of `make serve`) once per policy, one after the other,
with the same load (`kvdrive bench load`'s client): --clients streaming chat clients for --seconds, of
which --long-clients send ~2K-token documents (each distinct: no prefix reuse) and the rest short
questions. Requests started before the deadline run to their end. Writes JSON, a Markdown table and a PNG.

  .venv/bin/python bench/fair_admission.py --out bench/results/fair-admission.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "operator"))  # the live tests' server launcher

from liveservers import start, wait_ready  # noqa: E402

from kvdrive.runtime.bench.load_bench import as_dict, run_load  # noqa: E402

TIERS = ("--gpu-budget", "64MiB", "--dram-budget", "128MiB", "--ssd-budget", "1GiB")  # as `make serve`


async def one(policy: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    server = start(tmp / policy, "bench-token", *TIERS, "--scheduling", policy, "--threads", str(args.threads))
    try:
        await wait_ready(server)
        res = await run_load(server.url, args.clients, args.seconds, args.max_tokens,
                             long_clients=args.long_clients, long_sentences=args.long_sentences)
        return as_dict(res)
    finally:
        server.stop()


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = ["| policy | class | completed | errors | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for policy, r in results.items():
        for kind, c in r["classes"].items():
            rows.append(f"| {policy} | {kind} | {c['requests']} | {c['errors']} | {c['ttft_ms'].get('p50', '-')} | "
                        f"{c['ttft_ms'].get('p99', '-')} | {c['itl_ms'].get('p50', '-')} | "
                        f"{c['itl_ms'].get('p99', '-')} |")
    return "\n".join(rows)


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, kind in zip(axes, ("short", "long"), strict=True):
        policies = [p for p in results if kind in results[p]["classes"]]
        for j, q in enumerate(("p50", "p99")):
            vals = [results[p]["classes"][kind]["ttft_ms"].get(q, 0) / 1000 for p in policies]
            ax.bar([i + 0.4 * j for i in range(len(policies))], vals, width=0.4, label=f"TTFT {q}")
        ax.set_xticks([i + 0.2 for i in range(len(policies))], policies)
        ax.set_title(f"{kind} requests")
        ax.set_ylabel("seconds")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--long-clients", type=int, default=4)
    ap.add_argument("--long-sentences", type=int, default=170, help="~12 tokens each: ~2K-token documents")
    ap.add_argument("--seconds", type=float, default=75.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fair-admission.json")
    args = ap.parse_args()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for policy in tqdm(("fifo", "fair"), desc="policies"):
            results[policy] = asyncio.run(one(policy, args, Path(tmp)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "out"},
                                    "results": results}, indent=2) + "\n")
    md = table(results)
    args.out.with_suffix(".md").write_text(
        f"# Fair admission: {args.clients} streaming clients ({args.long_clients} with ~2K-token documents), "
        f"{args.seconds:.0f} s per policy\n\n`.venv/bin/python bench/fair_admission.py`\n\n{md}\n")
    plot(results, args.out.with_suffix(".png"))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
