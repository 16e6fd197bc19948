"""Accuracy and cost of each weight format against fp32, on the same prompts (``kvdrive bench weights``).

Owns the weights benchmark. Each format in turn is loaded (``--weights``) and run with full attention and
an in-memory KV cache, so the format (and ``--kv-dtype``, when not float32) is the only difference from the
reference: fp32 weights and a float32 cache, the path that ``tests/model/test_model_hf_parity.py`` holds
equal to transformers in float32. A format listed is run again, never copied from the reference (fp32 with
a float32 cache is the self-check). Per format:

- chats: the greedy continuation of each chat prompt (a plain "Question: ... Answer:" prompt for a base
  model without a chat template), identical to fp32's or not (EOS included);
- documents: the same questions after a document of ``doc_tokens``; KL(fp32 || format) of the next-token
  distribution at every position of fp32's greedy answer, both teacher-forced along that answer (the
  prompt's last logits, then one prefill of the answer's tokens with every position's logits);
- pass key: retrieval at each context and depth (the key's digits in the greedy continuation);
- the bytes the weights hold and the seconds each phase took.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from kvdrive.runtime.bench.accuracy_bench import CHAT_PROMPTS, kl_divergence
from kvdrive.runtime.bench.texts import filler_tokens, passkey_prompt
from kvdrive.runtime.engine import EngineConfig, LLMEngine, ModelRunner, SamplingParams
from kvdrive.runtime.model import LoadedModel, load_model
from kvdrive.runtime.model.weight_formats import weight_bytes
from kvdrive.runtime.prompt import ChatMessage

FORMATS = ("fp32", "bf16", "int8", "int4", "auto")


@dataclass(frozen=True)
class Prompts:
    chats: tuple[tuple[int, ...], ...]
    documents: tuple[tuple[int, ...], ...]
    passkeys: tuple[tuple[int, float, int, tuple[int, ...]], ...]  # (context, depth, key, prompt)


@dataclass(frozen=True)
class Answers:
    """What one format produced: greedy chat tokens, document answers with their per-position logits."""
    chats: tuple[tuple[int, ...], ...]
    documents: tuple[tuple[int, ...], ...]
    passkey_texts: tuple[str, ...]


@dataclass(frozen=True)
class FormatResult:
    weights: str  # requested: what it gave (WeightPlan.summary)
    weight_bytes: int
    chats_identical: int
    chats: int
    document_kl_mean: float  # nats, over every answer position of every document
    document_kl_max: float
    documents_identical: int
    documents: int
    passkeys_found: int
    passkeys: int
    passkey_found_by_context: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class WeightsBenchResult:
    model: str
    threads: int
    chat_tokens: int
    doc_tokens: int
    contexts: tuple[int, ...]
    depths: tuple[float, ...]
    reference: str = "fp32"
    kv_dtype: str = "float32"  # the KV cache of every format's run (the reference's is float32)
    formats: list[FormatResult] = field(default_factory=list)


def build_prompts(loaded: LoadedModel, chats: int, doc_tokens: int, documents: int, contexts: Sequence[int],
                  depths: Sequence[float], seed: int = 7) -> Prompts:
    tok = loaded.tokenizer

    def ask(text: str) -> tuple[int, ...]:  # a base model (no chat template) gets a plain completion prompt
        if tok.chat_template:
            return tuple(tok.encode_chat([ChatMessage("user", text)]))
        return tuple(tok.encode(f"Question: {text}\nAnswer:"))

    chat_ids = tuple(ask(q) for q in CHAT_PROMPTS[:chats])
    doc = tok.decode(filler_tokens(tok, doc_tokens, seed=seed))
    docs = tuple(ask(f"Here is a document.\n\n{doc}\n\nNow answer this question: {q}") for q in CHAT_PROMPTS[:documents])
    rng = random.Random(seed)
    keys = []
    for ctx in contexts:
        for depth in depths:
            key = rng.randint(10000, 99999)
            keys.append((ctx, depth, key, tuple(passkey_prompt(tok, ctx, depth, key, seed=seed + ctx))))
    return Prompts(chat_ids, docs, tuple(keys))


def _greedy(gen: ModelRunner, prompt: Sequence[int], n: int) -> tuple[int, ...]:
    return tuple(LLMEngine(gen).generate_tokens(list(prompt), SamplingParams(max_tokens=n, temperature=0.0)))


def _forced_logits(gen: ModelRunner, prompt: Sequence[int], answer: Sequence[int]) -> torch.Tensor:
    """Logits [len(answer), V] of each answer position given the prompt and the answer before it."""
    seq = gen.new_sequence()
    try:
        first = gen.prefill(seq, list(prompt)).float()[None]  # [1, V]
        if len(answer) < 2:
            return first
        rest = gen.prefill(seq, list(answer[:-1]), all_logits=True).float()  # [n - 1, V]
        return torch.cat([first, rest])
    finally:
        gen.release(seq)


def _answers(gen: ModelRunner, loaded: LoadedModel, prompts: Prompts, chat_tokens: int, bar: tqdm) -> Answers:
    chats, docs, keys = [], [], []
    for p in prompts.chats:
        chats.append(_greedy(gen, p, chat_tokens))
        bar.update()
    for p in prompts.documents:
        docs.append(_greedy(gen, p, chat_tokens))
        bar.update()
    for _, _, _, p in prompts.passkeys:
        keys.append(loaded.tokenizer.decode(list(_greedy(gen, p, 8))))
        bar.update()
    return Answers(tuple(chats), tuple(docs), tuple(keys))


def run_weights_bench(model: str = "demo", formats: Sequence[str] = FORMATS, chats: int = 20,
                      chat_tokens: int = 48, doc_tokens: int = 2048, documents: int = 4,
                      contexts: Sequence[int] = (2048, 7168), depths: Sequence[float] = (0.1, 0.5, 0.9),
                      kv_dtype: torch.dtype = torch.float32) -> WeightsBenchResult:
    """Each of ``formats`` with its KV cache in ``kv_dtype``, against the reference: fp32 weights with a
    float32 KV cache (so a 16-bit cache's cost shows in every row but the reference's)."""
    ref_loaded = load_model(model, weights="fp32", progress=False)
    prompts = build_prompts(ref_loaded, chats, doc_tokens, documents, contexts, depths)
    context = max([len(p) for p in prompts.documents] + [len(p[3]) for p in prompts.passkeys]) + chat_tokens + 16
    ref_config = EngineConfig(full_attention=True, max_sequences=1, kv_dtype=torch.float32)
    config = EngineConfig(full_attention=True, max_sequences=1, kv_dtype=kv_dtype)
    result = WeightsBenchResult(ref_loaded.model_id, torch.get_num_threads(), chat_tokens, doc_tokens,
                                tuple(contexts), tuple(depths), kv_dtype=str(kv_dtype).removeprefix("torch."))
    total = len(prompts.chats) + len(prompts.documents) + len(prompts.passkeys)
    reference: Answers | None = None
    ref_logits: list[torch.Tensor] = []
    runs = [("reference", ref_config), *[(f, config) for f in formats]]
    for fmt, cfg in runs:
        started = time.perf_counter()
        loaded = ref_loaded if fmt in ("fp32", "reference") else load_model(model, weights=fmt, progress=False)
        gen = ModelRunner(loaded, cfg)
        assert gen.request_limit() >= context, "the default budget holds one full-context sequence"
        try:
            with tqdm(total=total + len(prompts.documents), desc=f"weights {fmt}", leave=False) as bar:
                got = _answers(gen, loaded, prompts, chat_tokens, bar)
                if reference is None:
                    reference = got
                kls: list[float] = []
                for i, (p, answer) in enumerate(zip(prompts.documents, reference.documents, strict=True)):
                    logits = _forced_logits(gen, p, answer)
                    if fmt == "reference":
                        ref_logits.append(logits)
                    kls += kl_divergence(ref_logits[i], logits)
                    bar.update()
        finally:
            gen.close()
        found = [str(k) in text for (_, _, k, _), text in zip(prompts.passkeys, got.passkey_texts, strict=True)]
        by_ctx = {c: statistics.fmean(f for (ctx, _, _, _), f in zip(prompts.passkeys, found, strict=True)
                                      if ctx == c) for c in contexts}
        if fmt != "reference":
            result.formats.append(FormatResult(
                weights=f"{fmt}: {loaded.weights.summary()}", weight_bytes=sum(weight_bytes(loaded.model).values()),
                chats_identical=sum(a == b for a, b in zip(got.chats, reference.chats, strict=True)),
                chats=len(got.chats), document_kl_mean=statistics.fmean(kls) if kls else 0.0,
                document_kl_max=max(kls, default=0.0),
                documents_identical=sum(a == b for a, b in zip(got.documents, reference.documents, strict=True)),
                documents=len(got.documents),
                passkeys_found=sum(found), passkeys=len(found), passkey_found_by_context=by_ctx,
                seconds=round(time.perf_counter() - started, 1)))
        if loaded is not ref_loaded:
            del loaded
    return result


def table(result: WeightsBenchResult) -> str:
    """Markdown: one row per format."""
    ctx = " / ".join(str(c) for c in result.contexts)
    rows = [f"# Weight formats against {result.reference}\n",
            f"{result.model}, {result.threads} threads, full attention; KV cache {result.kv_dtype} (the reference: "
            f"fp32 weights, float32 KV cache; with a float32 cache the format is the only difference); "
            f"greedy chats of {result.chat_tokens} tokens; documents of {result.doc_tokens} tokens, KL along "
            f"{result.reference}'s greedy answer; pass keys at {ctx} tokens, depths "
            f"{', '.join(str(d) for d in result.depths)}\n",
            f"| weights | MB | chats identical | documents identical | document KL mean / max (nats) | "
            f"pass keys found ({ctx}) | s |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for f in result.formats:
        keys = " / ".join(f"{v:.0%}" for v in f.passkey_found_by_context.values())
        rows.append(f"| {f.weights} | {f.weight_bytes / 1e6:.0f} | {f.chats_identical}/{f.chats} | "
                    f"{f.documents_identical}/{f.documents} | "
                    f"{f.document_kl_mean:.2e} / {f.document_kl_max:.2e} | {keys} | {f.seconds:.0f} |")
    return "\n".join(rows) + "\n"


def plot(result: WeightsBenchResult, path: str) -> bool:
    """Bytes against mean document KL, one point per format, as a PNG; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for f in result.formats:
        kl = max(f.document_kl_mean, 1e-9)  # fp32 against itself is 0: drawn at the axis floor
        ax.scatter(f.weight_bytes / 1e6, kl, s=50)
        ax.annotate(f"{f.weights.split(':')[0]} ({f.chats_identical}/{f.chats} chats)", (f.weight_bytes / 1e6, kl),
                    textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("weights (MB)")
    ax.set_ylabel(f"mean KL({result.reference} || format), nats")
    ax.set_title(f"{result.model}: weight formats against {result.reference}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
