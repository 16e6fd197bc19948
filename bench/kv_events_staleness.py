"""How stale is a router's view of a replica's pages: polling the page list (before) against KV events (after).

One demo-model replica (``kvdrive serve``) publishes KV events. Two routers (``kvdrive.router.core.Router``, in
this process) watch it: one with KV events off, polling as before (its defaults: the replica every
``--poll-seconds`` 1.0, its page list every 2 s), one following the events. Documents are sent straight to the
replica, one at a time; for each, the time from its answer until each router's index holds all of the
document's pages is the staleness (negative: the router knew before the answer returned, since pages are
stored during the prefill).

    .venv/bin/python bench/kv_events_staleness.py --documents 12 --out bench/results/kv-events-staleness.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvdrive.router.core import Router, RouterConfig
from kvdrive.router.discovery import StaticDiscovery
from kvdrive.runtime.bench.routing_fleet import DRAM_BUDGET, GPU_BUDGET, Proc, free_port


def _document(i: int) -> str:
    return " ".join(f"Report {i}.{j}: station {j % 9} measured {j * 13 + i} mm of rain and {j % 4} storms."
                    for j in range(60))


async def _measure(url: str, documents: int) -> dict[str, list[float]]:
    routers = {"polling": Router(RouterConfig(kv_events=False), StaticDiscovery((url,))),
               "kv events": Router(RouterConfig(), StaticDiscovery((url,)))}
    for r in routers.values():
        await r.start()
    lags: dict[str, list[float]] = {name: [] for name in routers}
    try:
        deadline = time.monotonic() + 60
        while not all(r.ready() for r in routers.values()) or not routers["kv events"].feed.live(url, time.monotonic()):
            if time.monotonic() > deadline:
                raise RuntimeError("the routers did not reach the replica (or its events)")
            await asyncio.sleep(0.1)
        async with httpx.AsyncClient(timeout=600) as client:
            for i in range(documents):
                prompt = _document(i)
                tokens = (await client.post(url + "/tokenize", json={"model": "demo", "prompt": prompt})).json()["tokens"]
                digests = {name: next(iter(r.digests_for(tokens).values())) for name, r in routers.items()}
                done = asyncio.Event()
                known: dict[str, float] = {}

                async def watch(name: str, router: Router, ds: list[bytes], done: asyncio.Event = done,
                                known: dict[str, float] = known) -> None:
                    while router.index.matched(url, ds) < len(ds):
                        await asyncio.sleep(0.002)
                    known[name] = time.monotonic()
                    await done.wait()

                watchers = [asyncio.create_task(watch(n, r, digests[n])) for n, r in routers.items()]
                r = await client.post(url + "/v1/completions", json={"model": "demo", "prompt": prompt, "max_tokens": 1})
                r.raise_for_status()
                answered = time.monotonic()
                while len(known) < len(routers):
                    await asyncio.sleep(0.01)
                    if time.monotonic() - answered > 30:
                        raise RuntimeError(f"document {i}: {sorted(set(routers) - set(known))} never learned it")
                done.set()
                await asyncio.gather(*watchers)
                for name in routers:
                    lags[name].append(known[name] - answered)
                print(f"document {i}: " + ", ".join(f"{n} {lags[n][-1] * 1000:+.0f} ms" for n in routers),
                      file=sys.stderr)
    finally:
        for r in routers.values():
            await r.stop()
    return lags


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--documents", type=int, default=12)
    ap.add_argument("--out", type=Path, default=Path("bench/results/kv-events-staleness.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvdrive-staleness-") as tmp:
        port, events, replay = free_port(), free_port(), free_port()
        replica = Proc(["serve", "--model", "demo", "--port", str(port), "--gpu-budget", GPU_BUDGET,
                        "--dram-budget", DRAM_BUDGET, "--ssd-dir", f"{tmp}/ssd", "--ssd-budget", "1GiB",
                        "--threads", "1", "--kv-events-endpoint", f"tcp://*:{events}",
                        "--kv-events-replay-endpoint", f"tcp://*:{replay}"], port, Path(tmp) / "serve.log")
        replica.start()
        try:
            lags = asyncio.run(_measure(replica.url, args.documents))
        finally:
            replica.stop()
    # the events router hears a page a few ms after a tier publishes it (tests/kvcache/test_kv_events.py: 4 ms over
    # TCP), so its time is the store time here; the polling router's lag behind it is its staleness
    lags["polling, behind kv events"] = [p - e for p, e in zip(lags["polling"], lags["kv events"], strict=True)]
    rows = {name: {"median_ms": round(statistics.median(v) * 1000, 1), "max_ms": round(max(v) * 1000, 1),
                   "min_ms": round(min(v) * 1000, 1), "samples_ms": [round(x * 1000, 1) for x in v]}
            for name, v in lags.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    table = ["| router | median ms | min ms | max ms |", "| --- | --- | --- | --- |"]
    table += [f"| {n} | {r['median_ms']:+.1f} | {r['min_ms']:+.1f} | {r['max_ms']:+.1f} |" for n, r in rows.items()]
    md = ("# Router staleness: a document's pages stored on a replica -> the router knows them\n\n"
          f"{args.documents} documents of ~1.3K tokens sent straight to one demo replica (1 compute thread, "
          "max_tokens 1); time from each answer until the router's index holds all of the document's pages "
          "(negative: before the answer returned: a page counts as stored when its first layer is, early in the "
          "step that computes it, as in the page list). Polling: the router's defaults (replica every 1 s, page "
          "list every 2 s). The last row is the polling router's lag behind the events router, which hears a page "
          "within a few ms of its store (4 ms over TCP in tests/kvcache/test_kv_events.py): the staleness that "
          "KV events remove. Command: "
          f"`.venv/bin/python bench/kv_events_staleness.py --documents {args.documents}`.\n\n" + "\n".join(table) + "\n")
    args.out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
