"""Accuracy of sparse decoding against full attention on the same prompts (issue #4).

Owns the accuracy benchmark: passkey retrieval at several contexts and depths, greedy chat outputs
(short prompts, and the same questions after a long document so that page selection is active) and
KL(full || sparse) of the next-token distributions along the full-attention continuation.

Three phases, one ``ModelRunner`` open at a time on one SSD directory:
1. prefill: every prompt's pages are computed once (exact attention) and written to the SSD tier;
   prompts sharing a prefix (a context's haystack, the chat document) share its pages.
2. reference: a full-attention ModelRunner reuses the stored prompt pages, recomputes the open tail
   page, greedy-decodes and keeps its logits.
3. candidate: a sparse ModelRunner (the token budget) reuses the same pages and decodes free-running
   greedy; where its output diverges from the reference it is teacher-forced along the reference
   tokens from there, so every KL term compares distributions given the same prefix. Several budgets
   run phase 3 once each against one prefill and one reference.
Phase 1 writes through to the SSD tier, so a run that dies in it resumes there when started again on
the same directory: the stored pages (and window snapshots) are reused.
Reference and candidate never write their decoded pages to the SSD tier: pages are content-addressed
by tokens, not by attention mode, so a candidate decoding the reference's tokens would otherwise read
the reference's KV for them. The first answer token comes from the prefill of the tail page, exact in
both modes (as ``LLMEngine`` prefills) unless prefix reuse leaves a single token to compute.
"""

from __future__ import annotations

import hashlib
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from kvdrive.runtime.bench.texts import filler_tokens, passkey_prompt
from kvdrive.runtime.engine import EngineConfig, ModelRunner, TierConfig
from kvdrive.runtime.kvcache.store import KVLayout
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
    gen = ModelRunner(loaded, cfg)
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


def _greedy(gen: ModelRunner, prompt: tuple[int, ...], max_tokens: int, eos: set[int]) -> tuple[list[int], torch.Tensor]:
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


def _forced(gen: ModelRunner, prompt: tuple[int, ...], tokens: list[int], start: int) -> torch.Tensor:
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
    gen = ModelRunner(loaded, cfg)
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
    gen = ModelRunner(loaded, cfg)
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
                         seed: int = 0, selection_rest: str = "auto") -> list[AccuracyBenchResult]:
    """One result per token budget, all from one prefill and one full-attention reference (neither depends
    on the budget; at 32K the prefill is nearly all the time). ``candidate_full_attention`` runs the
    candidate with full attention too: a self-check (KL 0, equal outputs). ``selection_rest``: the sparse
    candidate's ``--selection-rest``."""
    loaded = loaded or load_model(model)
    cases = _cases(loaded, contexts, depths, keys_per_depth, chat_prompts, doc_tokens, passkey_tokens,
                   chat_tokens, seed)
    mc = loaded.config
    page_bytes = KVLayout(len(mc.global_layers), mc.num_kv_heads, mc.head_dim, page_size,  # the tiers' layers
                          loaded.dtype).page_bytes
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
                cfg = replace(transient, full_attention=candidate_full_attention, token_budget=budget,
                              selection_rest=selection_rest)
                results = _candidate(loaded, cases, cfg, scratch, ref)
                seconds = {**shared, "candidate": time.perf_counter() - t}
                out.append(AccuracyBenchResult(
                    model=loaded.model_id, token_budget=budget, page_size=page_size,
                    candidate="full" if candidate_full_attention else "sparse", threads=torch.get_num_threads(),
                    prefill_tokens_computed=computed, seconds={k: round(v, 1) for k, v in seconds.items()},
                    cases=tuple(results)))
    return out
