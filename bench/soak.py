"""Soak: a real `kvdrive serve` under mixed streaming load, disconnects, live budget changes and a corrupt SSD.

  .venv/bin/python bench/soak.py --out bench/results/soak.json      (about 8 minutes; the soak server's log is
  kept as bench/results/soak.server.log)

1. A clean server (fresh SSD directory, no load) answers 3 fixed prompts greedily: the reference.
2. The soak server (same flags, its own fresh SSD directory) first stores the fixed prompts' pages and
   stops; 64 of its stored SSD slots get a flipped byte; it restarts on that directory (memory tiers
   empty, so the fixed prompts' pages are read from the corrupt SSD tier), and then for --seconds:
   - --clients streaming clients: --long-clients send ~1.5K-token documents (each distinct), one sends the
     3 fixed prompts greedily in turn (compared with the reference), the rest short chat questions;
   - each request of the others disconnects at a random moment with probability --disconnect;
   - PUT /admin/tiers every --retune seconds, alternating two budget sets;
   - GET /metrics every second, as the router scrapes each replica.
3. Reported: HTTP 5xx and error chunks, completed requests, TTFT and inter-token latency p50/p99 for
   short and long prompts, tier bytes held for running sequences before and after (the idle baseline),
   fixed-prompt outputs identical to the reference, the engine loop's turns over 2 s (from
   kvdrive_engine_step_seconds), the /metrics scrape latency p50/p99 under that load, faults counted and
   the log lines they produced.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "operator"))  # the live tests' server launcher

from liveservers import Server, start, wait_ready  # noqa: E402

from kvdrive.runtime.bench.texts import haystack_words  # noqa: E402

MiB = 1 << 20
BUDGETS = ({"gpu_bytes": 32 * MiB, "dram_bytes": 64 * MiB, "ssd_bytes": 256 * MiB},
           {"gpu_bytes": 48 * MiB, "dram_bytes": 32 * MiB, "ssd_bytes": 128 * MiB})
FLAGS = ("--gpu-budget", "32MiB", "--dram-budget", "64MiB", "--ssd-budget", "256MiB", "--max-running", "8")
SHORT = ["Explain how a refrigerator works.", "Write a haiku about autumn.", "What is the capital of Japan?",
         "List three uses of copper.", "How do vaccines work?", "Why is the sky blue?"]


def fixed_prompts() -> list[str]:
    return [f"Archive {i}. " + haystack_words(random.Random(1000 + i), 100) + "\nSummary:" for i in range(3)]


def document(client: int, n: int) -> str:
    return f"Report {client}-{n}. " + haystack_words(random.Random(client * 7919 + n), 125) + "\nPlaces named:"


def pct(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        return {"p50": round(values[0] * 1000, 1), "p99": round(values[0] * 1000, 1)} if values else {}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": round(q[49] * 1000, 1), "p99": round(q[98] * 1000, 1)}


async def greedy(client: httpx.AsyncClient, server: Server, prompt: str, n: int = 32) -> tuple[int, str]:
    r = await client.post(f"{server.url}/v1/completions", timeout=600, json={
        "model": "demo", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True})
    return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text


def metrics_of(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, labels, value in re.findall(r"^(kvdrive_[a-z_]+)(\{[^}]*\})? (\S+)$", text, re.M):
        out[name + labels] = float(value)
    return out


def used_bytes(m: dict[str, float]) -> dict[str, float]:
    return {t: m.get(f'kvdrive_tier_used_bytes{{tier="{t}"}}', 0.0) for t in ("gpu", "dram", "ssd")}


def flip_bytes(ssd: Path, slots_used: int, count: int, rng: random.Random) -> int:
    """Flip one byte in each of ``count`` distinct stored slots (slots are allocated lowest first)."""
    meta = json.loads((ssd / "meta.json").read_text())
    slot_bytes, slab_slots, block = int(meta["slot_bytes"]), int(meta["slab_slots"]), int(meta["block_bytes"])
    flipped = 0
    for slot in rng.sample(range(slots_used), min(count, slots_used)):
        path = ssd / f"slab-{slot // slab_slots:05d}.kv"
        off = (slot % slab_slots) * slot_bytes + rng.randrange(block)
        with open(path, "r+b") as f:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xA5]))
        flipped += 1
    return flipped


async def reference(args: argparse.Namespace, tmp: Path) -> list[str]:
    server = start(tmp / "clean", "soak-token", *flags(args))
    try:
        await wait_ready(server)
        async with httpx.AsyncClient() as client:
            outs = []
            for p in tqdm(fixed_prompts(), desc="clean reference"):
                code, text = await greedy(client, server, p)
                assert code == 200, text
                outs.append(text)
            return outs
    finally:
        server.stop()


def flags(args: argparse.Namespace) -> tuple[str, ...]:
    return (*FLAGS, "--threads", str(args.threads), "--step-tokens", str(args.step_tokens),
            "--step-seconds", str(args.step_seconds))


async def soak(args: argparse.Namespace, tmp: Path, ref: list[str]) -> dict[str, Any]:
    rng = random.Random(args.seed)
    stats: dict[str, Any] = {}
    # the fixed prompts' pages are stored, the server stops (SIGTERM: index flushed), 64 of their stored
    # slots get a flipped byte, and the soak server restarts on that directory with empty memory tiers:
    # the fixed prompts' pages are then read from the corrupt SSD tier
    primer = start(tmp / "soak", "soak-token", *flags(args))
    try:
        await wait_ready(primer)
        async with httpx.AsyncClient(timeout=600) as client:
            for p in fixed_prompts():
                await greedy(client, primer, p, 1)
            tiers = (await client.get(f"{primer.url}/admin/tiers", headers=primer.admin())).json()["tiers"]
            stats["ssd_blocks_at_start"] = next(t["pages"] for t in tiers if t["tier"] == "ssd")
    finally:
        primer.stop()
    stats["flipped"] = flip_bytes(tmp / "soak" / "ssd", stats["ssd_blocks_at_start"], 64, rng)
    server = start(tmp / "soak", "soak-token", *flags(args))
    stats.update({"status": {}, "error_chunks": 0, "completed": {"short": 0, "long": 0, "fixed": 0},
                  "disconnected": 0, "retunes": {}, "fixed_identical": 0, "fixed_different": []})
    ttft: dict[str, list[float]] = {"short": [], "long": []}
    itl: dict[str, list[float]] = {"short": [], "long": []}
    scrapes: list[float] = []
    try:
        await wait_ready(server)
        async with httpx.AsyncClient(timeout=600) as client:
            before = metrics_of((await client.get(f"{server.url}/metrics")).text)
            deadline = time.monotonic() + args.seconds

            def count(code: int) -> None:
                stats["status"][str(code)] = stats["status"].get(str(code), 0) + 1

            async def stream(body: dict[str, Any], kind: str, leave_after: float | None) -> None:
                start_t, last = time.perf_counter(), None
                try:
                    async with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
                        count(r.status_code)
                        if r.status_code != 200:
                            await r.aread()
                            return
                        async for line in r.aiter_lines():
                            if leave_after is not None and time.perf_counter() - start_t > leave_after:
                                stats["disconnected"] += 1
                                return  # closing the stream: the client is gone
                            if not line.startswith("data: {"):
                                continue
                            chunk = json.loads(line[6:])
                            if "error" in chunk:
                                stats["error_chunks"] += 1
                                return
                            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                                now = time.perf_counter()
                                (ttft[kind] if last is None else itl[kind]).append(now - (last or start_t))
                                last = now
                    stats["completed"][kind] += 1
                except httpx.HTTPError as exc:
                    stats["status"][type(exc).__name__] = stats["status"].get(type(exc).__name__, 0) + 1

            async def user(i: int) -> None:
                n = 0
                while time.monotonic() < deadline:
                    long = i < args.long_clients
                    text = document(i, n) if long else SHORT[(i + n) % len(SHORT)]
                    leave = rng.uniform(0.2, 8.0) if rng.random() < args.disconnect else None
                    body = {"model": "demo", "stream": True, "max_tokens": 32, "temperature": 0.7, "seed": n,
                            "messages": [{"role": "user", "content": text}]}
                    await stream(body, "long" if long else "short", leave)
                    n += 1

            async def fixed() -> None:
                n = 0
                while time.monotonic() < deadline:
                    code, text = await greedy(client, server, fixed_prompts()[n % 3])
                    count(code)
                    if code == 200:
                        stats["completed"]["fixed"] += 1
                        if text == ref[n % 3]:
                            stats["fixed_identical"] += 1
                        else:
                            stats["fixed_different"].append({"prompt": n % 3, "got": text, "want": ref[n % 3]})
                    n += 1

            async def retune() -> None:
                k = 0
                while time.monotonic() < deadline - args.retune:
                    await asyncio.sleep(args.retune)
                    r = await client.put(f"{server.url}/admin/tiers", headers=server.admin(),
                                         json=BUDGETS[(k + 1) % 2])
                    stats["retunes"][str(r.status_code)] = stats["retunes"].get(str(r.status_code), 0) + 1
                    k += 1

            async def scrape() -> None:  # the router's scrape of a replica, once a second
                while time.monotonic() < deadline:
                    t0 = time.perf_counter()
                    r = await client.get(f"{server.url}/metrics")
                    if r.status_code == 200:
                        scrapes.append(time.perf_counter() - t0)
                    await asyncio.sleep(1.0)

            async def progress() -> None:
                with tqdm(total=int(args.seconds), desc="soak (s)") as bar:
                    while time.monotonic() < deadline:
                        await asyncio.sleep(5)
                        bar.update(5)

            await asyncio.gather(progress(), retune(), fixed(), scrape(),
                                 *(user(i) for i in range(args.clients - 1)))
            await asyncio.sleep(2)
            after = metrics_of((await client.get(f"{server.url}/metrics")).text)
            outs_after = [await greedy(client, server, p) for p in fixed_prompts()]
        hist = {k: after[k] - before.get(k, 0.0) for k in after if k.startswith("kvdrive_engine_step_seconds_bucket")}
        turns = after.get("kvdrive_engine_step_seconds_count", 0) - before.get("kvdrive_engine_step_seconds_count", 0)
        within_2s = hist.get('kvdrive_engine_step_seconds_bucket{le="2.0"}', 0.0)
        log = server.log.read_text()
        stats.update({
            "ttft_ms": {k: pct(v) for k, v in ttft.items()}, "itl_ms": {k: pct(v) for k, v in itl.items()},
            "metrics_scrape_ms": {**pct(scrapes), "scrapes": len(scrapes)},
            "used_bytes_before": used_bytes(before), "used_bytes_after": used_bytes(after),
            "fixed_after_soak_identical": sum(o == (200, r) for o, r in zip(outs_after, ref, strict=True)),
            "engine_turns": int(turns), "engine_turns_over_2s": int(turns - within_2s),
            "engine_step_histogram": {re.search(r'le="([^"]+)"', k).group(1): int(v)  # type: ignore[union-attr]
                                      for k, v in sorted(hist.items(), key=lambda kv: float(
                                          re.search(r'le="([^"]+)"', kv[0]).group(1)))},  # type: ignore[union-attr]
            "faults": {k: v for k, v in after.items() if k.startswith("kvdrive_tier_faults_total")},
            "preemptions": after.get("kvdrive_preemptions_total", 0.0),
            "log_lines": {"crc": log.count("failed its CRC"), "scrub": log.count("scrubbed after"),
                          "error": log.count(" ERROR ") + log.count("ERROR:"), "total": log.count("\n")},
        })
        return stats
    finally:
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--long-clients", type=int, default=4)
    ap.add_argument("--disconnect", type=float, default=0.2)
    ap.add_argument("--retune", type=float, default=15.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--step-tokens", type=int, default=256, help="the servers' --step-tokens (prompt tokens a step)")
    ap.add_argument("--step-seconds", type=float, default=1.0, help="the servers' --step-seconds (0: no pacing)")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--workdir", type=Path, default=None, help="keep the servers' logs and SSD files here")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "soak.json")
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        ref = asyncio.run(reference(args, work))
        try:
            res = asyncio.run(soak(args, work, ref))
        finally:  # the soak server's log (its slow-turn lines name their cause) is kept beside the results
            log = work / "soak" / "server.log"
            if log.exists():
                shutil.copyfile(log, args.out.with_suffix(".server.log"))
    print(json.dumps(res, indent=2))
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"}
    args.out.write_text(json.dumps({"args": settings, "result": res}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
