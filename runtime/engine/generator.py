"""A single-process generation loop over the tiered KV cache: chunked prefill, then decode.

``Generator`` owns one model, one ``TieredKVCache`` and the sequences in it. It is the piece the CLI and
benchmarks drive directly; the serving scheduler (continuous batching) builds on ``forward_tokens`` for
batches of sequences.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

import torch

from kvdrive.runtime.engine.heap import HeapTrimmer
from kvdrive.runtime.engine.sampling import SamplingParams, make_generator, sample
from kvdrive.runtime.engine.tiered_backend import TieredAttentionBackend
from kvdrive.runtime.engine.tiered_cache import TierConfig, TieredKVCache
from kvdrive.runtime.kvcache import KVLayout
from kvdrive.runtime.model import LoadedModel


class PromptTooLongError(ValueError):
    """The prompt plus the requested tokens do not fit the model's context."""


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    kv_budget_bytes: int | None = None  # gpu tier incl. open pages; None: one full-context sequence + open pages
    prefill_chunk: int = 512  # tokens per prefill forward (bounds activation memory)
    kv_dtype: torch.dtype | None = None  # None: the model's dtype
    dram_budget_bytes: int = 0
    ssd_dir: str | None = None
    ssd_budget_bytes: int = 0
    hugetlbfs_dir: str | None = None
    ssd_codec: str = "none"
    placement: str = "kvdrive"  # kvdrive | lru | ondemand | fullfetch
    full_attention: bool = False
    token_budget: int = 1024
    max_sequences: int = 16  # sequences with an open page at once (the scheduler's max_running)
    persist: bool = True  # write sealed pages through to the SSD tier


class Generator:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.loaded = loaded
        self.config = c = config or EngineConfig()
        model, cfg = loaded.model, loaded.config
        self.device = model.embed_tokens.weight.device
        layout = KVLayout(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            page_size=c.page_size,
            dtype=c.kv_dtype or model.embed_tokens.weight.dtype,
        )
        gpu = c.kv_budget_bytes
        if gpu is None:
            gpu = (layout.pages_for(cfg.context_length) + c.max_sequences) * layout.page_bytes
        tiers = TierConfig(gpu_bytes=gpu, dram_bytes=c.dram_budget_bytes, ssd_bytes=c.ssd_budget_bytes,
                           ssd_dir=c.ssd_dir, hugetlbfs_dir=c.hugetlbfs_dir, ssd_codec=c.ssd_codec,
                           placement=c.placement, full_attention=c.full_attention, token_budget=c.token_budget,
                           max_sequences=c.max_sequences, persist=c.persist)
        fingerprint = f"{loaded.fingerprint}|kv={layout.dtype}|page={c.page_size}"
        self.cache = TieredKVCache(layout, tiers, self.device, fingerprint)
        self._ids = itertools.count()
        self.heap = HeapTrimmer()

    @property
    def max_context(self) -> int:
        return self.loaded.config.context_length

    @property
    def page_reads(self) -> int:
        """Blocks (one layer's page) read from the KV tiers by attention, all tiers."""
        return sum(self.cache.store.page_reads.values())

    # --- sequences ---------------------------------------------------------------------------
    def new_sequence(self) -> int:
        return self.open_sequence(())[0]

    def open_sequence(self, prompt: Sequence[int]) -> tuple[int, int]:
        """A new sequence; returns (seq_id, prompt tokens whose KV was reused from the tiers)."""
        seq_id = next(self._ids)
        matched = self.cache.add_sequence(seq_id, list(prompt))
        return seq_id, matched

    def release(self, seq_id: int) -> None:
        self.cache.free(seq_id)

    def close(self) -> None:
        """Finish queued write-backs (prefix pages reach the SSD tier) and close the tiers."""
        self.cache.close()

    # --- forward steps -----------------------------------------------------------------------
    def forward_tokens(self, batch: Sequence[tuple[int, Sequence[int]]], decoding: Collection[int] = ()) -> torch.Tensor:
        """Append tokens to sequences and run the model. Returns hidden states [N, H]. Sequences in
        ``decoding`` feed one generated token (page selection applies); the others feed prompt tokens."""
        steps = [self.cache.begin(seq_id, list(tokens), seq_id in decoding) for seq_id, tokens in batch]
        if self.cache.policy.hotness_eviction and decoding:  # admission only happens on decode reads
            self.cache.update_floors()
        ids = [t for _, tokens in batch for t in tokens]
        backend = TieredAttentionBackend(self.cache, steps)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        hidden = self.loaded.model(input_ids, torch.cat([s.positions for s in steps]), backend)
        self.cache.finish_step(backend.sealed, backend.decoded)
        if len(ids) > len(decoding):  # prompt tokens: give the step's freed working memory back
            self.heap.after_prompt_step()
        return hidden

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
        hidden = self.forward_tokens([(seq_id, [tok]) for seq_id, tok in batch], {seq_id for seq_id, _ in batch})
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
        seq_id, reused = self.open_sequence(prompt)
        try:
            logits = self.prefill(seq_id, prompt[reused:])
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
