"""Decode throughput across the tiers: kvdrive against the baselines, same workload, same binary.

For each (context, batch): distinct filler prompts are prefilled once into the SSD tier (content-
addressed pages persist there); then every mode opens the same prompts (prefix reuse reads the pages
once and places them as a prefill would: newest on the device tier, then DRAM, then SSD), decodes
``warmup`` steps, and is timed over ``steps`` greedy decode steps. Budgets are fractions of the
workload's total KV (device 10%, DRAM 25%, SSD holds everything: it is write-through). Reference
modes keep everything in the device tier: ``full`` (exact attention) and ``sparse-gpu`` (kvdrive's page
selection, no I/O), whose step time is the compute time the tiered modes are compared against.
"""

from __future__ import annotations

import gc
import logging
import platform
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from kvdrive.runtime.bench.texts import filler_tokens
from kvdrive.runtime.engine import EngineConfig, Generator, TierConfig
from kvdrive.runtime.model import LoadedModel, load_model

log = logging.getLogger(__name__)

MODES = ("full", "sparse-gpu", "kvdrive", "lru", "ondemand", "fullfetch")


@dataclass(frozen=True)
class ModeResult:
    mode: str
    context: int
    batch: int
    tokens_per_s: float
    step_ms: float
    fetch_wait_ms_per_step: float  # time a step waited for tier reads
    io_busy_ms_per_step: float  # transfer-thread time (prefetch, write-back) per step
    read_bytes_per_token: dict[str, float]  # tier -> bytes attention read from that tier per token
    moved_bytes_per_token: dict[str, float]  # "src->dst" -> bytes moved between tiers per token
    prefetch: dict[str, int]
    budgets: dict[str, int]


@dataclass(frozen=True)
class DecodeBenchResult:
    model: str
    threads: int
    token_budget: int
    steps: int
    warmup: int
    kv_bytes_per_token: int
    results: list[ModeResult] = field(default_factory=list)
    host: str = ""


def _config(mode: str, total: int, batch: int, page_bytes: int, ssd_dir: str, ssd_budget: int,
            token_budget: int) -> EngineConfig:
    tails = batch * page_bytes
    if mode in ("full", "sparse-gpu"):
        gpu, dram, placement = int(total * 1.1) + tails + 4 * page_bytes, 0, "kvdrive"
    else:
        gpu, dram, placement = max(int(total * 0.10), 2 * page_bytes) + tails, int(total * 0.25), mode
    tiers = TierConfig(gpu_bytes=gpu, dram_bytes=dram, ssd_dir=ssd_dir, ssd_bytes=ssd_budget)
    return EngineConfig(tiers=tiers, placement=placement, full_attention=mode == "full", token_budget=token_budget,
                        max_sequences=batch)


def _prefill_all(loaded: LoadedModel, prompts: list[list[int]], ssd_dir: str, ssd_budget: int) -> None:
    """Store every prompt's pages on the SSD tier once (skips prompts already stored)."""
    gen = Generator(loaded, EngineConfig(tiers=TierConfig(ssd_dir=ssd_dir, ssd_bytes=ssd_budget), max_sequences=1))
    try:
        for p in tqdm(prompts, desc="prefill into the SSD tier", leave=False):
            if len(gen.cache.stored_prefix(p)) >= (len(p) - 1) // gen.cache.layout.page_size:
                continue  # stored by an earlier run
            seq, reused = gen.open_sequence(p)
            gen.prefill(seq, p[reused:])
            gen.release(seq)
    finally:
        gen.close()


def _snapshot(gen: Generator) -> dict[str, object]:
    c = gen.cache
    return {"reads": c.page_reads(), "moved": dict(c.store.transfer_bytes), "prefetch": c.placer.ledger.counts(),
            "wait": c.fetch_wait_seconds, "busy": sum(c.transfers.busy_seconds.values())}


def _run_mode(loaded: LoadedModel, mode: str, prompts: list[list[int]], cfg: EngineConfig, steps: int,
              warmup: int) -> tuple[float, dict[str, object], dict[str, object], dict[str, int]]:
    t0 = time.perf_counter()
    gen = Generator(loaded, cfg)
    try:
        seqs, last = [], []
        t1 = time.perf_counter()
        for p in prompts:
            seq, reused = gen.open_sequence(p)
            logits = gen.prefill(seq, p[reused:])
            seqs.append(seq)
            last.append(int(logits.argmax()))
        t2 = time.perf_counter()
        log.info("%s: tiers ready in %.1fs, %d prompts opened (prefix reuse) in %.1fs", mode, t1 - t0, len(prompts),
                 t2 - t1)
        for _ in range(warmup):
            last = gen.decode(list(zip(seqs, last, strict=True))).argmax(dim=-1).tolist()
        before = _snapshot(gen)
        t = time.perf_counter()
        for _ in range(steps):
            last = gen.decode(list(zip(seqs, last, strict=True))).argmax(dim=-1).tolist()
        elapsed = time.perf_counter() - t
        after = _snapshot(gen)
        budgets = {u.tier: u.budget_bytes for u in gen.cache.usage()}
        return elapsed, before, after, budgets
    finally:
        gen.close()


def _delta(before: dict[str, object], after: dict[str, object], key: str) -> dict[object, float]:
    b, a = before[key], after[key]
    assert isinstance(a, dict) and isinstance(b, dict)
    return {k: a[k] - b.get(k, 0) for k in a}


def run_decode_bench(ssd_dir: str, model: str = "demo", contexts: tuple[int, ...] = (4096, 7168),
                     batches: tuple[int, ...] = (1, 4), modes: tuple[str, ...] = MODES, steps: int = 16,
                     warmup: int = 4, token_budget: int = 1024, ssd_budget: int | None = None,
                     loaded: LoadedModel | None = None) -> DecodeBenchResult:
    loaded = loaded or load_model(model)
    probe = Generator(loaded, EngineConfig(max_sequences=1))
    layout = probe.cache.layout
    probe.close()
    del probe
    per_token = layout.page_bytes // layout.page_size
    bmax = max(batches)
    # the shorter contexts are prefixes of the longest prompts: one prefill serves every case
    longest = [filler_tokens(loaded.tokenizer, max(contexts), seed=1000 + i) for i in range(bmax)]
    prompts = {ctx: [p[:ctx] for p in longest] for ctx in contexts}
    need = max(contexts) * bmax * per_token
    ssd_budget = max(ssd_budget or 0, int(need * 1.5) + (256 << 20))  # never below what the prompts need
    _prefill_all(loaded, longest, ssd_dir, ssd_budget)
    out = DecodeBenchResult(model=loaded.model_id, threads=torch.get_num_threads(), token_budget=token_budget,
                            steps=steps, warmup=warmup, kv_bytes_per_token=per_token, host=platform.node())
    cases = [(ctx, b, m) for ctx in contexts for b in batches for m in modes]
    for ctx, b, mode in tqdm(cases, desc="decode modes"):
        cfg = _config(mode, ctx * b * per_token, b, layout.page_bytes, ssd_dir, ssd_budget, token_budget)
        elapsed, before, after, budgets = _run_mode(loaded, mode, prompts[ctx][:b], cfg, steps, warmup)
        gc.collect()
        tokens = steps * b
        block = layout.block_bytes
        reads = {str(t): n * block / tokens for t, n in _delta(before, after, "reads").items()}
        moved = {f"{s}->{d}": n / tokens for (s, d), n in _delta(before, after, "moved").items()}  # type: ignore[misc]
        pf = {str(k): int(v) for k, v in _delta(before, after, "prefetch").items()}
        wait = float(after["wait"]) - float(before["wait"])  # type: ignore[arg-type]
        busy = float(after["busy"]) - float(before["busy"])  # type: ignore[arg-type]
        out.results.append(ModeResult(mode, ctx, b, tokens / elapsed, 1000 * elapsed / steps, 1000 * wait / steps,
                                      1000 * busy / steps, reads, moved, pf, budgets))
    return out


def as_dict(result: DecodeBenchResult) -> dict[str, object]:
    return asdict(result)


def table(result: DecodeBenchResult) -> str:
    rows = ["| context | batch | mode | tokens/s | step ms | fetch wait ms | io busy ms | read MB/token (gpu/dram/ssd) "
            "| prefetch hit/late/wasted |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result.results:
        rd = "/".join(f"{r.read_bytes_per_token.get(t, 0) / 1e6:.2f}" for t in ("gpu", "dram", "ssd"))
        pf = "/".join(str(r.prefetch.get(k, 0)) for k in ("hit", "late", "wasted"))
        rows.append(f"| {r.context} | {r.batch} | {r.mode} | {r.tokens_per_s:.2f} | {r.step_ms:.0f} | "
                    f"{r.fetch_wait_ms_per_step:.0f} | {r.io_busy_ms_per_step:.0f} | {rd} | {pf} |")
    return "\n".join(rows)


def ratios(result: DecodeBenchResult) -> str:
    """kvdrive against each baseline per (context, batch), with the ceiling this host allows: no
    placement can beat ``sparse-gpu`` (same selection, every page already in the device tier, no I/O),
    so sparse-gpu / ondemand bounds what any tier policy can gain over ondemand here."""
    rows = ["| context | batch | vs ondemand | vs lru | vs fullfetch | vs full | ceiling vs ondemand (sparse-gpu / "
            "ondemand) | step / compute floor (sparse-gpu step) | prefetch used / issued |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    by = {(r.context, r.batch, r.mode): r for r in result.results}
    for ctx, b in sorted({(r.context, r.batch) for r in result.results}):
        kv = by.get((ctx, b, "kvdrive"))
        if kv is None:
            continue

        def vs(mode: str, num: ModeResult = kv, ctx: int = ctx, b: int = b) -> str:
            other = by.get((ctx, b, mode))
            return f"{num.tokens_per_s / other.tokens_per_s:.2f}x" if other else "-"

        floor, ond = by.get((ctx, b, "sparse-gpu")), by.get((ctx, b, "ondemand"))
        ceiling = f"{floor.tokens_per_s / ond.tokens_per_s:.2f}x" if floor and ond else "-"
        closeness = f"{kv.step_ms / floor.step_ms:.2f}" if floor else "-"
        used = kv.prefetch.get("hit", 0) + kv.prefetch.get("late", 0)
        issued = used + kv.prefetch.get("wasted", 0)
        pf = f"{used}/{issued} ({used / issued:.0%})" if issued else "0/0"
        rows.append(f"| {ctx} | {b} | {vs('ondemand')} | {vs('lru')} | {vs('fullfetch')} | {vs('full')} | {ceiling} "
                    f"| {closeness} | {pf} |")
    return "\n".join(rows)


def plot(result: DecodeBenchResult, path: str) -> bool:
    """Grouped bars of decode tokens/s per mode for each (context, batch); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cases = sorted({(r.context, r.batch) for r in result.results})
    modes = [m for m in MODES if any(r.mode == m for r in result.results)]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(modes)
    for i, m in enumerate(modes):
        ys = [next((r.tokens_per_s for r in result.results if (r.context, r.batch) == c and r.mode == m), 0.0)
              for c in cases]
        ax.bar([j + i * width for j in range(len(cases))], ys, width, label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], [f"ctx {c} · batch {b}" for c, b in cases])
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{result.model}: decode throughput by tier policy (token budget {result.token_budget}; "
                 "device 10% / DRAM 25% of KV)")
    ax.legend(ncol=len(modes), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
