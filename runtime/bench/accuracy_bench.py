"""Accuracy of sparse decoding against full attention on the same prompts (issue #4).

Owns the accuracy benchmark: passkey retrieval at several contexts and depths, greedy chat outputs
(short prompts, and the same questions after a long document so that page selection is active) and
KL(full || sparse) of the next-token distributions along the full-attention continuation.

Three phases, one ``Generator`` open at a time on one SSD directory:
1. prefill: every prompt's pages are computed once (exact attention) and written to the SSD tier;
   prompts sharing a prefix (a context's haystack, the chat document) share its pages.
2. reference: a full-attention Generator reuses the stored prompt pages, recomputes the open tail
   page, greedy-decodes and keeps its logits.
3. candidate: a sparse Generator (the token budget) reuses the same pages and decodes free-running
   greedy; where its output diverges from the reference it is teacher-forced along the reference
   tokens from there, so every KL term compares distributions given the same prefix. Several budgets
   run phase 3 once each against one prefill and one reference.
Phase 1 writes through to the SSD tier, so a run that dies in it resumes there when started again on
the same directory: the stored pages (and window snapshots) are reused.
Reference and candidate never write their decoded pages to the SSD tier: pages are content-addressed
by tokens, not by attention mode, so a candidate decoding the reference's tokens would otherwise read
the reference's KV for them. The first answer token comes from the prefill of the tail page, exact in
both modes (as in ``Generator.generate``) unless prefix reuse leaves a single token to compute.
"""

from __future__ import annotations

import hashlib
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace

import torch
from tqdm import tqdm

from kvdrive.runtime.bench.texts import filler_tokens, passkey_prompt
from kvdrive.runtime.engine import EngineConfig, Generator, TierConfig
from kvdrive.runtime.kvcache import KVLayout
from kvdrive.runtime.model import LoadedModel, load_model
from kvdrive.runtime.prompt import ChatMessage

CHAT_PROMPTS = (
    "What is the capital of France?", "Give me three tips for staying focused while studying.",
    "Explain what photosynthesis is in simple terms.", "Write a short poem about the sea.",
    "How do I make a cup of tea?", "What are the benefits of regular exercise?",
    "Summarize the plot of Romeo and Juliet in two sentences.", "What is the difference between weather and climate?",
    "Suggest a name for a small bakery.", "How many days are there in a leap year, and why?",
    "Explain what a computer virus is.", "What should I pack for a weekend camping trip?",
    "Translate 'good morning' into Spanish and French.", "Why is the sky blue?",
    "Give me a simple recipe for pancakes.", "What is a prime number? Give two examples.",
    "How can I improve my sleep?", "Describe a cat to someone who has never seen one.",
    "What are the three states of matter?", "Write a polite email declining a meeting invitation.",
    "What does a librarian do?", "Name three famous painters and one work by each.",
    "How does a bicycle stay upright when moving?", "What is the boiling point of water at sea level?",
)
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
SETS = ("chat", "document")


@dataclass(frozen=True)
class CaseResult:
    kind: str  # passkey | chat | document
    context: int  # passkey: the target context; chat/document: 0
    depth: float  # passkey: needle depth (0 = start); otherwise 0
    label: str  # passkey: the key; chat/document: the question
    prompt_tokens: int
    reference_text: str
    candidate_text: str
    reference_tokens: int
    identical: bool  # greedy token sequences equal (EOS included)
    first_divergence: int | None  # first generated position where they differ
    reference_correct: bool | None  # passkey: the key's digits appear in the continuation
    candidate_correct: bool | None
    kl: tuple[float, ...]  # KL(reference || candidate) per generated position, nats
    replay_diff: float | None  # teacher-forced replay vs free-running logits at the divergence (must be 0)

    @property
    def kl_mean(self) -> float:
        return statistics.fmean(self.kl) if self.kl else 0.0


@dataclass(frozen=True)
class AccuracyBenchResult:
    model: str
    token_budget: int
    page_size: int
    candidate: str  # sparse | full (self-check: must equal the reference)
    threads: int
    prefill_tokens_computed: int  # phase 1 (shared prefixes computed once)
    seconds: dict[str, float]  # per phase
    cases: tuple[CaseResult, ...]


@dataclass(frozen=True)
class _Case:
    kind: str
    prompt: tuple[int, ...]
    max_tokens: int
    context: int = 0
    depth: float = 0.0
    label: str = ""
    passkey: int | None = None


def _cases(loaded: LoadedModel, contexts: tuple[int, ...], depths: tuple[float, ...], keys_per_depth: int,
           chat_prompts: tuple[str, ...], doc_tokens: tuple[int, int], passkey_tokens: int, chat_tokens: int,
           seed: int) -> list[_Case]:
    tok = loaded.tokenizer
    rng = random.Random(seed)
    out: list[_Case] = []
    for ctx in contexts:  # one haystack per context (seeded by it): the cases share its prefix pages
        for depth in depths:
            for _ in range(keys_per_depth):
                key = rng.randint(10000, 99999)
                prompt = passkey_prompt(tok, ctx, depth, key, seed=seed + ctx)
                out.append(_Case("passkey", tuple(prompt), passkey_tokens, ctx, depth, str(key), key))
    for q in chat_prompts:
        out.append(_Case("chat", tuple(tok.encode_chat([ChatMessage("user", q)])), chat_tokens, label=q))
    doc = filler_tokens(tok, doc_tokens[1], seed=seed + 1)
    n = len(chat_prompts)
    for i, q in enumerate(chat_prompts):  # documents of growing length, all prefixes of one text
        length = doc_tokens[0] + (doc_tokens[1] - doc_tokens[0]) * i // max(1, n - 1)
        text = f"Here is a document.\n\n{tok.decode(doc[:length])}\n\nNow answer this question: {q}"
        out.append(_Case("document", tuple(tok.encode_chat([ChatMessage("user", text)])), chat_tokens, label=q))
    return out


def _distinct_pages(prompts: list[tuple[int, ...]], page: int) -> int:
    seen: set[bytes] = set()
    for p in prompts:
        h = b""
        for i in range(len(p) // page):
            h = hashlib.blake2b(h + repr(p[i * page : (i + 1) * page]).encode(), digest_size=16).digest()
            seen.add(h)
    return len(seen)


def _prefill_all(loaded: LoadedModel, cases: list[_Case], cfg: EngineConfig) -> int:
    """Phase 1: store every prompt's pages on the SSD tier. Returns the tokens computed."""
    gen = Generator(loaded, cfg)
    computed = 0
    try:
        # Lexicographic order walks the prompts' prefix tree depth first: each prompt follows the one it
        # shares the longest prefix with, so every shared prefix is computed once (the last window
        # checkpoint before the fork is still there; a hybrid model resumes from it).
        for c in tqdm(sorted(cases, key=lambda c: c.prompt), desc="prefill (shared prefixes once)"):
            seq, reused = gen.open_sequence(c.prompt)
            if reused < len(c.prompt) - cfg.page_size:
                gen.prefill(seq, c.prompt[reused:])
                computed += len(c.prompt) - reused
            gen.release(seq)
    finally:
        gen.close()
    return computed


def _greedy(gen: Generator, prompt: tuple[int, ...], max_tokens: int, eos: set[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens (a final EOS included) and the logits each was chosen from [n, V]."""
    seq, reused = gen.open_sequence(prompt)
    try:
        logits = gen.prefill(seq, prompt[reused:])
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(max_tokens):
            rows.append(logits.float().cpu())
            tokens.append(int(logits.argmax()))
            if tokens[-1] in eos or i + 1 == max_tokens:
                break
            logits = gen.decode([(seq, tokens[-1])])[0]
        return tokens, torch.stack(rows)
    finally:
        gen.release(seq)


def _forced(gen: Generator, prompt: tuple[int, ...], tokens: list[int], start: int) -> torch.Tensor:
    """Logits [len(tokens) - start, V] at positions start.. given the prompt and tokens[:position]."""
    seq, reused = gen.open_sequence(prompt)
    try:
        logits = gen.prefill(seq, prompt[reused:])
        rows: list[torch.Tensor] = []
        for i, tok in enumerate(tokens):
            if i >= start:
                rows.append(logits.float().cpu())
            if i + 1 < len(tokens):
                logits = gen.decode([(seq, tok)])[0]
        return torch.stack(rows)
    finally:
        gen.release(seq)


def kl_divergence(reference: torch.Tensor, candidate: torch.Tensor) -> list[float]:
    """KL(softmax(reference) || softmax(candidate)) per row of logits [n, V], in float64 (nats)."""
    lp = torch.log_softmax(reference.double(), dim=-1)
    lq = torch.log_softmax(candidate.double(), dim=-1)
    return (lp.exp() * (lp - lq)).sum(dim=-1).tolist()


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _reference(loaded: LoadedModel, cases: list[_Case], cfg: EngineConfig, scratch: str) -> list[list[int]]:
    """Phase 2: full-attention greedy tokens per case; their logits are saved under ``scratch``."""
    eos = set(loaded.tokenizer.eos_token_ids)
    gen = Generator(loaded, cfg)
    out: list[list[int]] = []
    try:
        for i, c in enumerate(tqdm(cases, desc="reference (full attention)")):
            tokens, logits = _greedy(gen, c.prompt, c.max_tokens, eos)
            out.append(tokens)
            torch.save(logits, f"{scratch}/{i}.pt")  # [n, V] float32, kept off the heap
    finally:
        gen.close()
    return out


def _candidate(loaded: LoadedModel, cases: list[_Case], cfg: EngineConfig, scratch: str,
               ref: list[list[int]]) -> list[CaseResult]:
    """Phase 3: free-running greedy output, then KL along the reference tokens (teacher-forced after a divergence)."""
    eos = set(loaded.tokenizer.eos_token_ids)
    gen = Generator(loaded, cfg)
    out: list[CaseResult] = []
    try:
        for i, c in enumerate(tqdm(cases, desc=f"candidate ({'full' if cfg.full_attention else 'sparse'})")):
            tokens, logits = _greedy(gen, c.prompt, c.max_tokens, eos)
            r = ref[i]
            d = _first_divergence(r, tokens)
            same = logits[: len(r) if d is None else d + 1]  # positions whose prefix equals the reference's
            replay = None
            if d is not None and d + 1 < len(r):  # replayed from d: its first row must equal the free run's
                forced = _forced(gen, c.prompt, r, d)
                replay = float((forced[0] - logits[d]).abs().max())
                same = torch.cat([same, forced[1:]])
            kl = kl_divergence(torch.load(f"{scratch}/{i}.pt"), same)
            rt, ct = loaded.tokenizer.decode(r), loaded.tokenizer.decode(tokens)
            key = str(c.passkey) if c.passkey is not None else None
            out.append(CaseResult(c.kind, c.context, c.depth, c.label, len(c.prompt), rt, ct, len(r), d is None, d,
                                  None if key is None else key in rt, None if key is None else key in ct, tuple(kl),
                                  replay))
    finally:
        gen.close()
    return out


def run_accuracy_benches(ssd_dir: str, model: str = "demo", contexts: tuple[int, ...] = (2048, 4096, 7168),
                         depths: tuple[float, ...] = DEPTHS, keys_per_depth: int = 2,
                         chat_prompts: tuple[str, ...] = CHAT_PROMPTS, token_budgets: tuple[int, ...] = (1024,),
                         loaded: LoadedModel | None = None, doc_tokens: tuple[int, int] = (2048, 4096),
                         passkey_tokens: int = 10, chat_tokens: int = 48, page_size: int = 16,
                         candidate_full_attention: bool = False, ssd_budget: int | None = None,
                         seed: int = 0) -> list[AccuracyBenchResult]:
    """One result per token budget, all from one prefill and one full-attention reference (neither depends
    on the budget; at 32K the prefill is nearly all the time). ``candidate_full_attention`` runs the
    candidate with full attention too: a self-check (KL 0, equal outputs)."""
    loaded = loaded or load_model(model)
    cases = _cases(loaded, contexts, depths, keys_per_depth, chat_prompts, doc_tokens, passkey_tokens,
                   chat_tokens, seed)
    mc = loaded.config
    page_bytes = KVLayout(len(mc.global_layers), mc.num_kv_heads, mc.head_dim, page_size,  # the tiers' layers
                          loaded.model.embed_tokens.weight.dtype).page_bytes
    decoded_pages = sum(c.max_tokens // page_size + 2 for c in cases)  # demoted decode pages land on SSD too
    need = _distinct_pages([c.prompt for c in cases], page_size) + 3 * decoded_pages
    tiers = TierConfig(ssd_dir=ssd_dir, ssd_bytes=ssd_budget or int(need * 1.3) * page_bytes + (64 << 20))
    base = EngineConfig(tiers=tiers, page_size=page_size, max_sequences=1, token_budget=token_budgets[0],
                        full_attention=True)
    transient = replace(base, tiers=replace(tiers, persist=False))
    shared: dict[str, float] = {}
    out: list[AccuracyBenchResult] = []
    # Inference mode on this thread too: the SSD tier's staging buffers may be created inside the model's
    # forward (inference tensors) and written again by evictions this thread triggers outside it.
    with torch.inference_mode():
        t = time.perf_counter()
        computed = _prefill_all(loaded, cases, base)
        shared["prefill"] = time.perf_counter() - t
        with tempfile.TemporaryDirectory(prefix="logits-", dir=ssd_dir) as scratch:
            t = time.perf_counter()
            ref = _reference(loaded, cases, transient, scratch)
            shared["reference"] = time.perf_counter() - t
            for budget in token_budgets:
                t = time.perf_counter()
                cfg = replace(transient, full_attention=candidate_full_attention, token_budget=budget)
                results = _candidate(loaded, cases, cfg, scratch, ref)
                seconds = {**shared, "candidate": time.perf_counter() - t}
                out.append(AccuracyBenchResult(
                    model=loaded.model_id, token_budget=budget, page_size=page_size,
                    candidate="full" if candidate_full_attention else "sparse", threads=torch.get_num_threads(),
                    prefill_tokens_computed=computed, seconds={k: round(v, 1) for k, v in seconds.items()},
                    cases=tuple(results)))
    return out


def _kl_mean(cases: list[CaseResult]) -> float:
    values = [x for c in cases for x in c.kl]  # token-weighted
    return statistics.fmean(values) if values else 0.0


def summary(result: AccuracyBenchResult) -> dict[str, object]:
    """Per-context retrieval accuracy, identical-output rates, mean KL and the acceptance checks."""
    pk = [c for c in result.cases if c.kind == "passkey"]
    out: dict[str, object] = {}

    def acc(cs: list[CaseResult], attr: str) -> float:
        return 100.0 * sum(bool(getattr(c, attr)) for c in cs) / len(cs) if cs else 0.0

    per_context = {}
    for ctx in sorted({c.context for c in pk}):
        cs = [c for c in pk if c.context == ctx]
        per_context[str(ctx)] = {
            "cases": len(cs), "prompt_tokens": round(statistics.fmean(c.prompt_tokens for c in cs)),
            "reference_accuracy": acc(cs, "reference_correct"), "candidate_accuracy": acc(cs, "candidate_correct"),
            "identical_rate": acc(cs, "identical") / 100, "kl_mean": _kl_mean(cs)}
    out["passkey"] = {"per_context": per_context, "cases": len(pk), "reference_accuracy": acc(pk, "reference_correct"),
                      "candidate_accuracy": acc(pk, "candidate_correct"), "identical_rate": acc(pk, "identical") / 100,
                      "kl_mean": _kl_mean(pk)}
    for s in SETS:
        cs = [c for c in result.cases if c.kind == s]
        div = [c.first_divergence for c in cs if c.first_divergence is not None]
        out[s] = {"prompts": len(cs), "prompt_tokens_mean": round(statistics.fmean(c.prompt_tokens for c in cs)) if cs
                  else 0, "identical_rate": acc(cs, "identical") / 100, "diverged": len(div),
                  "first_divergence_median": statistics.median(div) if div else None, "kl_mean": _kl_mean(cs),
                  "kl_max": max((x for c in cs for x in c.kl), default=0.0)}
    out["kl_mean_all"] = _kl_mean(list(result.cases))
    out["replay_max_diff"] = max((c.replay_diff for c in result.cases if c.replay_diff is not None), default=None)
    p = out["passkey"]
    assert isinstance(p, dict)
    chat = out["chat"]
    assert isinstance(chat, dict)
    out["acceptance"] = {
        "passkey_cases_ge_30": len(pk) >= 30,
        "retrieval_within_2_points": abs(p["candidate_accuracy"] - p["reference_accuracy"]) <= 2.0,
        "chat_prompts_ge_20": chat["prompts"] >= 20,
        "chat_identical_ge_90pct": chat["identical_rate"] >= 0.9,
    }
    return out


def as_dict(result: AccuracyBenchResult) -> dict[str, object]:
    return {**asdict(result), "summary": summary(result)}


def table(result: AccuracyBenchResult) -> str:
    s = summary(result)
    p = s["passkey"]
    assert isinstance(p, dict)
    rows = [f"Passkey retrieval (token budget {result.token_budget}, candidate: {result.candidate})", "",
            "| context | prompt tokens | cases | full attention | candidate | Δ points | identical outputs | mean KL |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for ctx, r in {**p["per_context"], "all": {**p, "prompt_tokens": "-"}}.items():
        rows.append(f"| {ctx} | {r['prompt_tokens']} | {r['cases']} | {r['reference_accuracy']:.1f}% | "
                    f"{r['candidate_accuracy']:.1f}% | {r['candidate_accuracy'] - r['reference_accuracy']:+.1f} | "
                    f"{r['identical_rate']:.0%} | {r['kl_mean']:.2e} |")
    rows += ["", "Greedy chat outputs against full attention", "",
             "| set | prompts | mean prompt tokens | identical | first divergence (median) | mean KL | max KL |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in SETS:
        c = s[name]
        assert isinstance(c, dict)
        fd = "-" if c["first_divergence_median"] is None else f"{c['first_divergence_median']:g}"
        rows.append(f"| {name} | {c['prompts']} | {c['prompt_tokens_mean']} | {c['identical_rate']:.0%} | {fd} | "
                    f"{c['kl_mean']:.2e} | {c['kl_max']:.2e} |")
    acc = s["acceptance"]
    assert isinstance(acc, dict)
    rows += ["", f"Mean KL(full || {result.candidate}) over all generated positions: {s['kl_mean_all']:.2e} nats. "
             "Acceptance: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in acc.items()) + "."]
    return "\n".join(rows)


def plot(result: AccuracyBenchResult, path: str) -> bool:
    """Retrieval accuracy per context, identical-output rates and mean KL; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    s = summary(result)
    p = s["passkey"]
    assert isinstance(p, dict)
    ctxs = list(p["per_context"])
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    ax = axes[0]
    for j, (key, name) in enumerate((("reference_accuracy", "full attention"), ("candidate_accuracy", result.candidate))):
        bars = ax.bar([i + 0.4 * j for i in range(len(ctxs))], [p["per_context"][c][key] for c in ctxs], 0.4,
                      label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks([i + 0.2 for i in range(len(ctxs))], [f"ctx {c}" for c in ctxs])
    ax.set_ylim(0, 105)
    ax.set_ylabel("passkey retrieval accuracy (%)")
    ax.legend(fontsize=8)
    groups = [f"passkey {c}" for c in ctxs] + list(SETS)
    stats = [p["per_context"][c] for c in ctxs] + [s[n] for n in SETS]
    same = axes[1].bar(groups, [100 * st["identical_rate"] for st in stats], color="tab:green")  # type: ignore[index]
    axes[1].bar_label(same, fmt="%.0f", fontsize=8)
    axes[1].set_ylim(0, 105)
    axes[1].set_ylabel("greedy outputs identical to full (%)")
    kls = [st["kl_mean"] for st in stats]  # type: ignore[index]
    bars = axes[2].bar(groups, [max(k, 1e-9) for k in kls], color="tab:red")
    axes[2].bar_label(bars, ["exact" if k == 0 else f"{k:.1e}" for k in kls], fontsize=7)
    axes[2].set_yscale("log")
    axes[2].set_ylabel(f"mean KL(full || {result.candidate}) per token (nats)")
    for ax in axes[1:]:
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.suptitle(f"{result.model}: sparse decoding vs full attention (token budget {result.token_budget}, "
                 f"page {result.page_size})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
