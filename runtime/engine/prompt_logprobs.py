"""The prompt's own log-probabilities (OpenAI's ``echo`` with ``logprobs``, vLLM's ``prompt_logprobs``).

Each prompt token after the first gets the log-probability the model gave it at the position before, from
the hidden states of the prefill chunk that computed that position: the same forward pass that samples,
never a second one. A prefix read from stored pages has no hidden states, so a request asking for its
prompt's log-probabilities computes its whole prompt (``LLMEngine.allocate`` opens it without prefix reuse);
its pages are still stored for the requests after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvdrive.runtime.engine.sampling import TokenLogprob

ROWS_PER_PASS = 128  # rows of a chunk turned into logits at once: [128, V] float32 (128 MiB at V = 262144)


def chunk_logprobs(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, start: int,
                   prompt: Sequence[int], have: int, k: int) -> list[TokenLogprob]:
    """The log-probabilities of the prompt tokens that the chunk's rows predict.

    ``hidden`` [n, H]: the chunk's hidden states, row j at position ``start + j``, which predicts prompt token
    ``start + j + 1``; ``have``: prompt positions already given (a chunk recomputed after a preemption gives
    only new ones); ``k``: alternatives per token. Returns those of positions ``have ..``, in order."""
    out: list[TokenLogprob] = []
    first = max(have - 1 - start, 0)  # the first row predicting a position not yet given
    last = min(hidden.shape[0], len(prompt) - 1 - start)  # rows predicting a prompt token (not the sampled one)
    for lo in range(first, last, ROWS_PER_PASS):
        hi = min(lo + ROWS_PER_PASS, last)
        lp = torch.log_softmax(logits_of(hidden[lo:hi]).float(), dim=-1)  # [r, V]
        targets = torch.tensor(prompt[start + lo + 1 : start + hi + 1], dtype=torch.int64, device=lp.device)  # [r]
        chosen = lp.gather(1, targets[:, None])[:, 0].tolist()  # [r]
        top = torch.topk(lp, k, dim=-1) if k else None
        for r in range(hi - lo):
            pairs = tuple(zip(top.indices[r].tolist(), top.values[r].tolist(), strict=True)) if top is not None else ()
            out.append(TokenLogprob(int(targets[r]), float(chosen[r]), pairs))
    return out
