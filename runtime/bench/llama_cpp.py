"""llama.cpp as the CPU anchor of the decode benchmark: the same GGUF, the same thread count, all KV in RAM.

Runs through ``llama-cpp-python``'s low-level API (the ``bench`` extra; it compiles llama.cpp from source,
about 10-15 minutes on 2 cores), so that a batch of B sequences decodes as one ``llama_decode`` of B tokens
(one KV stream per sequence). Every sequence is prefilled once at the longest context; shorter contexts
are measured by cutting each sequence's KV back (``llama_memory_seq_rm``), so the long prefill is paid
once; sliding-window layers (Gemma 3) keep their full history (``swa_full``) so that the cut is exact, as
it would not be with only the last window kept. Flash attention is off: on this CPU it made decode 2.5x
slower (measured 82 vs 32 ms a token at 3K).
Token ids are the demo tokenizer's: the vocabulary is the GGUF's own. When the package is missing the
benchmark says so and goes on without this row.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

BATCH = 512  # tokens per llama_decode while prefilling


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


@dataclass(frozen=True)
class LlamaCppSteps:
    context: int
    batch: int
    step_seconds: list[float]


class LlamaCppDecoder:
    """B sequences of one GGUF in one llama.cpp context; greedy decode steps timed one by one."""

    def __init__(self, gguf: str, prompts: list[list[int]], extra_tokens: int, threads: int,
                 progress: Callable[[str], None] | None = None) -> None:
        import llama_cpp as lc  # the bench extra

        self.lc = lc
        self.prompts = prompts
        self._quiet = lc.llama_log_callback(lambda level, text, data: None)  # kept: C holds the pointer
        lc.llama_log_set(self._quiet, None)
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = lc.llama_model_load_from_file(gguf.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        cp = lc.llama_context_default_params()
        longest = max(len(p) for p in prompts)
        cp.n_ctx = len(prompts) * (longest + extra_tokens + 64)
        cp.n_batch = cp.n_ubatch = BATCH
        cp.n_seq_max = len(prompts)
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = False  # one KV stream per sequence: decode attends to its own tokens only
        cp.flash_attn_type = 0
        cp.swa_full = True  # sliding-window layers keep every position, so cutting back to a context is exact
        cp.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.batch = lc.llama_batch_init(BATCH, 0, len(prompts))
        self.memory = lc.llama_get_memory(self.ctx)
        self.last: list[int] = []
        for i, p in enumerate(prompts):
            if progress is not None:
                progress(f"llama.cpp prefill {i + 1}/{len(prompts)} ({len(p)} tokens)")
            self.last.append(self._prefill(i, p))

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        b = self.batch
        b.n_tokens = len(items)
        for j, (tok, pos, seq, logits) in enumerate(items):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = tok, pos, 1, logits
            b.seq_id[j][0] = seq
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, i: int) -> int:
        return int(np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).argmax())

    def _prefill(self, seq: int, prompt: list[int]) -> int:
        for a in range(0, len(prompt), BATCH):
            chunk = prompt[a : a + BATCH]
            self._decode([(t, a + j, seq, a + j == len(prompt) - 1) for j, t in enumerate(chunk)])
        return self._argmax(len(chunk) - 1)

    def steps(self, context: int, batch: int, steps: int, warmup: int) -> LlamaCppSteps:
        """Decode ``warmup + steps`` tokens for sequences 0..batch-1 cut back to ``context`` tokens."""
        lc = self.lc
        for s in range(len(self.prompts)):  # drop what earlier runs decoded and what lies past the context
            if not lc.llama_memory_seq_rm(self.memory, s, context, -1):
                raise RuntimeError(f"llama.cpp could not cut sequence {s} back to {context} tokens")
        # the token at position ``context``: the prompt's next one, or the greedy one after a whole prompt
        last = [p[context] if len(p) > context else self.last[s] for s, p in enumerate(self.prompts[:batch])]
        times = []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            self._decode([(last[s], context + i, s, True) for s in range(batch)])
            last = [self._argmax(s) for s in range(batch)]
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return LlamaCppSteps(context, batch, times)

    def prefill_seconds(self, prompt: list[int]) -> float:
        """Time to first token of ``prompt`` from an empty sequence 0: its prompt processing (512-token
        batches) and the first token's logits. Sequence 0's earlier KV is dropped: call after ``steps``."""
        if not self.lc.llama_memory_seq_rm(self.memory, 0, 0, -1):
            raise RuntimeError("llama.cpp could not clear sequence 0")
        t0 = time.perf_counter()
        self.last[0] = self._prefill(0, prompt)
        return time.perf_counter() - t0

    def close(self) -> None:
        lc = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)


@contextmanager
def decoder(gguf: str, prompts: list[list[int]], extra_tokens: int, threads: int,
            progress: Callable[[str], None] | None = None) -> Iterator[Any]:
    d = LlamaCppDecoder(gguf, prompts, extra_tokens, threads, progress)
    try:
        yield d
    finally:
        d.close()
