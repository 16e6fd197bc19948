"""The prefill ``n`` saves: one request with n=4 against 4 separate requests of the same prompt, sent at once.

  .venv/bin/python bench/n_sharing.py --out bench/results/n-sharing.json      (about 2 minutes)

A real `kvdrive serve` (demo model, `make serve`'s tiers: gpu 64 MiB, DRAM 128 MiB; SSD 512 MiB; 8 running). Each leg uses a fresh ~2K-token prompt (nothing
of it stored), 8 tokens a choice, temperature 0.7 with a seed. Reported per leg: wall time, time to the last
choice's first token, the prefix pages reused (``kvdrive_prefix_hit_pages_total``) and the prompt tokens the
replica computed (prompt tokens received minus those reused). The 4 separate requests are sent together, as
a client would; each opens on pages the others have only referenced, so each computes the prompt itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "operator"))  # the live tests' server launcher

from liveservers import Server, start, wait_ready  # noqa: E402

from kvdrive.runtime.bench.texts import haystack_words  # noqa: E402

N = 4


def _metric(text: str, name: str) -> float:
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + " "))


async def _counters(client: httpx.AsyncClient, server: Server) -> tuple[float, float]:
    text = (await client.get(f"{server.url}/metrics")).text
    return _metric(text, "kvdrive_prefix_hit_pages_total"), _metric(text, "kvdrive_prompt_tokens_total")


async def _leg(client: httpx.AsyncClient, server: Server, prompt: str, shared: bool) -> dict[str, float]:
    body = {"model": "demo", "prompt": prompt, "max_tokens": 8, "temperature": 0.7, "seed": 1, "ignore_eos": True}
    hits0, _ = await _counters(client, server)
    t0 = time.perf_counter()
    if shared:
        r = await client.post(f"{server.url}/v1/completions", json={**body, "n": N}, timeout=600)
        usage = r.json()["usage"]
        prompt_tokens, choices = usage["prompt_tokens"], len(r.json()["choices"])
    else:
        rs = await asyncio.gather(*(client.post(f"{server.url}/v1/completions", json={**body, "seed": i},
                                                timeout=600) for i in range(N)))
        prompt_tokens, choices = rs[0].json()["usage"]["prompt_tokens"], len(rs)
    wall = time.perf_counter() - t0
    hits1, _ = await _counters(client, server)
    page = 16
    reused = (hits1 - hits0) * page
    return {"wall_s": round(wall, 2), "choices": choices, "prompt_tokens": prompt_tokens,
            "prompt_tokens_reused": int(reused), "prompt_tokens_computed": int(N * prompt_tokens - reused)}


async def run(work: Path) -> dict[str, object]:
    server = start(work / "n", "n-token", "--gpu-budget", "64MiB", "--dram-budget", "128MiB", "--ssd-budget", "512MiB",
                   "--max-running", "8")
    try:
        await wait_ready(server)
        async with httpx.AsyncClient(timeout=600) as client:
            rng = random.Random(5)
            out = {}
            for leg, shared in (("separate", False), ("n=4", True), ("separate again", False), ("n=4 again", True)):
                prompt = f"Leg {leg}. " + haystack_words(rng, 170) + "\nSummary:"
                out[leg] = await _leg(client, server, prompt, shared)
                print(leg, out[leg], flush=True)
            return out
    finally:
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "n-sharing.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        res = asyncio.run(run(Path(tmp)))
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
