"""Structured outputs: grammars compiled against the model's tokenizer, and the per-sequence matchers that
mask each step's logits, batched.

The engine is llguidance, picked by measurement (``docs/openai-api.md``, "Structured outputs"): on this CPU it
compiles a JSON schema in under a millisecond (xgrammar: ~30 ms on Gemma 3's vocabulary, outlines-core:
seconds), masks a step in 5-14 us, enforces every JSON-schema keyword pydantic emits (bounds included, which
outlines-core drops), reads a ``tokenizers`` JSON directly and needs no other package.

A grammar is compiled at the HTTP edge (``GrammarCompiler.compile``, off the event loop), where a bad schema
is a 400; the engine only copies its matcher per sequence (~1 us). Each step, the rows that follow a grammar
get their allowed-token bitmask computed together (``fill_next_token_bitmask_par``) and every other token's
logit set to -inf before sampling, so a sampled token always continues the document. End-of-sequence is
allowed only where the document is complete.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import llguidance
import llguidance.torch as llt
import torch

from kvdrive.runtime.prompt import Tokenizer

Matcher = llguidance.LLMatcher  # one sequence's position in its grammar
GrammarKind = Literal["json_object", "json_schema", "regex", "choice", "lark"]
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar that cannot be compiled or can never be satisfied; the message says why."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to: ``source`` is the JSON schema (JSON text), the regex, the Lark
    grammar, or the choices (a JSON list of strings)."""

    kind: GrammarKind
    source: str = ""


@dataclass(frozen=True)
class CompiledGrammar:
    spec: GrammarSpec
    proto: llguidance.LLMatcher  # never advanced: each sequence follows a copy of it

    def matcher(self) -> llguidance.LLMatcher:
        return self.proto.deep_copy()


def _grammar_text(spec: GrammarSpec) -> str:
    m = llguidance.LLMatcher
    if spec.kind == "json_object":
        return m.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.kind == "json_schema":
        return m.grammar_from_json_schema(spec.source, defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return m.grammar_from_regex(spec.source)
    if spec.kind == "choice":
        return m.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec.source)))
    return m.grammar_from_lark(spec.source)


class GrammarCompiler:
    """Compiles grammars for one model's tokenizer. Thread-safe; the tokenizer's llguidance form is built on
    first use (0.2 s for a 49K vocabulary, 2.3 s for 262K)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                tok = self._tokenizer
                self._ll = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size,
                                                  eos_token=list(tok.eos_token_ids))
            return self._ll

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Raises GrammarError naming what is wrong (a malformed schema, an unsatisfiable one, a bad regex)."""
        ll = self._ll_tokenizer()
        try:
            text = _grammar_text(spec)
        except (ValueError, TypeError, RuntimeError) as exc:  # a schema llguidance cannot read
            raise GrammarError(str(exc)) from exc
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, ll)
        if is_error:
            raise GrammarError(messages[0])
        proto = llguidance.LLMatcher(ll, text, log_level=0)
        if proto.is_error():
            raise GrammarError(proto.get_error())
        return CompiledGrammar(spec, proto)


class GrammarMasks:
    """The step's masks: one bitmask row per constrained sequence, computed in parallel."""

    def __init__(self, vocab_size: int) -> None:
        """``vocab_size``: the tokenizer's (the grammars'); a model may have more logits (padded embeddings),
        which no grammar allows, or fewer."""
        self._executor = llguidance.LLExecutor()
        self._vocab = vocab_size

    def apply(self, logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[Matcher]) -> torch.Tensor:
        """logits [B, V] (float32) with -inf for each token the matcher of ``rows[i]`` does not allow."""
        if not rows:
            return logits
        batch, vocab = logits.shape
        bitmask = llt.allocate_token_bitmask(len(rows), self._vocab)  # int32 [b, ceil(V_tok / 32)]
        llt.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        shifts = torch.arange(32, dtype=torch.int32)
        bits = ((bitmask[:, :, None] >> shifts) & 1).reshape(len(rows), -1)[:, : self._vocab].bool()  # [b, V_tok]
        allowed = torch.zeros(len(rows), vocab, dtype=torch.bool)  # [b, V]: a logit past the tokenizer: never
        n = min(vocab, self._vocab)
        allowed[:, :n] = bits[:, :n]
        keep = torch.ones(batch, vocab, dtype=torch.bool)  # [B, V]
        keep[torch.tensor(list(rows), dtype=torch.int64)] = allowed
        return logits.masked_fill(~keep.to(logits.device), float("-inf"))
