"""Fair admission: a long prefill cannot hold short requests hostage, and nothing starves.

A long prompt arrives first and is being prefilled in chunks; short requests arrive after it. Under the
``fifo`` policy they wait for the whole long prefill; under ``fair`` (the default) they start at the next
step, while the long prompt keeps its guaranteed share and finishes barely later. Outputs stay those of
generating each request alone.
"""

from __future__ import annotations

from enginekit import tiered_engine

from kvdrive.runtime.engine import LLMEngine, Request, SamplingParams
from kvdrive.runtime.model import load_model

LONG = tuple(range(3, 123))  # 120 tokens: 8 steps of 16
SHORTS = [(7, 8, 9), (40, 41, 42, 43), (100, 101)]


def _engine(path, policy: str, **sched) -> LLMEngine:  # type: ignore[no-untyped-def]
    return tiered_engine(load_model(str(path), progress=False), rows=16, step_tokens=16,
                         scheduler={"policy": policy, **sched})


def _first_token_steps(engine: LLMEngine, late: list[tuple[str, tuple[int, ...]]]) -> tuple[dict[str, int],
                                                                                          dict[str, list[int]]]:
    """Run until idle, adding ``late`` requests after the first step; the step at which each request got
    its first token (counted from the step after they all exist) and every request's tokens."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request(Request("long", LONG, params, 0.0))
    first: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    for o in engine.step():  # the long prompt's first chunk
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    for rid, prompt in late:
        engine.add_request(Request(rid, prompt, params, 0.0))
    for step in range(1, 1000):
        if not engine.has_work():
            break
        for o in engine.step():
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = step
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return first, tokens


def test_short_requests_start_at_once_behind_a_long_prefill(hf_model_factory) -> None:
    path, _ = hf_model_factory(arch="llama", max_position_embeddings=256)
    late = [(f"s{i}", p) for i, p in enumerate(SHORTS)]
    fifo, fifo_tokens = _first_token_steps(_engine(path, "fifo"), late)
    fair, fair_tokens = _first_token_steps(_engine(path, "fair"), late)
    # fifo: the shorts wait for the rest of the long prompt (7 more chunks of 16)
    assert all(fifo[f"s{i}"] >= 7 for i in range(len(SHORTS))), fifo
    # fair: every short request's first token comes at the first step after it arrived
    assert all(fair[f"s{i}"] == 1 for i in range(len(SHORTS))), fair
    # the long prompt is slowed by the shorts' few tokens, not by a factor
    assert fair["long"] <= fifo["long"] + 1, (fair, fifo)
    # and the answers are the same tokens either way (greedy)
    assert fair_tokens == fifo_tokens


def test_a_waiting_request_is_overtaken_at_most_max_bypass_times(hf_model_factory) -> None:
    """One sequence runs at a time; the long prompt waits behind s0, and shorter ones keep coming. It is
    overtaken by exactly ``max_bypass`` of them, then admitted before the rest."""
    path, _ = hf_model_factory(arch="llama", max_position_embeddings=256)
    engine = tiered_engine(load_model(str(path), progress=False), rows=1, step_tokens=16, scheduler={"max_bypass": 2})
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request(Request("s0", (5, 6), params, 0.0))
    engine.add_request(Request("long", LONG, params, 0.0))
    for i in range(1, 5):
        engine.add_request(Request(f"s{i}", (5 + i, 6, 7), params, 0.0))
    order: list[str] = []
    for _ in range(1000):
        if not engine.has_work():
            break
        for o in engine.step():
            if o.finished:
                order.append(o.request_id)
    assert order == ["s0", "s1", "s2", "long", "s3", "s4"]
