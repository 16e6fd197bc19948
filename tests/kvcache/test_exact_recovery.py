"""A request recomputed after preemption (memory pressure, a lost page) continues with the same tokens.

Sparse decode computes each generated token's KV with page selection: it attends to the selected pages,
not to the whole context. Before, a preempted request recomputed its generated tokens as prompt (full
attention), so their KV differed from the original run's and the greedy continuation could change.
Now the prompt is recomputed as prompt and the generated tokens are replayed one at a time as decode
steps, exactly as they were first computed; sampling resumes after the last of them.
"""

from __future__ import annotations

from enginekit import tiered_engine

from kvdrive.runtime.engine import LLMEngine, Request, SamplingParams
from kvdrive.runtime.model import load_model

PROMPT = tuple((7 * i + 3) % 200 + 5 for i in range(45))


def _engine(path) -> LLMEngine:  # type: ignore[no-untyped-def]
    return tiered_engine(load_model(str(path), progress=False), step_tokens=16, token_budget=12)  # selection from 12 tokens on


def _generate(engine: LLMEngine, preempt_at: tuple[int, ...] = ()) -> list[int]:
    engine.add_request(Request("r", PROMPT, SamplingParams(max_tokens=40, ignore_eos=True), 0.0))
    tokens: list[int] = []
    while engine.has_work():
        for o in engine.step():
            tokens += o.new_token_ids
        seq = engine._seqs.get("r")
        if seq is not None and seq.num_generated in preempt_at and seq.seq_id is not None and len(seq.pending) == 1:
            preempt_at = tuple(p for p in preempt_at if p != seq.num_generated)
            engine._preempt(seq)  # as memory pressure or a lost page does
    return tokens


def test_preempted_sparse_decode_continues_with_the_same_tokens(hf_model_factory) -> None:  # type: ignore[no-untyped-def]
    path, _ = hf_model_factory(arch="llama", max_position_embeddings=512)
    clean = _generate(_engine(path))
    engine = _engine(path)
    recovered = _generate(engine, preempt_at=(6, 21))
    assert engine.stats().preemptions_total == 2
    assert recovered == clean
