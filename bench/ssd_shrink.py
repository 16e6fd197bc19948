"""SSD shrink benchmark: a full SSD tier of >= 10K blocks shrunk live while a request decodes.

Runs a real `kvdrive serve` (demo model; gpu 64 MiB, dram 32 MiB, ssd 1 GiB), fills the SSD tier by
prefilling distinct documents (every sealed page is written through to the SSD: 30 blocks a page), then
starts a streaming request and, while it decodes, shrinks the SSD budget with PUT /admin/tiers. Reports
the blocks before and after, how long the PUT took, the longest gap between two streamed tokens during
it (against the median gap), and the engine loop's longest turns from kvdrive_engine_step_seconds.

  .venv/bin/python bench/ssd_shrink.py --out bench/results/ssd-shrink.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
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
TIERS = ("--gpu-budget", "64MiB", "--dram-budget", "32MiB", "--ssd-budget", "1GiB")


def _buckets(text: str) -> dict[float, float]:
    """kvdrive_engine_step_seconds cumulative bucket counts: upper bound -> count."""
    out = {}
    for le, n in re.findall(r'^kvdrive_engine_step_seconds_bucket\{le="([^"]+)"\} (\S+)$', text, re.M):
        out[float("inf") if le == "+Inf" else float(le)] = float(n)
    return out


async def ssd_tier(client: httpx.AsyncClient, server: Server) -> dict[str, int]:
    r = await client.get(f"{server.url}/admin/tiers", headers=server.admin(), timeout=60)
    r.raise_for_status()
    return next(t for t in r.json()["tiers"] if t["tier"] == "ssd")


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    server = start(tmp, "bench-token", *TIERS, "--threads", str(args.threads))
    try:
        await wait_ready(server)
        async with httpx.AsyncClient(timeout=600) as client:
            for i in tqdm(range(args.documents), desc="filling the ssd tier"):
                text = f"Document {i}. " + haystack_words(random.Random(i), args.sentences)
                r = await client.post(f"{server.url}/v1/completions", json={
                    "model": "demo", "prompt": text, "max_tokens": 1, "temperature": 0})
                r.raise_for_status()
            before = await ssd_tier(client, server)
            gaps: list[tuple[float, float]] = []  # (time a token arrived, gap since the previous one)

            async def stream() -> None:
                body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": args.decode_tokens,
                        "temperature": 0, "ignore_eos": True, "stream": True}
                last = None
                async with client.stream("POST", f"{server.url}/v1/completions", json=body) as rsp:
                    async for line in rsp.aiter_lines():
                        if line.startswith("data: {"):
                            now = time.perf_counter()
                            if last is not None:
                                gaps.append((now, now - last))
                            last = now

            decoding = asyncio.create_task(stream())
            while len(gaps) < 20:  # decoding at its steady pace first
                await asyncio.sleep(0.1)
            hist0 = _buckets((await client.get(f"{server.url}/metrics")).text)
            target = args.target_mib * MiB
            t0 = time.perf_counter()
            r = await client.put(f"{server.url}/admin/tiers", headers=server.admin(), json={
                "gpu_bytes": 64 * MiB, "dram_bytes": 32 * MiB, "ssd_bytes": target})
            t1 = time.perf_counter()
            r.raise_for_status()
            hist1 = _buckets((await client.get(f"{server.url}/metrics")).text)
            after = await ssd_tier(client, server)
            await decoding
        during = [g for t, g in gaps if t0 <= t <= t1 + 0.5]
        steady = [g for t, g in gaps if t < t0]
        slow = {f"le_{le}": round(hist1[le] - hist0.get(le, 0.0)) for le in sorted(hist1)}
        return {
            "ssd_blocks_before": before["pages"], "ssd_blocks_after": after["pages"],
            "ssd_budget_before_mib": before["budget_bytes"] // MiB, "ssd_budget_after_mib": target // MiB,
            "put_seconds": round(t1 - t0, 2),
            "tokens_during_shrink": len(during),
            "longest_token_gap_during_s": round(max(during, default=0.0), 3),
            "median_token_gap_before_s": round(statistics.median(steady), 3) if steady else None,
            "engine_turns_during_by_bucket": slow,
        }
    finally:
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--documents", type=int, default=6)
    ap.add_argument("--sentences", type=int, default=130, help="~12 tokens each: ~1.6K-token documents")
    ap.add_argument("--target-mib", type=int, default=48, help="the SSD budget to shrink to")
    ap.add_argument("--decode-tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ssd-shrink.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        res = asyncio.run(run(args, Path(tmp)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "out"}, "result": res},
                                   indent=2) + "\n")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
