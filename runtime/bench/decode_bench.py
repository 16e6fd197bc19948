"""Decode throughput across the tiers, with the compute floor and llama.cpp measured in the same run.

For each (context, batch): distinct filler prompts are prefilled once into the SSD tier (content-
addressed pages persist there); every tiered mode then opens the same prompts (prefix reuse reads the
pages once and places them as a prefill would: newest on the device tier, then DRAM, then SSD), decodes
``warmup`` steps to reach its steady state, and is timed step by step over ``steps`` greedy steps (the
median step counts). Budgets are fractions of the case's total KV: device 10%, DRAM 25%, the SSD holds
everything (it is write-through). Rows:

- ``floor``: the same model and weights with exact attention over one contiguous KV tensor of exactly
  ``token_budget`` tokens per sequence (``floor.py``), measured before and after the case's modes (the
  faster run counts);
- ``full-gpu``: exact attention over every page, all of them on the device tier (no I/O): full attention;
- ``sparse-gpu``: kvdrive's selection and hot path with every page already on the device tier (no I/O);
- ``kvdrive``, ``lru``, ``ondemand``, ``fullfetch``: the tier policies under the budgets above;
- ``sparse-gpu-k0``, ``kvdrive-k0`` (and ``-k4``, ``-k8``): those rows under a named selection rule, when asked
  for in ``modes``: the box bound (``--selection-sketch 0``) or a key sketch of 4 or 8 bits (the plain rows
  run the engine's default, the 8-bit sketch); ``sparse-gpu-drop``, ``kvdrive-drop``, ``-means``, ``-sketch``:
  those rows under ``--selection-rest drop``, ``means`` or ``sketch`` (the plain rows: ``sketch``, the default);
- ``llama.cpp``: the same GGUF, same threads, all KV in RAM (``llama_cpp.py``), when installed.

Time to first token (``prefill_contexts``): one fresh prompt (nothing of it stored anywhere), cut to each
of those contexts, prefilled from empty by llama.cpp (after its decode rows) and by kvdrive under the
``kvdrive`` row's budgets, timed to the first token's logits.

kvdrive's step is broken down into selection, gather, misses (reads through the store), attention,
bookkeeping and the rest of the model (projections, MLPs, logits, sampling).
"""

from __future__ import annotations

import gc
import logging
import platform
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from kvdrive.runtime.attention import resolve_rest
from kvdrive.runtime.bench import llama_cpp
from kvdrive.runtime.bench.floor import floor_step_times
from kvdrive.runtime.bench.texts import filler_tokens
from kvdrive.runtime.engine import EngineConfig, ModelRunner, TierConfig
from kvdrive.runtime.kvcache.envelope import reserve_bytes
from kvdrive.runtime.kvcache.store import KVLayout
from kvdrive.runtime.model import LoadedModel, load_model
from kvdrive.runtime.model.weight_formats import weight_bytes

log = logging.getLogger(__name__)

MODES = ("full-gpu", "sparse-gpu", "kvdrive", "lru", "ondemand", "fullfetch")
SKETCH_MODES = tuple(f"{m}-k{bits}" for m in ("sparse-gpu", "kvdrive") for bits in (0, 8, 4))  # by request
REST_MODES = tuple(f"{m}-{r}" for m in ("sparse-gpu", "kvdrive") for r in ("drop", "means", "sketch"))  # by request


def split_mode(mode: str) -> tuple[str, int, str]:
    """A mode -> (its tier mode, the key sketch's bits (0: the box bound), --selection-rest): ``kvdrive-k0`` ->
    (``kvdrive``, 0, "drop"), ``kvdrive-drop`` -> (``kvdrive``, 8, "drop"); a plain mode runs the engine's
    default rule (the 8-bit sketch, the left-out pages from their sketches; the box bound drops them)."""
    if mode in MODES:
        return mode, EngineConfig.selection_sketch, resolve_rest(EngineConfig.selection_rest, EngineConfig.selection_sketch)
    if mode in SKETCH_MODES:
        base, _, bits = mode.rpartition("-k")
        return base, int(bits), resolve_rest(EngineConfig.selection_rest, int(bits))
    if mode in REST_MODES:
        base, _, rest = mode.rpartition("-")
        return base, EngineConfig.selection_sketch, rest
    raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES + SKETCH_MODES + REST_MODES)}")
PHASES = ("selection", "gather", "misses", "attention", "bookkeeping")


@dataclass(frozen=True)
class ModeResult:
    mode: str
    context: int
    batch: int
    tokens_per_s: float
    step_ms: float  # median decode step
    step_ms_p90: float
    breakdown_ms: dict[str, float] = field(default_factory=dict)  # per step: PHASES + "model"
    read_bytes_per_token: dict[str, float] = field(default_factory=dict)  # tier -> bytes attention read there
    moved_bytes_per_token: dict[str, float] = field(default_factory=dict)  # "src->dst" -> bytes moved
    prefetch: dict[str, int] = field(default_factory=dict)
    budgets: dict[str, int] = field(default_factory=dict)
    note: str = ""
    prefilled_tokens: int = 0  # prompt tokens computed at open (the rest were reused from the SSD tier)


@dataclass(frozen=True)
class PrefillResult:
    """Time to first token of one fresh prompt (nothing of it stored): prefill, then the first token."""

    engine: str  # "kvdrive" or "llama.cpp"
    context: int  # prompt tokens
    seconds: float
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.context / self.seconds


@dataclass
class DecodeBenchResult:
    model: str
    threads: int
    token_budget: int
    steps: int
    warmup: int
    kv_bytes_per_token: int
    llama_cpp: str  # "measured" or why not
    kv_dtype: str = ""  # the KV cache's dtype in the kvdrive rows and the floor
    results: list[ModeResult] = field(default_factory=list)
    host: str = ""
    device: str = "cpu"  # where the model computed and the device tier lived, named
    seconds: float = 0.0
    weights: str = "auto"  # --weights, and what it gave each projection (WeightPlan.summary)
    weight_bytes_per_step: int = 0  # bytes of weights one decode step reads (every weight once)
    bandwidth_gb_s: float = 0.0  # the device's memory bandwidth, a STREAM-like copy measured in the run
    weight_bound_ms: float = 0.0  # weight_bytes_per_step / bandwidth: no step can take less
    prefill: list[PrefillResult] = field(default_factory=list)  # time to first token, kvdrive and llama.cpp


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of a large tensor copy on ``device`` (read + write counted), best of ``repeats``: a STREAM
    "copy". The arrays (1 GiB each) are larger than this host's last-level cache (480 MiB) and a GPU's L2, so
    this is DRAM (or the GPU's HBM): the memory the weights are read from each step."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.processor() or platform.machine()})"


def _config(mode: str, total: int, batch: int, layout: KVLayout, seq_reserve: int, ssd_dir: str, ssd_budget: int,
            token_budget: int) -> EngineConfig:
    """The case's engine under ``mode``: budgets are fractions of ``total`` (the case's KV bytes in
    ``layout``, whose dtype the cache keeps)."""
    mode, sketch, rest = split_mode(mode)
    page_bytes = layout.page_bytes
    placement = "fullfetch" if mode == "full-gpu" else "kvdrive" if mode == "sparse-gpu" else mode
    # what the envelope reserves for the running sequences beside the hot tier: each one's open page (and a
    # hybrid model's sliding window) and, under sparse attention, its decode step buffer
    shape = EngineConfig(placement=placement, token_budget=token_budget, page_size=layout.page_size,
                         max_sequences=batch, kv_dtype=layout.dtype)
    tails = reserve_bytes(layout, shape, window_bytes=seq_reserve - page_bytes)
    if mode in ("full-gpu", "sparse-gpu"):
        tiers = TierConfig(envelope_bytes=int(total * 1.1) + tails + 4 * page_bytes, ssd_dir=ssd_dir, ssd_bytes=ssd_budget)
    else:
        tiers = TierConfig(envelope_bytes=max(int(total * 0.10), 2 * page_bytes) + tails, dram_bytes=int(total * 0.25),
                           ssd_dir=ssd_dir, ssd_bytes=ssd_budget)
    return EngineConfig(tiers=tiers, placement=placement, token_budget=token_budget, max_sequences=batch,
                        kv_dtype=layout.dtype, selection_sketch=sketch, selection_rest=rest)


def _prefill_all(loaded: LoadedModel, prompts: list[list[int]], contexts: tuple[int, ...], ssd_dir: str,
                 ssd_budget: int, kv_dtype: torch.dtype) -> None:
    """Store every prompt's pages on the SSD tier once (skips what an earlier run stored).

    Each prompt goes in one context at a time, shortest first, each stage reusing the one before: the pages
    are the same either way, and a hybrid model keeps its sliding window's snapshot at every stage's end, so
    each shorter context can be reused on its own (a window is kept only at a sequence's boundaries)."""
    gen = ModelRunner(loaded, EngineConfig(tiers=TierConfig(ssd_dir=ssd_dir, ssd_bytes=ssd_budget), max_sequences=1,
                                         window_checkpoint=0, kv_dtype=kv_dtype))  # the stage ends are the boundaries reused
    s = gen.cache.layout.page_size
    stages = [p[:ctx] for p in prompts for ctx in sorted(contexts)]
    try:
        for stage in tqdm(stages, desc="prefill into the SSD tier", leave=False):
            if len(gen.cache.stored_prefix(stage)) >= (len(stage) - 1) // s:
                continue  # stored by an earlier run
            seq, reused = gen.open_sequence(stage)
            gen.prefill(seq, stage[reused:])
            gen.release(seq)
    finally:
        gen.close()


def _snapshot(gen: ModelRunner) -> dict[str, object]:
    c = gen.cache.counters()
    return {"reads": c.page_reads, "moved": c.transfer_bytes, "prefetch": c.prefetch}


def _delta(before: dict[str, object], after: dict[str, object], key: str) -> dict[object, float]:
    b, a = before[key], after[key]
    assert isinstance(a, dict) and isinstance(b, dict)
    return {k: a[k] - b.get(k, 0) for k in a}


def _run_mode(loaded: LoadedModel, mode: str, prompts: list[list[int]], cfg: EngineConfig, steps: int,
              warmup: int, block_bytes: int) -> ModeResult:
    gen = ModelRunner(loaded, cfg)
    try:
        seqs, last, prefilled = [], [], 0
        for p in prompts:
            seq, reused = gen.open_sequence(p)
            prefilled += len(p) - reused
            logits = gen.prefill(seq, p[reused:])
            seqs.append(seq)
            last.append(int(logits.argmax()))
        for _ in range(warmup):
            last = gen.decode(list(zip(seqs, last, strict=True))).argmax(dim=-1).tolist()
        gen.cache.drain_transfers()
        before = _snapshot(gen)
        gen.timings = {}
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            last = gen.decode(list(zip(seqs, last, strict=True))).argmax(dim=-1).tolist()
            times.append(time.perf_counter() - t0)
        after = _snapshot(gen)
        b = len(prompts)
        tokens = steps * b
        step = statistics.median(times)
        phases = {k: 1000 * gen.timings.get(k, 0.0) / steps for k in PHASES}
        phases["model"] = max(0.0, 1000 * sum(times) / steps - sum(phases.values()))
        return ModeResult(
            mode, len(prompts[0]), b, b / step, 1000 * step, 1000 * sorted(times)[int(0.9 * (len(times) - 1))],
            phases,
            {str(t): n * block_bytes / tokens for t, n in _delta(before, after, "reads").items()},
            {f"{s}->{d}": n / tokens for (s, d), n in _delta(before, after, "moved").items()},  # type: ignore[misc]
            {str(k): int(v) for k, v in _delta(before, after, "prefetch").items()},
            {u.tier: u.budget_bytes for u in gen.cache.usage()}, prefilled_tokens=prefilled)
    finally:
        gen.close()


def _floor(loaded: LoadedModel, ctx: int, batch: int, token_budget: int, dtype: torch.dtype, steps: int,
           warmup: int) -> tuple[float, str]:
    """The floor's median step (seconds) and the attention kernel that achieved it."""
    runs = floor_step_times(loaded, batch, token_budget, dtype, steps, warmup)
    kernel = min(runs, key=lambda k: statistics.median(runs[k]))
    return statistics.median(runs[kernel]), kernel


def _llama_cpp_rows(loaded: LoadedModel, prompts: list[list[int]], contexts: tuple[int, ...],
                    batches: tuple[int, ...], steps: int, warmup: int, threads: int,
                    fresh: list[int]) -> tuple[list[ModeResult], list[PrefillResult]]:
    """The decode rows of every case, then the time to first token of ``fresh`` cut to each prefill context."""
    out = []
    bar = tqdm(total=len(contexts) * len(batches), desc="llama.cpp decode", leave=False)
    with llama_cpp.decoder(str(loaded.path), prompts, warmup + steps + 8, threads, bar.set_postfix_str) as d:
        for ctx in sorted(contexts, reverse=True):
            for b in batches:
                times = d.steps(ctx, b, steps, warmup).step_seconds
                step = statistics.median(times)
                out.append(ModeResult("llama.cpp", ctx, b, b / step, 1000 * step,
                                      1000 * sorted(times)[int(0.9 * (len(times) - 1))],
                                      note="Q4_1 weights, f16 KV in RAM, no flash attention"))
                bar.update()
        bar.close()
        ttft = []
        for ctx in tqdm(_prefill_contexts(fresh, contexts), desc="llama.cpp time to first token", leave=False):
            ttft.append(PrefillResult("llama.cpp", ctx, d.prefill_seconds(fresh[:ctx]),
                                      note=f"prompt processing in batches of {llama_cpp.BATCH}"))
    return out, ttft


def _prefill_contexts(fresh: list[int], contexts: tuple[int, ...]) -> list[int]:
    return sorted(c for c in contexts if c <= len(fresh))


def _kvdrive_ttft(loaded: LoadedModel, fresh: list[int], contexts: tuple[int, ...], layout: KVLayout,
                  seq_reserve: int, ssd_dir: str, token_budget: int) -> list[PrefillResult]:
    """kvdrive's time to first token of ``fresh`` cut to each context, under the kvdrive row's budgets (the
    pages it seals go down the tiers as they would in a server), on an SSD tier of its own (emptied)."""
    out = []
    per_token = layout.page_bytes // layout.page_size
    root = Path(ssd_dir) / "ttft"
    for ctx in tqdm(_prefill_contexts(fresh, contexts), desc="kvdrive time to first token", leave=False):
        shutil.rmtree(root, ignore_errors=True)
        budget = int(ctx * per_token * 1.5) + (64 << 20)
        gen = ModelRunner(loaded, _config("kvdrive", ctx * per_token, 1, layout, seq_reserve, str(root), budget,
                                        token_budget))
        try:
            t0 = time.perf_counter()
            seq, reused = gen.open_sequence(fresh[:ctx])
            int(gen.prefill(seq, fresh[:ctx][reused:]).argmax())
            seconds = time.perf_counter() - t0
            if reused:
                raise RuntimeError(f"time to first token: {reused} tokens of a fresh prompt were reused")
        finally:
            gen.close()
            shutil.rmtree(root, ignore_errors=True)
        out.append(PrefillResult("kvdrive", ctx, seconds, note=f"chunks of {gen.config.prefill_chunk} tokens"))
        gc.collect()
    return out


def run_decode_bench(ssd_dir: str, model: str = "demo", contexts: tuple[int, ...] = (2048, 4096, 7168),
                     batches: tuple[int, ...] = (1, 4, 8), modes: tuple[str, ...] = MODES, steps: int = 16,
                     warmup: int = 8, token_budget: int = 1024, ssd_budget: int | None = None,
                     with_llama_cpp: bool = True, loaded: LoadedModel | None = None,
                     weights: str = "auto", prefill_contexts: tuple[int, ...] = (),
                     device: str = "cpu", kv_dtype: torch.dtype | None = None,
                     on_case: Callable[[DecodeBenchResult], None] | None = None) -> DecodeBenchResult:
    """``device``: a resolved torch device string (``cpu``, ``cuda``, ``cuda:N``): where the model computes
    and the device tier lives (``loaded``, when given, decides instead). ``on_case`` is called with the
    result so far after each measured case (so that a run cut short keeps what it measured). ``kv_dtype``: the
    KV cache's dtype in every kvdrive row and the floor (None: the model's)."""
    started = time.perf_counter()
    for mode in modes:
        split_mode(mode)  # an unknown mode is refused before anything loads
    loaded = loaded or load_model(model, device=device, weights=weights)
    probe = ModelRunner(loaded, EngineConfig(max_sequences=1, kv_dtype=kv_dtype))
    layout, seq_reserve = probe.cache.layout, probe.cache.seq_reserve
    probe.close()
    del probe
    per_token = layout.page_bytes // layout.page_size
    bmax = max(batches)
    # the shorter contexts are prefixes of the longest prompts: one prefill serves every case
    longest = [filler_tokens(loaded.tokenizer, max(contexts), seed=1000 + i) for i in range(bmax)]
    need = max(contexts) * bmax * per_token
    ssd_budget = max(ssd_budget or 0, int(need * 1.5) + (256 << 20))  # never below what the prompts need
    threads = torch.get_num_threads()
    status = "measured"
    if not with_llama_cpp:
        status = "not requested"
    elif not llama_cpp.available():
        status = "not installed (pip install '.[bench]' builds it, ~15 min on 2 cores)"
    out = DecodeBenchResult(model=loaded.model_id, threads=threads, token_budget=token_budget, steps=steps,
                            warmup=warmup, kv_bytes_per_token=per_token, llama_cpp=status, host=platform.node(),
                            device=_device_name(loaded.device), kv_dtype=str(layout.dtype).removeprefix("torch."))
    out.weights = f"{loaded.weights.requested}: {loaded.weights.summary()}"
    out.weight_bytes_per_step = sum(weight_bytes(loaded.model).values())
    out.bandwidth_gb_s = copy_bandwidth(loaded.device) / 1e9
    out.weight_bound_ms = out.weight_bytes_per_step / (out.bandwidth_gb_s * 1e9) * 1e3
    # time to first token: a prompt of its own (nothing of it stored), cut to each prefill context
    fresh = filler_tokens(loaded.tokenizer, max(prefill_contexts), seed=3000) if prefill_contexts else []
    if status == "measured":
        rows, ttft = _llama_cpp_rows(loaded, longest, contexts, batches, steps, warmup, threads, fresh)
        out.results.extend(rows)
        out.prefill.extend(ttft)
        gc.collect()
        if on_case:
            on_case(out)
    if fresh:
        out.prefill.extend(_kvdrive_ttft(loaded, fresh, prefill_contexts, layout, seq_reserve, ssd_dir, token_budget))
    _prefill_all(loaded, longest, contexts, ssd_dir, ssd_budget, layout.dtype)
    cases = [(ctx, b) for ctx in contexts for b in batches]
    bar = tqdm(total=len(cases) * (len(modes) + 2), desc="decode modes")
    for ctx, b in cases:
        bar.set_postfix_str(f"ctx {ctx} batch {b}: floor")
        first = _floor(loaded, ctx, b, token_budget, layout.dtype, steps, warmup)
        bar.update()
        for mode in modes:
            bar.set_postfix_str(f"ctx {ctx} batch {b}: {mode}")
            cfg = _config(mode, ctx * b * per_token, b, layout, seq_reserve, ssd_dir, ssd_budget,
                          token_budget)
            out.results.append(_run_mode(loaded, mode, [p[:ctx] for p in longest[:b]], cfg, steps, warmup,
                                         layout.block_bytes))
            gc.collect()
            bar.update()
        second = _floor(loaded, ctx, b, token_budget, layout.dtype, steps, warmup)
        step, kernel = min(first, second)
        out.results.append(ModeResult("floor", ctx, b, b / step, 1000 * step, 1000 * step,
                                      note=f"contiguous KV of {token_budget} tokens, {kernel} attention"))
        bar.update()
        out.seconds = time.perf_counter() - started
        if on_case:
            on_case(out)
    bar.close()
    out.seconds = time.perf_counter() - started
    return out


def as_dict(result: DecodeBenchResult) -> dict[str, object]:
    return asdict(result)
