"""Model benchmark: load time, resident memory of the weights, prefill throughput at several prompt
lengths, decode throughput. One format (``--weights``) a run: the resident bytes are the process's, so
formats are compared in separate processes."""

from __future__ import annotations

import gc
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kvdrive.runtime.engine import EngineConfig, ModelRunner
from kvdrive.runtime.engine.heap import HeapTrimmer
from kvdrive.runtime.model import load_model
from kvdrive.runtime.model.weight_formats import weight_bytes

# A real English passage, repeated to the wanted length, keeps the token mix realistic.
_TEXT = (
    "The history of the city begins with a small settlement on the river bank, where traders met "
    "to exchange grain, salt and cloth. Over the centuries the town grew, built walls and bridges, "
    "and became the seat of a bishop and later of a royal court. "
)


@dataclass(frozen=True)
class ModelBenchResult:
    model: str
    device: str
    dtype: str
    threads: int
    load_seconds: float
    weights: str  # the requested format and what it gave, e.g. "auto: int4 x 120, int8 x 1"
    weight_bytes: int  # held by the model's parameters and buffers
    rss_before_load_bytes: int | None  # the process's resident bytes (Linux), torch imported
    rss_after_load_bytes: int | None  # after the load, its garbage collected and the heap trimmed
    prefill_tokens_per_s: dict[int, float]  # prompt length -> tokens/s
    decode_tokens_per_s: dict[int, float]  # context length -> tokens/s at batch 1
    decode_ms_per_token: dict[int, float]
    host: str


def rss_bytes() -> int | None:
    """The process's resident set (Linux /proc), None elsewhere."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def _prompt(tokenizer, n: int) -> list[int]:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode(_TEXT)
    return (ids * (n // len(ids) + 1))[:n]


def run_model_bench(
    model: str = "demo",
    prefill_lengths: tuple[int, ...] = (512, 2048),
    decode_contexts: tuple[int, ...] = (128, 2048),
    decode_tokens: int = 64,
    repeats: int = 2,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    weights: str = "auto",
    gemm: str = "fp32",
) -> ModelBenchResult:
    gc.collect()
    rss_before = rss_bytes()
    loaded = load_model(model, device=device, dtype=dtype, weights=weights, gemm=gemm)
    gc.collect()
    HeapTrimmer(min_interval_s=0).trim()  # what the load freed goes back to the system
    rss_after = rss_bytes()
    gen = ModelRunner(loaded, EngineConfig())
    prefill: dict[int, float] = {}
    for n in tqdm(prefill_lengths, desc="prefill", leave=False):
        ids = _prompt(loaded.tokenizer, n)
        best = float("inf")
        for _ in range(repeats):
            seq = gen.new_sequence()
            t = time.perf_counter()
            gen.prefill(seq, ids)
            best = min(best, time.perf_counter() - t)
            gen.release(seq)
        prefill[n] = n / best
    decode: dict[int, float] = {}
    for ctx in tqdm(decode_contexts, desc="decode", leave=False):
        seq = gen.new_sequence()
        logits = gen.prefill(seq, _prompt(loaded.tokenizer, ctx))
        token = int(torch.argmax(logits))
        gen.decode([(seq, token)])  # warm-up
        t = time.perf_counter()
        for _ in range(decode_tokens):
            token = int(torch.argmax(gen.decode([(seq, token)])[0]))
        decode[ctx] = decode_tokens / (time.perf_counter() - t)
        gen.release(seq)
    return ModelBenchResult(
        model=loaded.model_id,
        device=device,
        dtype=str(loaded.dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        load_seconds=round(loaded.load_seconds, 2),
        weights=f"{loaded.weights.requested}: {loaded.weights.summary()}",
        weight_bytes=sum(weight_bytes(loaded.model).values()),
        rss_before_load_bytes=rss_before,
        rss_after_load_bytes=rss_after,
        prefill_tokens_per_s={k: round(v, 1) for k, v in prefill.items()},
        decode_tokens_per_s={k: round(v, 2) for k, v in decode.items()},
        decode_ms_per_token={k: round(1000 / v, 2) for k, v in decode.items()},
        host=f"{platform.machine()} {platform.processor() or ''}".strip(),
    )


def as_dict(result: ModelBenchResult) -> dict:  # type: ignore[type-arg]
    return asdict(result)


def table(result: ModelBenchResult) -> str:
    rows = [f"model {result.model} on {result.device} ({result.dtype}, {result.threads} threads)",
            f"load: {result.load_seconds:.2f} s; weights {result.weights}: {result.weight_bytes / 1e6:.0f} MB"]
    if result.rss_before_load_bytes is not None and result.rss_after_load_bytes is not None:
        rows.append(f"resident: {result.rss_before_load_bytes / 1e6:.0f} MB before the load, "
                    f"{result.rss_after_load_bytes / 1e6:.0f} MB after "
                    f"(+{(result.rss_after_load_bytes - result.rss_before_load_bytes) / 1e6:.0f} MB)")
    rows += [f"prefill {n:>6} tokens: {v:10.1f} tok/s" for n, v in result.prefill_tokens_per_s.items()]
    rows += [
        f"decode  ctx {n:>6}, batch 1: {v:8.2f} tok/s ({result.decode_ms_per_token[n]:.1f} ms/token)"
        for n, v in result.decode_tokens_per_s.items()
    ]
    return "\n".join(rows)


def plot(result: ModelBenchResult, path: str) -> bool:
    """Bar charts of prefill and decode throughput as a PNG; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.bar([str(k) for k in result.prefill_tokens_per_s], list(result.prefill_tokens_per_s.values()), color="#4c72b0")
    a.set_title("prefill throughput")
    a.set_xlabel("prompt tokens")
    a.set_ylabel("tokens/s")
    b.bar([str(k) for k in result.decode_tokens_per_s], list(result.decode_tokens_per_s.values()), color="#dd8452")
    b.set_title("decode throughput (batch 1)")
    b.set_xlabel("context tokens")
    b.set_ylabel("tokens/s")
    fig.suptitle(f"{result.model} · {result.device} · {result.dtype} · {result.threads} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
