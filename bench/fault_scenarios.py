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
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "operator"))  # the live tests' server launcher

from liveservers import Server, start, wait_ready  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from diskkit import extents_beyond, fill, free_bytes, loop_fs, sh  # noqa: E402
from faultclient import load, probe, sequential, summarize  # noqa: E402
from faultlog import log_report, parse_log  # noqa: E402
from faultreport import markdown  # noqa: E402

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
    ap.add_argument("--gpu-budget", default="16MiB",
                    help="the device envelope: 4 rows' open pages and 4 decode step buffers take 9 MiB of it")
    ap.add_argument("--dram-budget", default="16MiB")
    ap.add_argument("--max-running", type=int, default=4, help="sequences running at once (each reserves a step buffer)")
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
