"""Model benchmark: load time, prefill throughput at several prompt lengths, decode throughput."""

from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from kvdrive.runtime.engine import EngineConfig, Generator
from kvdrive.runtime.model import load_model

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
    prefill_tokens_per_s: dict[int, float]  # prompt length -> tokens/s
    decode_tokens_per_s: dict[int, float]  # context length -> tokens/s at batch 1
    decode_ms_per_token: dict[int, float]
    host: str


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
) -> ModelBenchResult:
    loaded = load_model(model, device=device, dtype=dtype, weights=weights)
    gen = Generator(loaded, EngineConfig())
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
        prefill_tokens_per_s={k: round(v, 1) for k, v in prefill.items()},
        decode_tokens_per_s={k: round(v, 2) for k, v in decode.items()},
        decode_ms_per_token={k: round(1000 / v, 2) for k, v in decode.items()},
        host=f"{platform.machine()} {platform.processor() or ''}".strip(),
    )


def as_dict(result: ModelBenchResult) -> dict:  # type: ignore[type-arg]
    return asdict(result)


def table(result: ModelBenchResult) -> str:
    rows = [f"model {result.model} on {result.device} ({result.dtype}, {result.threads} threads)",
            f"load: {result.load_seconds:.2f} s"]
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
