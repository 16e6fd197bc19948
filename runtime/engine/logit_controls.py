"""The logit controls of a step's sequences, applied batched on tensors before sampling.

For the rows whose request sets any (``SamplingParams.controls_logits``), in this order, as vLLM does:
- ``repetition_penalty`` (vLLM / Hugging Face): a token seen in the prompt or the completion has its logit
  divided by the penalty when positive, multiplied when negative (a result past float32 is its largest finite
  value; a masked token stays masked);
- ``frequency_penalty`` and ``presence_penalty`` (OpenAI): minus ``frequency * count + presence * (count > 0)``,
  counting the tokens of the completion so far;
- ``logit_bias``: added to the named tokens' logits;
- ``min_tokens``: end-of-sequence and ``stop_token_ids`` are masked out until the completion has that many.

One gather of each row's token counts builds a ``[b, V]`` tensor; every control is then one tensor op over
the rows that use it. The counts are built from the completion's tokens (bounded by ``max_tokens``) and the
prompt's distinct tokens (kept per sequence once computed), never by walking the context per step.
Log-probabilities a client asks for come from the model's logits before any control (as OpenAI reports them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvdrive.runtime.engine.sampling import SamplingParams


@dataclass(frozen=True)
class RowHistory:
    """What one row's controls need: its sampling parameters, the completion's tokens so far, the distinct
    tokens of its prompt ([n] int64, only read with a repetition penalty)."""

    params: SamplingParams
    generated: Sequence[int]
    prompt_vocab: torch.Tensor


def prompt_vocab(params: SamplingParams, prompt: Sequence[int]) -> torch.Tensor:
    """The distinct tokens of ``prompt`` ([n] int64) when a repetition penalty reads them; else empty."""
    if params.repetition_penalty == 1.0:
        return torch.empty(0, dtype=torch.int64)
    return torch.unique(torch.tensor(list(prompt), dtype=torch.int64))


def apply_controls(logits: torch.Tensor, rows: Sequence[RowHistory], eos: frozenset[int]) -> torch.Tensor:
    """logits [b, V] (row i for rows[i]) -> the logits with each row's controls applied ([b, V] float32; the
    input is returned unchanged when no row sets any)."""
    if not any(r.params.controls_logits for r in rows):
        return logits
    out = logits.float().clone()
    b, vocab = out.shape
    dev = out.device
    # the completion's token counts per row: one index_put with accumulation
    ri = [i for i, r in enumerate(rows) for _ in r.generated]
    ti = [t for r in rows for t in r.generated]
    counts = torch.zeros((b, vocab), dtype=torch.float32, device=dev)
    if ti:
        counts.index_put_((torch.tensor(ri, device=dev), torch.tensor(ti, device=dev)),
                          torch.ones(len(ti), device=dev), accumulate=True)
    rep = torch.tensor([r.params.repetition_penalty for r in rows], device=dev)[:, None]  # [b, 1]
    if bool((rep != 1.0).any()):
        seen = counts > 0
        for i, r in enumerate(rows):
            if r.params.repetition_penalty != 1.0 and r.prompt_vocab.numel():
                seen[i, r.prompt_vocab.to(dev)] = True
        penalized = torch.where(out > 0, out / rep, out * rep)
        # a tiny penalty (5e-324 is 0 in float32) overflows: its limit is the largest finite logit; a masked
        # token (-inf) stays masked, never -inf * 0 = nan
        big = torch.finfo(torch.float32).max
        penalized = torch.where(torch.isneginf(out), out, torch.nan_to_num(penalized, nan=0.0, posinf=big))
        out = torch.where(seen, penalized, out)
    freq = torch.tensor([r.params.frequency_penalty for r in rows], device=dev)[:, None]
    pres = torch.tensor([r.params.presence_penalty for r in rows], device=dev)[:, None]
    out = out - freq * counts - pres * (counts > 0).float()
    bias = [(i, t, v) for i, r in enumerate(rows) for t, v in r.params.logit_bias]
    if bias:
        bi, bt, bv = zip(*bias, strict=True)
        out.index_put_((torch.tensor(bi, device=dev), torch.tensor(bt, device=dev)),
                       torch.tensor(bv, dtype=torch.float32, device=dev), accumulate=True)
    early = [(i, t) for i, r in enumerate(rows) if len(r.generated) < r.params.min_tokens
             for t in (*eos, *r.params.stop_token_ids) if t < vocab]
    if early:
        mi, mt = zip(*early, strict=True)
        out[torch.tensor(mi, device=dev), torch.tensor(mt, device=dev)] = float("-inf")
    return out
