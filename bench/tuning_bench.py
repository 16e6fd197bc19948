"""Live tier tuning benchmark: static budgets vs the operator's tuner, on a workload whose hot set shifts.

Runs a real `kvdrive serve` (demo model) twice, one run after the other (same start budgets):
  static: the budgets never change;
  tuned:  every --interval seconds the operator's own code reads /metrics (kvdrive.operator.podclient),
          decides (kvdrive.operator.tuning.decide, bounds from --*-max/--*-min) and applies the budgets
          through PUT /admin/tiers, exactly as the operator's live loop does for a pod (no Kubernetes).
Workload: --clients concurrent streams of completions whose prompts share long per-topic prefixes; the
hot set is --hot-a topics for the first half, then --hot-b (other, more) topics.
Reports per run: where needed pages were found (hit rate per tier), decode tokens/s, errors, and for
the tuned run the budget timeline and, per phase, how many intervals it took to settle (its last change).

  .venv/bin/python bench/tuning_bench.py --seconds 60 --out bench/results/tuning.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "operator"))  # the live tests' server launcher

from liveservers import Server, complete, start, wait_ready  # noqa: E402

from kvdrive.operator.podclient import PodClient  # noqa: E402
from kvdrive.operator.podmetrics import Scrape  # noqa: E402
from kvdrive.operator.tuning import PodHistory, TierLimits, TuningPolicy, decide  # noqa: E402

MiB = 1 << 20
TOKEN = "bench-admin-token"


def topic_prompt(topic: int, words: int, serial: int) -> str:
    prefix = f"Document {topic}. " + " ".join(f"t{topic}w{j}" for j in range(words))
    return f"{prefix}\nQuestion {serial}: summarise it."


async def drive(server: Server, hot: list[int], seconds: float, clients: int, words: int,
                counts: dict[str, int]) -> None:
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient() as client:

        async def one(index: int) -> None:
            serial = index
            while time.monotonic() < deadline:
                code = await complete(client, server, topic_prompt(hot[serial % len(hot)], words, serial), 32)
                counts["ok" if code == 200 else "errors"] += 1
                serial += clients

        await asyncio.gather(*(one(i) for i in range(clients)))


async def snapshot(client: PodClient, server: Server) -> Scrape:
    return await client.scrape(server.url, timeout=10)


def summary(first: Scrape, last: Scrape, seconds: float) -> dict[str, Any]:
    a, b = first.metrics, last.metrics
    assert a is not None and b is not None
    reads = {k: b.page_reads.get(k, 0.0) - a.page_reads.get(k, 0.0) for k in ("gpu", "dram", "ssd", "miss")}
    total = sum(reads.values()) or 1.0
    tokens = b.generated_tokens - a.generated_tokens
    wait = (b.fetch_wait_seconds or 0.0) - (a.fetch_wait_seconds or 0.0)
    return {"pages_needed": int(total), "hit_rate": {k: round(v / total, 4) for k, v in reads.items()},
            "decode_tokens_per_s": round(tokens / seconds, 2), "fetch_wait_s": round(wait, 2),
            "final_budgets": b.budgets()}


async def run(args: argparse.Namespace, tuned: bool, tmp: Path) -> dict[str, Any]:
    flags = ("--max-running", str(args.clients), "--step-tokens", "64")
    server = start(tmp / ("tuned" if tuned else "static"), TOKEN, *flags)
    pods = PodClient()
    try:
        await wait_ready(server)
        # warm-up request so model load effects are out of the measurement
        async with httpx.AsyncClient() as client:
            await complete(client, server, "hello", 4)
        limits = {"gpu": TierLimits(args.gpu_min * MiB, args.gpu_max * MiB),
                  "dram": TierLimits(args.dram_min * MiB, args.dram_max * MiB, 2 * MiB),
                  "ssd": TierLimits(256 * MiB, 256 * MiB)}
        policy = TuningPolicy(window=args.window, min_step=MiB)
        history, timeline, changes = PodHistory(), [], []
        counts = {"ok": 0, "errors": 0}
        phases = [("a", [int(t) for t in args.hot_a.split(",")]), ("b", [int(t) for t in args.hot_b.split(",")])]
        results: dict[str, Any] = {}
        interval_index = 0
        for phase, hot in phases:
            first = await snapshot(pods, server)
            began = time.monotonic()
            load = asyncio.create_task(drive(server, hot, args.seconds, args.clients, args.words, counts))
            while not load.done():
                await asyncio.sleep(args.interval)
                scrape = await snapshot(pods, server)
                interval_index += 1
                history = history.add(scrape, keep=64)
                if scrape.metrics is not None:
                    timeline.append({"interval": interval_index, "phase": phase, **scrape.metrics.budgets()})
                if tuned:
                    decision = decide(history, limits, policy)
                    if decision.changes:
                        applied = await pods.set_tiers(server.url, TOKEN, decision.budgets, timeout=30)
                        history = history.changed(time.monotonic(), decision.summary) if applied.ok else \
                            history.refused(decision.changes, time.monotonic(), applied.detail)
                        changes.append({"interval": interval_index, "phase": phase, "applied": applied.ok,
                                        "change": decision.summary if applied.ok else applied.detail})
            await load
            last = await snapshot(pods, server)
            results[phase] = summary(first, last, time.monotonic() - began)
        settle = {}
        for phase, _ in phases:
            begin = next((t["interval"] for t in timeline if t["phase"] == phase), interval_index)
            moved = [c["interval"] for c in changes if c["applied"] and c["phase"] == phase]
            settle[phase] = (max(moved) - begin + 1) if moved else 0  # intervals until the last change
        return {"mode": "tuned" if tuned else "static", "phases": results, "requests": counts,
                "timeline": timeline, "changes": changes, "settle_intervals": settle}
    finally:
        await pods.close()
        server.stop()


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run_ in report["runs"]:
        xs = [t["interval"] for t in run_["timeline"]]
        for tier, style in (("gpu", "-"), ("dram", "--")):
            left.plot(xs, [t[tier] / MiB for t in run_["timeline"]], style, label=f"{run_['mode']} {tier}")
    left.set_xlabel(f"interval ({report['config']['interval']} s)")
    left.set_ylabel("budget (MiB)")
    left.set_title("budgets over time (hot set shifts halfway)")
    left.legend()
    labels, width = ["gpu", "dram", "ssd", "miss"], 0.2
    for i, run_ in enumerate(report["runs"]):
        for j, phase in enumerate(("a", "b")):
            rates = [run_["phases"][phase]["hit_rate"][k] for k in labels]
            offset = (i * 2 + j - 1.5) * width
            right.bar([x + offset for x in range(len(labels))], rates, width,
                      label=f"{run_['mode']} phase {phase}: {run_['phases'][phase]['decode_tokens_per_s']} tok/s")
    right.set_xticks(range(len(labels)), labels)
    right.set_ylabel("share of needed pages")
    right.set_title("where needed pages were found")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0, help="per phase")
    p.add_argument("--interval", type=float, default=3.0, help="tuning interval (s)")
    p.add_argument("--window", type=int, default=2, help="stabilization intervals")
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--words", type=int, default=150, help="prompt prefix words per topic")
    p.add_argument("--hot-a", default="0,1")
    p.add_argument("--hot-b", default="2,3,4,5,6")
    p.add_argument("--gpu-min", type=int, default=8)
    p.add_argument("--gpu-max", type=int, default=24)
    p.add_argument("--dram-min", type=int, default=8)
    p.add_argument("--dram-max", type=int, default=48)
    p.add_argument("--tmp", type=Path, default=Path("/tmp/kvdrive-tuning-bench"))
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tuning.json")
    args = p.parse_args(argv)
    runs = [await run(args, tuned=False, tmp=args.tmp), await run(args, tuned=True, tmp=args.tmp)]
    report = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "start_budgets": {"gpu": "8MiB", "dram": "16MiB", "ssd": "256MiB"}, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    plot(report, args.out.with_suffix(".png"))
    for run_ in runs:
        print(run_["mode"], json.dumps(run_["phases"]), run_["requests"], "settle:", run_["settle_intervals"])
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
