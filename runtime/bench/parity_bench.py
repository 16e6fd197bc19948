"""Greedy chat parity against transformers' fp32 reference on the same GGUF (``kvdrive bench parity``).

transformers (with ``gguf``) dequantizes the file into its own implementation in float32, renders the chat
through its own copy of the model's template and decodes greedily; each of our legs (a weight format, full
attention or sparse selection) decodes the same prompts greedily through ``ModelRunner``. A prompt counts as
identical when the token sequences are equal up to ``max_tokens`` (EOS included). The chat prompts are the
accuracy benchmark's, rendered with the model's default system prompt.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from kvdrive.runtime.bench.accuracy_bench import CHAT_PROMPTS
from kvdrive.runtime.engine import EngineConfig, LLMEngine, ModelRunner, SamplingParams, TierConfig
from kvdrive.runtime.model import LoadedModel, load_model
from kvdrive.runtime.model.loader import resolve_model_path

# (attention)-(weights)[-(gemm)]: the prompt GEMMs fp32 unless named; sparse at the default budget
LEGS = ("full-fp32", "full-auto", "full-auto-bf16", "sparse-auto", "sparse-auto-bf16")


@dataclass(frozen=True)
class LegResult:
    leg: str  # (full | sparse)-(weights)[-(gemm)]
    identical: int  # prompts whose greedy tokens equal the reference's
    first_divergence: tuple[int | None, ...]  # per prompt: first differing position (None: identical)
    texts: tuple[str, ...]
    seconds: float


@dataclass
class ParityResult:
    model: str
    prompts: tuple[str, ...]
    max_tokens: int
    threads: int
    reference: tuple[str, ...] = ()  # transformers' greedy answers
    reference_seconds: float = 0.0
    transformers_version: str = ""
    legs: list[LegResult] = field(default_factory=list)


def reference_answers(model: str, prompts: Sequence[str], max_tokens: int) -> tuple[list[list[int]], list[str], str]:
    """transformers' fp32 greedy tokens for each chat prompt, their texts, and transformers' version."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(model)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    out = []
    for q in tqdm(prompts, desc="transformers fp32", unit="prompt"):
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]  # [1, T]
        with torch.no_grad():
            gen = ref.generate(ids, max_new_tokens=max_tokens, do_sample=False, temperature=None, top_p=None,
                               top_k=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        answer = gen[0, ids.shape[1]:].tolist()
        out.append(answer)
    del ref
    gc.collect()
    return out, [tok.decode(a, skip_special_tokens=True) for a in out], transformers.__version__


def our_answers(loaded: LoadedModel, prompts: Sequence[str], max_tokens: int, full_attention: bool,
                desc: str) -> tuple[list[list[int]], list[str]]:
    """Our greedy tokens for each chat prompt (EOS appended where the model ended, as transformers keeps it)
    and their texts."""
    from kvdrive.runtime.prompt import ChatMessage

    gen = ModelRunner(loaded, EngineConfig(tiers=TierConfig(), full_attention=full_attention, max_sequences=1))
    eos = loaded.tokenizer.eos_token_ids[0]
    out = []
    try:
        for q in tqdm(prompts, desc=desc, unit="prompt"):
            ids = loaded.tokenizer.encode_chat([ChatMessage("user", q)])
            answer = list(LLMEngine(gen).generate_tokens(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0)))
            out.append(answer + [eos] if len(answer) < max_tokens else answer)
    finally:
        gen.close()
    return out, [loaded.tokenizer.decode(a) for a in out]


def _first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_parity_bench(model: str, chats: int = 20, max_tokens: int = 64, legs: Sequence[str] = LEGS,
                     threads: int = 0) -> ParityResult:
    prompts = tuple(CHAT_PROMPTS[:chats])
    res = ParityResult(model, prompts, max_tokens, threads or torch.get_num_threads())
    t0 = time.perf_counter()
    reference, texts, res.transformers_version = reference_answers(model, prompts, max_tokens)
    res.reference_seconds = time.perf_counter() - t0
    res.reference = tuple(texts)
    loaded: LoadedModel | None = None
    for leg in legs:  # the legs of one weight format share its loaded model (loaded when the format changes)
        attention, weights, *rest = leg.split("-")
        gemm = rest[0] if rest else "fp32"
        t0 = time.perf_counter()
        if loaded is None or (loaded.weights.requested, loaded.weights.gemm) != (weights, gemm):
            loaded = None
            gc.collect()
            loaded = load_model(model, progress=False, weights=weights, gemm=gemm)
        ours, answers = our_answers(loaded, prompts, max_tokens, attention == "full", leg)
        div = tuple(_first_divergence(r, o) for r, o in zip(reference, ours, strict=True))
        res.legs.append(LegResult(leg, sum(d is None for d in div), div, tuple(answers),
                                  time.perf_counter() - t0))
    return res


def table(res: ParityResult) -> str:
    lines = [f"# Greedy chat parity: {res.model} against transformers {res.transformers_version} (fp32, same GGUF)",
             "", f"{len(res.prompts)} chat prompts, {res.max_tokens} new tokens at most, {res.threads} threads; "
             f"reference {res.reference_seconds:.0f} s", "",
             "| leg | identical | first divergence of the others | seconds |", "| --- | --- | --- | --- |"]
    for leg in res.legs:
        others = ", ".join(f"#{i}@{d}" for i, d in enumerate(leg.first_divergence) if d is not None) or "-"
        lines.append(f"| {leg.leg} | {leg.identical}/{len(res.prompts)} | {others} | {leg.seconds:.0f} |")
    return "\n".join(lines) + "\n"


def plot(res: ParityResult, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    names = [leg.leg for leg in res.legs]
    ax.barh(names, [leg.identical for leg in res.legs], color="tab:blue")
    ax.axvline(len(res.prompts), color="gray", linestyle="--", label="all prompts")
    ax.set_xlabel("greedy answers identical to transformers fp32")
    ax.set_title(res.model)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
