"""A single-process generation loop over the paged KV cache: chunked prefill, then decode.

``Generator`` owns one model, one KV cache and the sequences in it. It is the piece the CLI and
benchmarks drive directly; the serving scheduler (continuous batching) builds on ``prefill`` and
``decode`` for batches of sequences.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kvdrive.runtime.engine.backend import PagedAttentionBackend, StepSequence
from kvdrive.runtime.engine.sampling import SamplingParams, make_generator, sample
from kvdrive.runtime.kvcache import KVLayout, PagedKVCache
from kvdrive.runtime.model import LoadedModel


class PromptTooLongError(ValueError):
    """The prompt plus the requested tokens do not fit the model's context."""


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    kv_budget_bytes: int | None = None  # None: room for one sequence of the model's full context
    prefill_chunk: int = 512  # tokens per prefill forward (bounds activation memory)
    kv_dtype: torch.dtype | None = None  # None: the model's dtype


class Generator:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.loaded = loaded
        self.config = config or EngineConfig()
        model, cfg = loaded.model, loaded.config
        self.device = model.embed_tokens.weight.device
        layout = KVLayout(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            page_size=self.config.page_size,
            dtype=self.config.kv_dtype or model.embed_tokens.weight.dtype,
        )
        budget = self.config.kv_budget_bytes
        if budget is None:
            budget = layout.pages_for(cfg.context_length) * layout.page_bytes
        self.cache = PagedKVCache.for_budget(layout, budget, self.device)
        self._ids = itertools.count()
        self.page_reads = 0  # pages read from the KV store by attention (all layers)

    @property
    def max_context(self) -> int:
        return self.loaded.config.context_length

    # --- sequences ---------------------------------------------------------------------------
    def new_sequence(self) -> int:
        seq_id = next(self._ids)
        self.cache.add_sequence(seq_id)
        return seq_id

    def release(self, seq_id: int) -> None:
        self.cache.free(seq_id)

    # --- forward steps -----------------------------------------------------------------------
    def forward_tokens(self, batch: Sequence[tuple[int, Sequence[int]]]) -> torch.Tensor:
        """Append tokens to sequences and run the model. Returns hidden states [N, H]."""
        steps, ids, positions = [], [], []
        for seq_id, tokens in batch:
            start = self.cache.length(seq_id)
            slots = self.cache.reserve(seq_id, len(tokens))
            pos = torch.arange(start, start + len(tokens), device=self.device)
            steps.append(StepSequence(seq_id, len(tokens), pos, slots))
            ids.extend(tokens)
            positions.append(pos)
        self.page_reads += self.loaded.config.num_layers * sum(
            self.cache.num_pages_of(s.seq_id) for s in steps
        )
        backend = PagedAttentionBackend(self.cache, steps)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        return self.loaded.model(input_ids, torch.cat(positions), backend)

    def prefill(self, seq_id: int, tokens: Sequence[int], all_logits: bool = False) -> torch.Tensor:
        """Feed a prompt in chunks. Returns the last position's logits [V] (or all: [T, V])."""
        if not tokens:
            raise ValueError("empty prompt")
        if self.cache.length(seq_id) + len(tokens) > self.max_context:
            raise PromptTooLongError(
                f"{len(tokens)} prompt tokens exceed the model's context of {self.max_context} tokens"
            )
        chunk = self.config.prefill_chunk
        outs = []
        for i in range(0, len(tokens), chunk):
            hidden = self.forward_tokens([(seq_id, tokens[i : i + chunk])])
            outs.append(self.loaded.model.logits(hidden if all_logits else hidden[-1:]))
        return torch.cat(outs) if all_logits else outs[-1][0]

    def decode(self, batch: Sequence[tuple[int, int]]) -> torch.Tensor:
        """One decode step for (seq_id, last token) pairs. Returns logits [B, V]."""
        hidden = self.forward_tokens([(seq_id, [tok]) for seq_id, tok in batch])
        return self.loaded.model.logits(hidden)

    # --- convenience -------------------------------------------------------------------------
    def generate(self, prompt: Sequence[int], params: SamplingParams) -> Iterator[int]:
        """Yield generated token ids until EOS (unless ignored), max_tokens or context end."""
        if len(prompt) + 1 > self.max_context:
            raise PromptTooLongError(
                f"{len(prompt)} prompt tokens leave no room in the model's context of {self.max_context}"
            )
        eos = set(self.loaded.tokenizer.eos_token_ids)
        gen = make_generator(params)
        seq_id = self.new_sequence()
        try:
            logits = self.prefill(seq_id, prompt)
            for i in range(params.max_tokens):
                token = sample(logits, params, gen)
                if token in eos and not params.ignore_eos:
                    return
                yield token
                if i + 1 == params.max_tokens or self.cache.length(seq_id) + 1 >= self.max_context:
                    return
                logits = self.decode([(seq_id, token)])[0]
        finally:
            self.release(seq_id)
