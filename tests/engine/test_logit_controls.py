"""The logit controls (penalties, bias, min_tokens, stop_token_ids): batched over the step's rows, each row
gets exactly the formula of its own request, and a request that sets none is sampled from the model's logits.

The batched tensors are checked against a plain per-row, per-token computation of the documented formulas
(vLLM's order: repetition, then frequency and presence, then bias, then the min_tokens mask); then against
the engine: a bias forces or forbids a token, min_tokens holds the end back, a stop token id ends the answer.
"""

from __future__ import annotations

import math

import torch
from enginekit import plain_engine, run_dry, tokens

from kvdrive.runtime.engine import Request, SamplingParams
from kvdrive.runtime.engine.logit_controls import RowHistory, apply_controls
from kvdrive.runtime.model import LoadedModel

V = 50
EOS = frozenset({0})


def _reference(logits: list[float], row: RowHistory) -> list[float]:
    p, out = row.params, list(logits)
    seen = set(row.generated) | set(row.prompt_vocab.tolist())
    for t in range(V):
        if p.repetition_penalty != 1.0 and t in seen:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        count = sum(1 for g in row.generated if g == t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    for t, b in p.logit_bias:
        out[t] += b
    if len(row.generated) < p.min_tokens:
        for t in (*EOS, *p.stop_token_ids):
            out[t] = -math.inf
    return out


def test_each_row_of_a_batch_gets_its_own_requests_formula() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn((5, V), generator=g) * 3  # [5, V]
    rows = [
        RowHistory(SamplingParams(max_tokens=8), [3, 3, 4], torch.empty(0, dtype=torch.int64)),  # no controls
        RowHistory(SamplingParams(max_tokens=8, repetition_penalty=1.3), [7, 7, 9],
                   torch.tensor([1, 2, 9, 11])),
        RowHistory(SamplingParams(max_tokens=8, frequency_penalty=0.7, presence_penalty=-0.4), [5, 5, 5, 6],
                   torch.empty(0, dtype=torch.int64)),
        RowHistory(SamplingParams(max_tokens=8, logit_bias=((10, 100.0), (11, -100.0), (12, 2.5))), [],
                   torch.empty(0, dtype=torch.int64)),
        RowHistory(SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=(13,), repetition_penalty=0.8,
                                  frequency_penalty=0.2), [13, 14], torch.tensor([14, 15])),
    ]
    got = apply_controls(logits, rows, EOS)
    for i, row in enumerate(rows):
        want = torch.tensor(_reference(logits[i].tolist(), row))
        assert torch.allclose(got[i], want, atol=1e-5), (i, (got[i] - want).abs().max())
    assert torch.equal(got[0], logits[0])  # a request without controls: the model's logits
    first = logits[:1]
    assert apply_controls(first, rows[:1], EOS) is first  # none in the batch: nothing is computed


def test_a_vanishing_repetition_penalty_keeps_masked_tokens_masked_and_the_rest_finite() -> None:
    """5e-324 is a valid penalty (> 0) but 0 in float32: a seen positive logit divided by it overflows and a
    masked one (-inf) times it would be nan. The masked stay -inf; the rest are finite, in the penalty's order
    (found by the OpenAPI fuzzer with a grammar that allows only end-of-sequence)."""
    logits = torch.tensor([[4.0, -2.0, 0.0, float("-inf"), 1.0]])  # [1, 5]
    row = RowHistory(SamplingParams(max_tokens=8, repetition_penalty=5e-324), [0, 1, 2, 3],
                     torch.tensor([3]))
    got = apply_controls(logits, [row], frozenset())[0]
    assert not bool(torch.isnan(got).any())
    assert torch.isneginf(got[3]) and bool(torch.isfinite(got[[0, 1, 2, 4]]).all()), got
    assert got[0] > got[4] > got[2] >= got[1], got  # the seen positive one wins; unseen token 4 is unchanged
    assert got[4] == 1.0


def _answers(loaded: LoadedModel, params: list[SamplingParams]) -> list[list[int]]:
    """Greedy answers of one prompt under each of ``params``, run together in one batch."""
    engine = plain_engine(loaded, 4)
    prompt = tuple(torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(2)).tolist())
    for i, p in enumerate(params):
        engine.add_request(Request(f"r{i}", prompt, p, 0.0))
    outs = run_dry(engine)
    engine.runner.close()
    return [tokens(outs[f"r{i}"]) for i in range(len(params))]


def test_bias_min_tokens_and_stop_token_ids_steer_the_engines_answers(tiny: LoadedModel) -> None:
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    base = _answers(tiny, [plain])[0]
    top = base[0]
    forced, banned, stopped = _answers(tiny, [
        SamplingParams(max_tokens=12, ignore_eos=True, logit_bias=((77, 100.0),)),
        SamplingParams(max_tokens=12, ignore_eos=True, logit_bias=((top, -100.0),)),
        SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(base[3],)),
    ])
    assert forced == [77] * 12  # +100 on one token: greedy picks it every step
    assert top not in banned and banned != base
    cut = base.index(base[3])
    assert stopped == base[:cut]  # ends at the first sampled stop token id, which is not emitted
    held = _answers(tiny, [SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(base[3],),
                                          min_tokens=cut + 2)])[0]
    assert len(held) >= cut + 2 and base[3] not in held[: cut + 2]
