"""Tier tuning benchmark (issue 18): the tuner's live split of one device envelope against static splits.

Every run is a fresh `kvdrive serve` (demo model) with the same envelope (--gpu-budget), the same
hugepage-sized DRAM tier and SSD tier, and the same phased workload (bench/tuning_workload.py):
``long`` (2 streams over their own ~6K-token documents) and ``short`` (16 concurrent short requests),
alternating, each --phase-seconds long, twice. Runs:
  static N: max_running fixed at N (so the hot tier is the envelope less N step buffers);
  tuned:    starts at --tuned-start; every --interval seconds the operator's own policy
            (kvdrive.operator.decide.tuning.decide on kvdrive.operator.api.podmetrics scrapes) decides and the change
            goes through PUT /admin/tiers {"max_running": N}, as the operator's live loop does for a pod.
Reports per phase and overall: decode tokens/s (the server's generated-token counter), TTFT p50/p99
(clients, streaming), hit rate per tier, mean queue, fetch-wait share; for the tuned run the timeline and,
per phase, the intervals until its last change and its throughput against the phase's best static run.

  .venv/bin/python bench/tuning_bench.py --out bench/results/tuning.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tuning_report import render
from tuning_workload import PhaseLog, Workload

from kvdrive.operator.api.podmetrics import PodMetrics, Scrape, parse_metrics, rates
from kvdrive.operator.decide.tuning import PodHistory, RunningLimits, TuningPolicy, decide

ROOT = Path(__file__).resolve().parents[1]
KVDRIVE = str(ROOT / ".venv" / "bin" / "kvdrive")
TOKEN = "bench-admin-token"
MiB = 1 << 20


async def start(tmp: Path, port: int, args: argparse.Namespace, max_running: int, seed: Path | None = None,
                dram_mib: int | None = None) -> subprocess.Popen[bytes]:
    """A server in ``tmp``; ``seed``: an SSD directory to start from (a copy: the documents' pages)."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if seed is not None:
        shutil.copytree(seed, tmp / "ssd")
    (tmp / "admin").write_text(TOKEN + "\n")
    dram = args.dram_mib if dram_mib is None else dram_mib
    cmd = [KVDRIVE, "serve", "--model", "demo", "--port", str(port), "--admin-token-file", str(tmp / "admin"),
           "--gpu-budget", f"{args.envelope_mib}MiB", "--dram-budget", f"{dram}MiB", "--ssd-dir",
           str(tmp / "ssd"), "--ssd-budget", f"{args.ssd_mib}MiB", "--max-running", str(max_running),
           "--max-sequences", str(args.max_sequences), "--max-waiting", "256"]
    process = subprocess.Popen(cmd, stdout=(tmp / "server.log").open("w"), stderr=subprocess.STDOUT, cwd=tmp)
    deadline = time.monotonic() + 300
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError((tmp / "server.log").read_text()[-3000:])
            try:
                if (await client.get(f"http://127.0.0.1:{port}/readyz", timeout=2)).status_code == 200:
                    return process
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    process.kill()
    raise RuntimeError("server not ready in 300 s")


async def scrape(client: httpx.AsyncClient, url: str) -> Scrape:
    try:
        rsp = await client.get(f"{url}/metrics", timeout=10)
        return Scrape(time.monotonic(), parse_metrics(rsp.text))
    except (httpx.HTTPError, ValueError) as exc:
        return Scrape(time.monotonic(), None, str(exc))


def phase_summary(first: Scrape, last: Scrape, log: PhaseLog) -> dict[str, Any]:
    a, b = first.metrics, last.metrics
    assert a is not None and b is not None
    seconds = last.time - first.time
    reads = {k: b.page_reads.get(k, 0.0) - a.page_reads.get(k, 0.0) for k in ("gpu", "dram", "ssd", "miss")}
    total = sum(reads.values()) or 1.0
    r = rates(first, last)
    ttft = sorted(log.ttft)
    return {
        "seconds": round(seconds, 1),
        "decode_tokens_per_s": round((b.generated_tokens - a.generated_tokens) / seconds, 2),
        "requests": log.requests, "errors": log.errors,
        "ttft_p50_s": round(statistics.median(ttft), 3) if ttft else None,
        "ttft_p99_s": round(ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 3) if ttft else None,
        "hit_rate": {k: round(v / total, 4) for k, v in reads.items()},
        "mean_queue": round(r.queue_length, 2) if r and r.queue_length is not None else None,
        "fetch_wait_share": round(r.fetch_wait_fraction, 3) if r and r.fetch_wait_fraction is not None else None,
        "max_running_end": b.max_running,
    }


def interval_row(index: int, phase: str, before: Scrape, after: Scrape) -> dict[str, Any]:
    m: PodMetrics = after.metrics  # type: ignore[assignment]
    r = rates(before, after)
    return {"interval": index, "phase": phase, "t": round(after.time, 2), "max_running": m.max_running,
            "hot_mib": round((m.hot_bytes or 0) / MiB, 2),
            "tokens_per_s": round(r.tokens_per_second, 2) if r else None,
            "queue": round(r.queue_length, 2) if r and r.queue_length is not None else None,
            "fetch_wait": round(r.fetch_wait_fraction, 3) if r and r.fetch_wait_fraction is not None else None,
            "running": m.requests_running}


def stop(server: subprocess.Popen[bytes]) -> None:
    server.terminate()  # SIGTERM: write-backs finish and the SSD index is flushed
    try:
        server.wait(120)
    except subprocess.TimeoutExpired:
        server.kill()


async def prepare(args: argparse.Namespace, port: int) -> Path:
    """Ingest the long documents once, outside every measurement, into an SSD directory each run starts
    from (a copy): the long phase is questions about documents already read, as in a multi-turn session,
    and no run pays a 6K-token prefill that the others do not. A large DRAM tier for this step only: a
    prefill that spills re-reads its earlier pages chunk after chunk."""
    tmp = args.tmp / "prep"
    server = await start(tmp, port, args, 2, dram_mib=1024)
    workload = Workload()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=900) as client:
            for i in range(workload.long_streams):
                log = PhaseLog("prep")
                started = time.monotonic()
                await workload.request(client, workload.long_prompt(i, 0), 1, log)
                print(f"  document {i} ingested in {time.monotonic() - started:.1f} s", flush=True)
                if log.errors:
                    raise RuntimeError("ingesting a document failed")
    finally:
        stop(server)
    return tmp / "ssd"


async def run(args: argparse.Namespace, name: str, start_running: int, tuned: bool, port: int,
              seed: Path) -> dict[str, Any]:
    tmp = args.tmp / name
    server = await start(tmp, port, args, start_running, seed=seed)
    url = f"http://127.0.0.1:{port}"
    workload = Workload()
    limits = RunningLimits(floor=1, ceiling=args.max_sequences, min_step=1)
    policy = TuningPolicy(window=args.window)
    history, rows, changes, phases = PodHistory(), [], [], []
    try:
        async with httpx.AsyncClient() as client:
            async with httpx.AsyncClient(base_url=url, timeout=120) as warm:  # model load effects out of it
                await workload.request(warm, "Hello", 4, PhaseLog("warm"))
            previous = await scrape(client, url)
            history = history.add(previous, keep=policy.history)
            run_first = previous
            index = 0
            for p, phase in enumerate(args.phases):
                log = PhaseLog(phase)
                first = previous
                load = asyncio.create_task(workload.run(url, phase, args.phase_seconds, log))
                while not load.done():
                    await asyncio.wait({load}, timeout=args.interval)
                    if load.done():
                        break
                    now = await scrape(client, url)
                    index += 1
                    if now.metrics is not None and previous.metrics is not None:
                        rows.append(interval_row(index, f"{p}:{phase}", previous, now))
                    previous = now
                    history = history.add(now, keep=policy.history)
                    if not tuned:
                        continue
                    decision = decide(history, limits, policy)
                    if decision.changed:
                        rsp = await client.put(f"{url}/admin/tiers", json={"max_running": decision.new_max_running},
                                               headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
                        ok = rsp.status_code == 200
                        history = history.changed(time.monotonic(), decision.summary) if ok else \
                            history.refused(decision, time.monotonic(), rsp.text[:300])
                        changes.append({"interval": index, "phase": f"{p}:{phase}", "applied": ok,
                                        "change": decision.summary if ok else rsp.text[:300]})
                        print(f"  [{name}] interval {index} ({phase}): {changes[-1]['change'][:160]}", flush=True)
                await load
                last = await scrape(client, url)
                phases.append({"phase": phase, "index": p, **phase_summary(first, last, log)})
                print(f"  [{name}] phase {p} {phase}: {phases[-1]['decode_tokens_per_s']} tok/s, TTFT p50 "
                      f"{phases[-1]['ttft_p50_s']} s, max_running {phases[-1]['max_running_end']}", flush=True)
                previous = last
            a, b = run_first.metrics, previous.metrics
            assert a is not None and b is not None
            overall = (b.generated_tokens - a.generated_tokens) / (previous.time - run_first.time)
    finally:
        stop(server)
        shutil.rmtree(tmp / "ssd", ignore_errors=True)
    return {"name": name, "tuned": tuned, "start_max_running": start_running, "phases": phases,
            "overall_tokens_per_s": round(overall, 2), "timeline": rows, "changes": changes}


async def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase-seconds", type=float, default=120.0)
    p.add_argument("--phases", nargs="+", default=["long", "short", "long", "short"])
    p.add_argument("--interval", type=float, default=5.0, help="tuning interval (s)")
    p.add_argument("--window", type=int, default=2, help="stabilization intervals")
    p.add_argument("--static", type=int, nargs="+", default=[2, 8, 16], help="static max_running splits")
    p.add_argument("--tuned-start", type=int, default=8)
    p.add_argument("--envelope-mib", type=int, default=48)
    p.add_argument("--dram-mib", type=int, default=64)
    p.add_argument("--ssd-mib", type=int, default=2048)
    p.add_argument("--max-sequences", type=int, default=16)
    p.add_argument("--port", type=int, default=18411)
    p.add_argument("--tmp", type=Path, default=Path("/tmp/kvdrive-tuning-bench"))
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tuning.json")
    args = p.parse_args(argv)
    print("ingesting the long documents once", flush=True)
    seed = await prepare(args, args.port)
    runs = []
    for n in args.static:
        print(f"static max_running={n}", flush=True)
        runs.append(await run(args, f"static-{n}", n, tuned=False, port=args.port, seed=seed))
    print(f"tuned from max_running={args.tuned_start}", flush=True)
    runs.append(await run(args, "tuned", args.tuned_start, tuned=True, port=args.port, seed=seed))
    shutil.rmtree(seed, ignore_errors=True)
    report = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "workload": Workload().__dict__, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(render(report, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
