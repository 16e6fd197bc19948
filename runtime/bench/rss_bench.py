"""Server memory benchmark: the resident set of a `kvdrive serve` process as its DRAM tier fills.

Starts a real server with a device budget G and a DRAM budget B (CPU host: both tiers are host memory),
records RSS when ready (model and runtime: the fixed overhead), then sends long prompts whose KV is
several times G + B, sampling RSS throughout. Reports max RSS - idle RSS against G + B.
"""

from __future__ import annotations

import subprocess
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from kvdrive.runtime.bench.routing_fleet import free_port
from kvdrive.runtime.bench.texts import haystack_words


@dataclass(frozen=True)
class RssBenchResult:
    gpu_budget: int
    dram_budget: int
    idle_rss: int  # bytes, model loaded, no KV
    max_rss: int
    growth: int  # max - idle
    budgets: int  # gpu + dram
    overhead_over_budgets: int  # growth - budgets (activations, allocator slack, buffers)
    prompts: int
    prompt_tokens: int
    dram_used_max: int


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def run_rss_bench(kvdrive: str, ssd_dir: str, gpu_budget: int = 32 << 20, dram_budget: int = 128 << 20,
                  prompts: int = 4, prompt_words: int = 1600) -> RssBenchResult:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        proc = subprocess.Popen([kvdrive, "serve", "--model", "demo", "--port", str(port), "--gpu-budget",
                                 str(gpu_budget), "--dram-budget", str(dram_budget), "--ssd-dir", ssd_dir,
                                 "--ssd-budget", "2GiB", "--max-running", "4"],
                                stdout=log.open("w"), stderr=subprocess.STDOUT)
        try:
            for _ in range(600):
                try:
                    if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.5)
            idle = _rss(proc.pid)
            peak = [idle]
            dram_used = [0]
            stop = threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], _rss(proc.pid))
                    try:
                        tiers = httpx.get(url + "/admin/tiers", timeout=5).json()["tiers"]
                        d = next(t for t in tiers if t["tier"] == "dram")
                        dram_used[0] = max(dram_used[0], d["used_bytes"] + d["cached_bytes"])
                    except (httpx.HTTPError, KeyError, StopIteration):
                        pass
                    time.sleep(0.2)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            import random

            tokens = 0
            for i in range(prompts):
                text = haystack_words(random.Random(i), prompt_words // 10)
                r = httpx.post(url + "/v1/completions", timeout=900, json={
                    "model": "demo", "prompt": text, "max_tokens": 8, "temperature": 0})
                tokens += int(r.json()["usage"]["prompt_tokens"])
            stop.set()
            sampler.join()
            growth = peak[0] - idle
            return RssBenchResult(gpu_budget, dram_budget, idle, peak[0], growth, gpu_budget + dram_budget,
                                  growth - gpu_budget - dram_budget, prompts, tokens, dram_used[0])
        finally:
            proc.terminate()
            proc.wait(60)


def as_dict(result: RssBenchResult) -> dict[str, int]:
    return asdict(result)
