"""One model over one KV cache: forward steps (chunked prefill, batched decode) of the sequences in it.

``ModelRunner`` owns one model, one ``KVCache`` and the sequences in it, and runs forward steps:
``forward_tokens`` (any mix of prompt chunks and decodes), ``prefill`` and ``decode``. It samples nothing and
loops over nothing: the one generation loop is ``LLMEngine`` (scheduling, sampling, grammars, undo), which
``kvdrive serve``, ``kvdrive generate`` and the benchmarks drive.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import replace

import torch

from kvdrive.runtime.engine.heap import HeapTrimmer
from kvdrive.runtime.kvcache import EngineConfig, KVCache, KVLayout, SlidingWindows, default_envelope_bytes
from kvdrive.runtime.model import LoadedModel


class PromptTooLongError(ValueError):
    """The prompt plus the requested tokens do not fit the model's context."""


def kv_layout(loaded: LoadedModel, config: EngineConfig) -> KVLayout:
    """The layout of ``loaded``'s KV pages under ``config``: the tiers hold the global layers (sliding ones keep a
    window, outside them)."""
    cfg = loaded.config
    return KVLayout(num_layers=len(cfg.global_layers), num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                    page_size=config.page_size, dtype=config.kv_dtype or loaded.dtype)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.loaded = loaded
        self.config = c = config or EngineConfig()
        cfg = loaded.config
        self.device = loaded.device
        layout = kv_layout(loaded, c)
        fingerprint = f"{loaded.fingerprint}|{layout.fingerprint()}"
        windows = SlidingWindows(cfg.sliding_layers, cfg.sliding_window, c.page_size, c.max_sequences,
                                 cfg.num_kv_heads, cfg.head_dim, layout.dtype, self.device) if cfg.sliding_layers else None
        if c.tiers.envelope_bytes is None:  # one full-context sequence plus what the envelope reserves
            window_bytes = windows.bytes_per_sequence() if windows is not None else 0
            gpu = default_envelope_bytes(layout, c, cfg.context_length, window_bytes, self.device)
            c = self.config = replace(c, tiers=replace(c.tiers, envelope_bytes=gpu))
        self.cache = KVCache(layout, c, self.device, fingerprint, windows, cfg.global_layers)
        self._ids = itertools.count()
        self.heap = HeapTrimmer()
        self.timings: dict[str, float] | None = None  # per-phase decode seconds, when a benchmark asks

    @property
    def max_context(self) -> int:
        return self.loaded.config.context_length

    def request_limit(self) -> int:
        """Tokens one request can hold now (prompt + generated): the model's context or what the KV tiers
        hold per request, the smaller (the tiers' budgets change live)."""
        cache = self.cache
        return min(self.max_context, (cache.num_pages + 1) * cache.layout.page_size - 1)

    def check_prompt(self, num_prompt_tokens: int) -> None:
        """The one prompt-length check: a prompt must leave room for one generated token in the model's
        context and fit the KV tiers. Raises PromptTooLongError."""
        limit = self.max_context
        if num_prompt_tokens < 1:
            raise PromptTooLongError("the prompt is empty")
        if num_prompt_tokens + 1 > limit:
            raise PromptTooLongError(
                f"the prompt has {num_prompt_tokens} tokens; this model's context is {limit} tokens "
                f"(prompt + at least 1 generated token must fit)")
        cache = self.cache
        if cache.pages_needed(None, num_prompt_tokens + 1) > cache.num_pages:
            raise PromptTooLongError(
                f"the prompt has {num_prompt_tokens} tokens; the KV tiers hold at most "
                f"{(cache.num_pages + 1) * cache.layout.page_size - 1} tokens per request")

    @property
    def page_reads(self) -> int:
        """Blocks (one layer's page) read from the KV tiers by attention, all tiers."""
        return sum(self.cache.page_reads().values())

    # --- sequences ---------------------------------------------------------------------------
    def new_sequence(self) -> int:
        return self.open_sequence(())[0]

    def open_sequence(self, prompt: Sequence[int], load: bool = True, salt: str | None = None) -> tuple[int, int]:
        """A new sequence; returns (seq_id, prompt tokens whose KV is reused from the tiers). ``load=False``
        looks the stored prefix up without reading it (the scheduler's call); ``load_prefix`` then reads it
        before the sequence's first step. ``salt``: the request's cache_salt (pages shared only within it)."""
        seq_id = next(self._ids)
        matched = self.cache.add_sequence(seq_id, list(prompt), load=load, salt=salt)
        return seq_id, matched

    def load_prefix(self, seq_id: int) -> bool:
        """Read the stored prefix ``open_sequence(..., load=False)`` matched; False when it came short (the
        sequence then holds fewer tokens than it was opened with: see ``KVCache.load_prefix``)."""
        return self.cache.load_prefix(seq_id)

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
        self.cache.prepare_step()
        ids = [t for _, tokens in batch for t in tokens]
        backend = self.cache.backend(steps, self.timings if decoding else None, self.loaded.weights.prompt_products())
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        hidden = self.loaded.model(input_ids, torch.cat([s.positions for s in steps]), backend)
        backend.finish()
        self.cache.finish_step(backend.sealed, backend.decoded)
        if len(ids) > len(decoding):  # prompt tokens: the heap keeps what the step freed for the next one
            self.heap.prompt_step()
        else:  # decodes only: the prompts settled, give their freed working memory back
            self.heap.settle()
        return hidden

    def idle(self) -> None:
        """The engine has no work: give back the memory the last prompt steps freed."""
        self.heap.settle()

    def prefill(self, seq_id: int, tokens: Sequence[int], all_logits: bool = False) -> torch.Tensor:
        """Feed a prompt in chunks. Returns the last position's logits [V] (or all: [T, V])."""
        if not tokens:
            raise ValueError("empty prompt")
        self.check_prompt(self.cache.length(seq_id) + len(tokens))
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
