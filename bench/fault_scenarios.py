"""Fault scenarios: real `kvdrive serve` processes (demo model) against the SSD faults an operator meets.

  .venv/bin/python bench/fault_scenarios.py --out bench/results/faults.json   (as root: loop mounts; ~8 min)

0. A clean server (fresh SSD directory) answers every prompt used below greedily (temperature 0,
   ``ignore_eos``, --max-tokens tokens): the reference each later answer is compared with.
1. deleted-slabs: a server stores a few ~1.5K-token prompts (thousands of SSD blocks), stops with SIGTERM
   (graceful: the index is flushed); slab-00001.kv is deleted and slab-00002.kv cut to half its size; a
   server restarts on the same directory and answers the same prompts again plus new ones. Reported: SSD
   blocks in the index before the stop and after the restart, what the startup check logged, time to
   ready (first start and restart), each request's latency.
2. disk-full: an ext4 image (--full-image-mib, mounted on a loop device) filled so that --full-free-mib
   are free; the server runs with its SSD tier there and --ssd-budget 32MiB (more than fits); prompts
   for --seconds; halfway, the rest of the filesystem is filled too (the disk fills up while serving).
3. eio: an ext4 image without a journal on a loop device; the server stores prompts there, then the
   loop device is shrunk under the mounted filesystem (the backing file truncated to --eio-keep-mib, then
   ``losetup -c``): every read or write of a block past the new end fails with EIO from the block layer
   ("attempt to access beyond end of device"). Prompts for --seconds while the errors happen. (This
   kernel has no device-mapper, so dm-error / dm-flakey are not available; the shrink is the real-EIO
   stand-in: a linear target switched to ``error`` over part of the disk.)

For each scenario: requests served (and how many greedy answers equal the clean server's), the HTTP
status codes seen (there must be no 5xx), finish reasons, faults in /metrics
(``kvdrive_tier_faults_total{tier,kind}``, ``kvdrive_tier_degraded{tier}``), what /readyz says, and the
server log's fault lines per kind: their count, per 10 s window of the scenario's duration (the
requirement: at most 1), and the most lines of one kind within any 10 s. Writes --out (JSON) and a
table beside it (.md). Loop devices, mounts and images are removed in finally blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "operator"))  # the live tests' server launcher

from liveservers import Server, start, wait_ready  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from diskkit import extents_beyond, fill, free_bytes, loop_fs, sh  # noqa: E402
from faultlog import log_report, parse_log  # noqa: E402

from kvdrive.runtime.bench.texts import haystack_words  # noqa: E402

MiB = 1 << 20
TOKEN = "faults-token"


# --- prompts -----------------------------------------------------------------------------------------
def long_prompt(i: int) -> str:
    """~1.5K tokens (about 94 pages: 2,800 blocks of the demo model's 30 layers)."""
    return f"Report {i}. " + haystack_words(random.Random(7000 + i), 125) + "\nPlaces named:"


def mid_prompt(i: int) -> str:
    """~380 tokens: fits a server whose SSD tier holds only a few hundred blocks."""
    return f"Note {i}. " + haystack_words(random.Random(9000 + i), 30) + "\nSummary:"


def prompt_set(n_long: int, n_mid: int) -> dict[str, str]:
    return {**{f"long{i}": long_prompt(i) for i in range(n_long)}, **{f"mid{i}": mid_prompt(i) for i in range(n_mid)}}


# --- requests ----------------------------------------------------------------------------------------
@dataclass
class Result:
    name: str
    status: str  # HTTP status, or the exception's name when no answer came
    seconds: float
    text: str = ""
    finish: str = ""
    identical: bool | None = None


async def greedy(client: httpx.AsyncClient, server: Server, name: str, prompt: str, max_tokens: int) -> Result:
    t0 = time.perf_counter()
    try:
        r = await client.post(f"{server.url}/v1/completions", timeout=600, json={
            "model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    except httpx.HTTPError as exc:
        return Result(name, type(exc).__name__, time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    if r.status_code != 200:
        return Result(name, str(r.status_code), seconds, r.text[:2000])
    choice = r.json()["choices"][0]
    return Result(name, "200", seconds, choice["text"], str(choice.get("finish_reason")))


def judge(results: list[Result], ref: dict[str, str]) -> None:
    for r in results:
        r.identical = r.status == "200" and r.text == ref.get(r.name)


def pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {"p50": round(statistics.median(values), 2), "max": round(max(values), 2), "n": len(values)}


def summarize(results: list[Result], ref: dict[str, str]) -> dict[str, Any]:
    judge(results, ref)
    status: dict[str, int] = {}
    finish: dict[str, int] = {}
    for r in results:
        status[r.status] = status.get(r.status, 0) + 1
        if r.finish:
            finish[r.finish] = finish.get(r.finish, 0) + 1
    return {
        "requests": len(results), "status": status, "http_5xx": sum(n for s, n in status.items() if s.startswith("5")),
        "no_answer": sum(n for s, n in status.items() if not s.isdigit()), "finish_reasons": finish,
        "identical": sum(bool(r.identical) for r in results),
        "different": [{"prompt": r.name, "status": r.status, "got": r.text[:120], "want": ref.get(r.name, "")[:120]}
                      for r in results if not r.identical][:10],
        "latency_s": pct([r.seconds for r in results if r.status == "200"]),
        "errors": error_messages(results),
    }


def error_messages(results: list[Result]) -> dict[str, int]:
    """Distinct error messages of the answers that were not 200 (numbers and hashes blanked), with counts."""
    out: dict[str, int] = {}
    for r in results:
        if r.status == "200":
            continue
        try:
            message = json.loads(r.text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text or r.status
        key = f"{r.status}: " + re.sub(r"BlockKey\([^)]*\)", "BlockKey(..)", message)[:140]
        out[key] = out.get(key, 0) + 1
    return out


async def sequential(server: Server, named: list[tuple[str, str]], max_tokens: int, desc: str) -> list[Result]:
    async with httpx.AsyncClient() as client:
        return [await greedy(client, server, n, p, max_tokens) for n, p in tqdm(named, desc=desc)]


async def load(server: Server, named: list[tuple[str, str]], seconds: float, clients: int, max_tokens: int,
               desc: str, halfway: Any = None) -> list[Result]:
    """``clients`` greedy clients cycling through ``named`` for ``seconds``; ``halfway()`` runs at half time."""
    results: list[Result] = []
    deadline = time.monotonic() + seconds

    async def client_loop(client: httpx.AsyncClient, w: int) -> None:
        n = w * max(1, len(named) // clients)
        while time.monotonic() < deadline:
            name, p = named[n % len(named)]
            results.append(await greedy(client, server, name, p, max_tokens))
            n += 1

    async def clock() -> None:
        with tqdm(total=int(seconds), desc=desc) as bar:
            done_half = False
            while (left := deadline - time.monotonic()) > 0:
                await asyncio.sleep(min(1.0, left))
                bar.n = int(seconds - max(0.0, deadline - time.monotonic()))
                bar.refresh()
                if halfway is not None and not done_half and time.monotonic() > deadline - seconds / 2:
                    done_half = True
                    halfway()

    async with httpx.AsyncClient() as client:
        await asyncio.gather(clock(), *(client_loop(client, w) for w in range(clients)))
    return results


# --- the server's view ---------------------------------------------------------------------------------
def metrics_of(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, labels, value in re.findall(r"^(kvdrive_[a-z_]+)(\{[^}]*\})? (\S+)$", text, re.M):
        out[name + labels] = float(value)
    return out


def labeled(m: dict[str, float], metric: str) -> dict[str, float]:
    """{"tier/kind" or "tier": value} of one labeled metric."""
    out: dict[str, float] = {}
    for key, value in m.items():
        if key.startswith(metric + "{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', key))
            out["/".join(labels[k] for k in ("tier", "kind", "outcome") if k in labels)] = value
    return out


async def probe(server: Server) -> dict[str, Any]:
    """/readyz, the fault metrics and the SSD tier as /admin/tiers reports it."""
    async with httpx.AsyncClient(timeout=30) as client:
        rz = await client.get(f"{server.url}/readyz")
        m = metrics_of((await client.get(f"{server.url}/metrics")).text)
        tiers = (await client.get(f"{server.url}/admin/tiers", headers=server.admin())).json()["tiers"]
        models = (await client.get(f"{server.url}/v1/models")).json()["data"]
    ssd = next((t for t in tiers if t["tier"] == "ssd"), {})
    try:
        body: Any = rz.json()
    except ValueError:
        body = rz.text
    return {
        "readyz": {"status": rz.status_code, "body": body},
        "faults": labeled(m, "kvdrive_tier_faults_total"), "degraded": labeled(m, "kvdrive_tier_degraded"),
        "ssd_blocks": ssd.get("pages"), "ssd_capacity_bytes": ssd.get("capacity_bytes"),
        "ssd_errors": ssd.get("errors"), "page_misses": m.get("kvdrive_page_misses_total"),
        "prefix_hit_pages": m.get("kvdrive_prefix_hit_pages_total"),
        "page_reads": labeled(m, "kvdrive_page_reads_total"), "max_model_len": models[0].get("max_model_len"),
    }


# --- server processes ----------------------------------------------------------------------------------
def server_flags(args: argparse.Namespace, *extra: str) -> tuple[str, ...]:
    return ("--gpu-budget", args.gpu_budget, "--dram-budget", args.dram_budget, "--max-running", str(args.max_running),
            "--threads", str(args.threads), *extra)


async def launch(tmp: Path, args: argparse.Namespace, *extra: str) -> tuple[Server, float]:
    """Start a server; returns it and its seconds to ready."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "admin").touch(mode=0o600)  # start() rewrites it, keeping the mode: no world-readable warning
    t0 = time.monotonic()
    server = start(tmp, TOKEN, *server_flags(args, *extra))
    try:
        await wait_ready(server)
    except BaseException:
        stop(server)
        raise
    return server, round(time.monotonic() - t0, 2)


def stop(server: Server) -> dict[str, Any]:
    """SIGTERM; returns the exit status and how long the graceful shutdown took."""
    if server.process.poll() is not None:
        return {"exit": server.process.returncode, "seconds": 0.0, "already_exited": True}
    t0 = time.monotonic()
    server.process.terminate()
    try:
        server.process.wait(90)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
        return {"exit": server.process.returncode, "seconds": round(time.monotonic() - t0, 2), "killed": True}
    return {"exit": server.process.returncode, "seconds": round(time.monotonic() - t0, 2)}


# --- scenarios ---------------------------------------------------------------------------------------------
async def reference(args: argparse.Namespace, work: Path, prompts: dict[str, str]) -> dict[str, Any]:
    server, ready = await launch(work / "clean", args, "--ssd-budget", "256MiB")
    try:
        results = await sequential(server, list(prompts.items()), args.max_tokens, "clean reference")
    finally:
        stopped = stop(server)
    bad = [r for r in results if r.status != "200"]
    if bad:
        raise RuntimeError(f"the clean server failed: {[asdict(r) for r in bad]}")
    return {"ready_s": ready, "stop": stopped, "outputs": {r.name: r.text for r in results},
            "latency_s": {r.name: round(r.seconds, 2) for r in results}}


async def deleted_slabs(args: argparse.Namespace, work: Path, ref: dict[str, str]) -> dict[str, Any]:
    ssd = work / "s1-ssd"
    seeds = [(f"long{i}", long_prompt(i)) for i in range(args.seed_prompts)]
    fresh = [(f"long{i}", long_prompt(i)) for i in range(args.seed_prompts, args.seed_prompts + args.new_prompts)]
    server, ready_first = await launch(work / "s1-first", args, "--ssd-dir", str(ssd), "--ssd-budget", "256MiB")
    try:
        first = await sequential(server, seeds, args.max_tokens, "1 store prompts")
        before = await probe(server)
    finally:
        stop_first = stop(server)
    slabs = sorted(p.name for p in ssd.glob("slab-*.kv"))
    damage = damage_slabs(ssd)
    t_restart = time.time()
    server, ready_restart = await launch(work / "s1-restart", args, "--ssd-dir", str(ssd), "--ssd-budget", "256MiB")
    try:
        after_start = await probe(server)
        again = await sequential(server, seeds + fresh, args.max_tokens, "1 after restart")
        after = await probe(server)
    finally:
        stop_restart = stop(server)
    startup = [m for _, _, m in parse_log(server.log) if "ssd index" in m or "indexed blocks" in m
               or "sampled check" in m or m.startswith("ssd tier ")]
    return {
        "slabs_before": slabs, "damage": damage,
        "index_blocks_before_stop": before["ssd_blocks"], "index_blocks_after_restart": after_start["ssd_blocks"],
        "ready_s": {"first_start": ready_first, "restart": ready_restart},
        "stop": {"first": stop_first, "restart": stop_restart}, "startup_log": startup,
        "first_run": summarize(first, ref), "after_restart": summarize(again, ref),
        "latency_s": {"first_run": {r.name: round(r.seconds, 2) for r in first},
                      "after_restart": {r.name: round(r.seconds, 2) for r in again}},
        "probe_after_restart": after_start, "probe_end": after,
        "log": log_report(server.log, t_restart, time.time()),
    }


def damage_slabs(ssd: Path) -> dict[str, Any]:
    """Delete slab-00001.kv and cut slab-00002.kv to half its size (when they exist)."""
    out: dict[str, Any] = {"deleted": [], "truncated": {}}
    one, two = ssd / "slab-00001.kv", ssd / "slab-00002.kv"
    if one.exists():
        one.unlink()
        out["deleted"].append(one.name)
    if two.exists():
        size = two.stat().st_size
        os.truncate(two, size // 2)
        out["truncated"][two.name] = {"from": size, "to": size // 2}
    return out


async def disk_full(args: argparse.Namespace, work: Path, ref: dict[str, str]) -> dict[str, Any]:
    mnt, image = work / "s2-mnt", work / "s2-ext4.img"
    pool = [(f"mid{i}", mid_prompt(i)) for i in range(args.mid_prompts)]
    with loop_fs(image, args.full_image_mib, mnt, ("-m", "0")) as dev:
        free_at_mount = free_bytes(mnt)
        filled = fill(mnt / "filler", args.full_free_mib * MiB)
        free_before = free_bytes(mnt)
        filled_later: dict[str, int] = {}

        def fill_rest() -> None:
            filled_later["free_before"] = free_bytes(mnt)
            filled_later["written"] = fill(mnt / "filler2", 0)
            filled_later["free_after"] = free_bytes(mnt)

        t0 = time.time()
        server, ready = await launch(work / "s2", args, "--ssd-dir", str(mnt / "ssd"), "--ssd-budget", "32MiB")
        try:
            start_probe = await probe(server)
            results = await load(server, pool, args.seconds, args.clients, args.max_tokens, "2 disk full (s)",
                                 halfway=fill_rest if args.fill_halfway else None)
            end = await probe(server)
        finally:
            stopped = stop(server)
        t1 = time.time()
        disk = {"device": dev, "image_mib": args.full_image_mib, "free_at_mount": free_at_mount, "filler": filled,
                "free_at_server_start": free_before, "filled_halfway": filled_later,
                "ssd_dir_bytes": sum(p.stat().st_size for p in (mnt / "ssd").glob("*") if p.is_file())}
    return {"disk": disk, "ready_s": ready, "probe_start": start_probe, "probe_end": end, "stop": stopped,
            "load": summarize(results, ref), "log": log_report(server.log, t0, t1)}


async def eio(args: argparse.Namespace, work: Path, ref: dict[str, str]) -> dict[str, Any]:
    mnt, image = work / "s3-mnt", work / "s3-ext4.img"
    pool = [(f"mid{i}", mid_prompt(i)) for i in range(args.mid_prompts)]
    with loop_fs(image, args.eio_image_mib, mnt, ("-m", "0", "-O", "^has_journal")) as dev:
        server, ready = await launch(work / "s3", args, "--ssd-dir", str(mnt / "ssd"), "--ssd-budget",
                                     f"{args.eio_ssd_mib}MiB")
        try:
            warm = await sequential(server, pool, args.max_tokens, "3 store prompts")
            before = await probe(server)
            cut = args.eio_keep_mib * MiB
            slabs = {p.name: extents_beyond(p, cut) for p in sorted((mnt / "ssd").glob("slab-*.kv"))}
            t0 = time.time()
            os.truncate(image, cut)  # the loop device's backing file ...
            sh("losetup", "-c", dev)  # ... and the device's new size: I/O past it fails with EIO
            size_after = int(sh("blockdev", "--getsize64", dev))
            results = await load(server, pool, args.seconds, args.clients, args.max_tokens, "3 EIO (s)")
            end = await probe(server)
        finally:
            stopped = stop(server)
        t1 = time.time()
    beyond = sum(b for b, _ in slabs.values())
    mapped = sum(t for _, t in slabs.values())
    return {
        "device": {"loop": dev, "image_mib": args.eio_image_mib, "cut_to_bytes": cut, "size_after": size_after,
                   "slab_bytes_past_cut": beyond, "slab_bytes_mapped": mapped,
                   "fraction_past_cut": round(beyond / mapped, 3) if mapped else None,
                   "per_slab": {k: {"past_cut": b, "mapped": t} for k, (b, t) in slabs.items()}},
        "ready_s": ready, "warm": summarize(warm, ref), "probe_before_fault": before, "probe_end": end,
        "stop": stopped, "load": summarize(results, ref), "log": log_report(server.log, t0, t1),
    }


# --- output --------------------------------------------------------------------------------------------------
def faults_cell(p: dict[str, Any]) -> str:
    f = ", ".join(f"{k} {int(v)}" for k, v in p["faults"].items()) or "none"
    d = ", ".join(k for k, v in p["degraded"].items() if v) or "none"
    return f"{f}; degraded: {d}"


def readyz_cell(p: dict[str, Any]) -> str:
    b = p["readyz"]["body"]
    if isinstance(b, dict):
        why = "; ".join(f"{k}: {v}" for k, v in b.get("degraded", {}).items())
        return f"{p['readyz']['status']} {b.get('status')}" + (f" ({why})" if why else "")
    return f"{p['readyz']['status']} {str(b)[:80]}"


def logs_cell(lg: dict[str, Any]) -> str:
    parts = [f"{k}: {v['lines']} lines, {v['per_10s_window']}/10 s, max {v['max_in_any_10s']} in 10 s"
             for k, v in lg["fault_lines"].items()]
    return ("; ".join(parts) or "no fault lines") + f" ({lg['duration_s']} s; {lg['warning_error_lines']} warn/error)"


def served_cell(s: dict[str, Any]) -> str:
    status = ", ".join(f"{k}: {v}" for k, v in sorted(s["status"].items()))
    return f"{s['identical']}/{s['requests']} identical; status {status}; 5xx {s['http_5xx']}"


def scenario_row(title: str, s: dict[str, Any], served: str, extra: str) -> tuple[str, ...]:
    """One scenario's table row: its answers (``s[served]``), then what /metrics, /readyz and the log said."""
    return (title, served_cell(s[served]), faults_cell(s["probe_end"]), readyz_cell(s["probe_end"]),
            logs_cell(s["log"]), extra)


def markdown(res: dict[str, Any]) -> str:
    rows = []
    s1 = res.get("deleted_slabs")
    if isinstance(s1, dict) and "after_restart" in s1:
        extra = (f"index blocks {s1['index_blocks_before_stop']} -> {s1['index_blocks_after_restart']}; ready "
                 f"{s1['ready_s']['first_start']} s / restart {s1['ready_s']['restart']} s; latency after restart "
                 f"p50 {s1['after_restart']['latency_s'].get('p50')} s, max {s1['after_restart']['latency_s'].get('max')} s "
                 f"(first run max {s1['first_run']['latency_s'].get('max')} s)")
        rows.append(scenario_row("1 deleted slabs + restart", s1, "after_restart", extra))
    s2 = res.get("disk_full")
    if isinstance(s2, dict) and "load" in s2:
        extra = (f"{s2['disk']['free_at_server_start'] // MiB} MiB free at start; ssd capacity "
                 f"{(s2['probe_start']['ssd_capacity_bytes'] or 0) // MiB} MiB; latency p50 "
                 f"{s2['load']['latency_s'].get('p50')} s max {s2['load']['latency_s'].get('max')} s")
        rows.append(scenario_row("2 disk full", s2, "load", extra))
    s3 = res.get("eio")
    if isinstance(s3, dict) and "load" in s3:
        extra = (f"{s3['device']['fraction_past_cut']} of slab bytes past the cut; latency p50 "
                 f"{s3['load']['latency_s'].get('p50')} s max {s3['load']['latency_s'].get('max')} s; "
                 f"stop exit {s3['stop'].get('exit')} in {s3['stop'].get('seconds')} s")
        rows.append(scenario_row("3 EIO (loop device shrunk)", s3, "load", extra))
    head = "| scenario | served | faults in /metrics | /readyz | fault log lines | other |\n| --- | --- | --- | --- | --- | --- |\n"
    body = "".join("| " + " | ".join(c.replace("|", "/") for c in r) + " |\n" for r in rows)
    errors = [f"- {name}: {n} x `{msg}`\n" for name in ("deleted_slabs", "disk_full", "eio")
              for part in ("after_restart", "load") if isinstance(res.get(name), dict) and part in res[name]
              for msg, n in res[name][part]["errors"].items()]
    if errors:
        body += "\nNon-200 answers:\n" + "".join(errors)
    failed = {k: v for k, v in res.items() if isinstance(v, dict) and "error" in v}
    tail = "".join(f"\n**{k} failed**: {v['error']}\n" for k, v in failed.items())
    return f"# Fault scenarios\n\n`{res['command']}`\n\n{head}{body}{tail}"


async def run_all(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    prompts = prompt_set(args.seed_prompts + args.new_prompts, args.mid_prompts)
    res: dict[str, Any] = {"command": " ".join([".venv/bin/python", "bench/fault_scenarios.py", *sys.argv[1:]])}
    clean = await reference(args, work, prompts)
    res["reference"] = clean
    ref = clean["outputs"]
    for name, fn in (("deleted_slabs", deleted_slabs), ("disk_full", disk_full), ("eio", eio)):
        if name not in args.only:
            continue
        try:
            res[name] = await fn(args, work, ref)
        except Exception as exc:  # one scenario failing (e.g. no loop devices) still reports the others
            res[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{name} failed: {exc}", file=sys.stderr)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gpu-budget", default="8MiB")
    ap.add_argument("--dram-budget", default="16MiB")
    ap.add_argument("--max-running", type=int, default=4, help="8MiB of device tier fits the open pages of 4")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=60.0, help="load per fault scenario (2, 3)")
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--seed-prompts", type=int, default=3, help="scenario 1: ~1.5K-token prompts stored")
    ap.add_argument("--new-prompts", type=int, default=2, help="scenario 1: new prompts after the restart")
    ap.add_argument("--mid-prompts", type=int, default=6, help="scenarios 2, 3: ~380-token prompts cycled")
    ap.add_argument("--full-image-mib", type=int, default=40)
    ap.add_argument("--full-free-mib", type=int, default=20)
    ap.add_argument("--no-fill-halfway", dest="fill_halfway", action="store_false",
                    help="scenario 2: do not fill the rest of the disk halfway through")
    ap.add_argument("--eio-image-mib", type=int, default=160)
    ap.add_argument("--eio-ssd-mib", type=int, default=96)
    ap.add_argument("--eio-keep-mib", type=int, default=64, help="scenario 3: device size after the shrink")
    ap.add_argument("--only", nargs="+", default=["deleted_slabs", "disk_full", "eio"],
                    choices=["deleted_slabs", "disk_full", "eio"])
    ap.add_argument("--workdir", type=Path, default=None, help="keep the servers' logs here (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "faults.json")
    args = ap.parse_args()
    if os.geteuid() != 0 and ({"disk_full", "eio"} & set(args.only)):
        ap.error("scenarios disk_full and eio need root (loop devices, mount)")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))  # run the finally blocks
    tmp = tempfile.mkdtemp(prefix="kvdrive-faults-")
    work = args.workdir or Path(tmp)
    work.mkdir(parents=True, exist_ok=True)
    try:
        res = asyncio.run(run_all(args, work))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2, default=str) + "\n")
    args.out.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
