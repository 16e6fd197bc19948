"""Step pacing: a step carries fewer prompt tokens when steps run slower than their latency target.

Every decode waits for the whole step, so the step's length is each stream's inter-token gap. The pacer
learns what a decode-only step and each prompt token cost and sizes the next step's prompt share to the
target (``SchedulerConfig.step_seconds``, ``--step-seconds``); decodes are never cut, and prefill is slowed,
never stopped.
"""

from __future__ import annotations

import pytest
from enginekit import tiered_engine

from kvdrive.runtime.engine import Request, SamplingParams
from kvdrive.runtime.engine.pacing import StepPacer
from kvdrive.runtime.model import load_model


def test_the_budget_follows_the_measured_cost_of_a_step() -> None:
    pacer = StepPacer(target_s=1.0, max_tokens=512)
    assert pacer.budget(decodes=4) == 512  # nothing measured yet: the fixed budget
    pacer.observe(0.2, prompt_tokens=0)  # a decode-only step: 0.2 s
    pacer.observe(0.2 + 256 * 0.004, prompt_tokens=256)  # 4 ms a prompt token on top
    assert pacer.budget(decodes=4) == 4 + 200  # (1.0 - 0.2) / 0.004 prompt tokens, the decodes on top
    for _ in range(30):  # the machine got twice as slow per prompt token: the budget halves
        pacer.observe(0.2 + 100 * 0.008, prompt_tokens=100)
    assert pacer.budget(decodes=4) == pytest.approx(4 + 100, abs=2)
    pacer.observe(5.0, prompt_tokens=0)  # decodes alone exceed the target: prompts still get their floor
    assert pacer.budget(decodes=4) == 4 + pacer.min_prompt_tokens
    assert pacer.budget(decodes=0) == 512  # no decode waits on the step: prefill at the full budget
    fast = StepPacer(target_s=1.0, max_tokens=512)
    fast.observe(0.01, prompt_tokens=0)
    fast.observe(0.02, prompt_tokens=256)
    assert fast.budget(decodes=4) == 512  # never above the configured budget
    off = StepPacer(target_s=0.0, max_tokens=512)
    off.observe(9.0, prompt_tokens=256)
    assert off.budget(decodes=4) == 512


def _prompt_tokens_per_step(path, step_seconds: float, beside_a_decode: bool = True) -> list[int]:  # type: ignore[no-untyped-def]
    """A 200-token prompt goes in, while a short request decodes (40 tokens) unless not ``beside_a_decode``;
    the prompt tokens of each step."""
    engine = tiered_engine(load_model(str(path), progress=False), rows=16, step_tokens=64,
                           scheduler={"step_seconds": step_seconds})
    if beside_a_decode:
        engine.add_request(Request("chat", (5, 6, 7), SamplingParams(max_tokens=40, ignore_eos=True), 0.0))
        engine.step()  # its prompt; it decodes from the next step on
    engine.add_request(Request("long", tuple(range(3, 203)), SamplingParams(max_tokens=2, ignore_eos=True), 1.0))
    sizes = []
    while engine.has_work():
        engine.step()
        sizes.append(engine.last_step.prompt_tokens)
    return [n for n in sizes if n]


def test_a_slow_engine_feeds_its_prompt_in_smaller_chunks(hf_model_factory) -> None:  # type: ignore[no-untyped-def]
    path, _ = hf_model_factory(arch="llama", max_position_embeddings=256)
    fixed = _prompt_tokens_per_step(path, step_seconds=0.0)
    assert fixed == [63, 63, 63, 11]  # the configured budget less the decode, step after step
    paced = _prompt_tokens_per_step(path, step_seconds=1e-6)  # any step is slower than this target
    assert paced[0] == 63  # nothing measured yet
    assert paced[1:-1] and set(paced[1:-1]) == {16}  # then the floor: slowed, never stopped
    assert sum(paced) == 200
    alone = _prompt_tokens_per_step(path, step_seconds=1e-6, beside_a_decode=False)
    assert alone == [64, 64, 64, 8]  # no decode waits on these steps: the full budget
