"""ModelRunner.generate undoes a step the tiers could not take, as the serving engine does.

A live budget change can leave every slot of a tier pinned or needed for a moment (CacheFullError). The
single-process loop releases the sequence, reopens it with the tokens so far (prefix reuse brings their
pages back) and goes on: the greedy output is the one an undisturbed run gives. A tier that keeps
refusing ends the generation with the error after MAX_UNDONE_STEPS steps in a row, not a loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from kvdrive.runtime.engine import EngineConfig, ModelRunner, SamplingParams, TierConfig
from kvdrive.runtime.engine.model_runner import MAX_UNDONE_STEPS
from kvdrive.runtime.kvcache.store import CacheFullError
from kvdrive.runtime.model import LoadedModel, load_model

PAGE = 4


@pytest.fixture
def tiny(hf_model_factory) -> LoadedModel:  # type: ignore[no-untyped-def]
    path, _ = hf_model_factory(arch="llama", max_position_embeddings=1024)
    return load_model(str(path), progress=False)


def _prompt(n: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(5)).tolist()


def _generator(tiny: LoadedModel, tmp_path: Path, name: str) -> ModelRunner:
    return ModelRunner(tiny, EngineConfig(page_size=PAGE, tiers=TierConfig(ssd_dir=str(tmp_path / name),
                                                                          ssd_bytes=16 << 20)))


class _Refusing:
    """Wraps ModelRunner.decode: raises CacheFullError on the calls numbered in ``refuse`` (1-based)."""

    def __init__(self, gen: ModelRunner, refuse: set[int]) -> None:
        self.decode, self.refuse, self.calls, self.reopened = gen.decode, refuse, 0, 0
        self.open = gen.open_sequence

    def __call__(self, batch: Sequence[tuple[int, int]]) -> torch.Tensor:
        self.calls += 1
        if self.calls in self.refuse:
            raise CacheFullError("gpu tier: no slot: every block is pinned or needed")
        return self.decode(batch)

    def open_sequence(self, prompt: Sequence[int]) -> tuple[int, int]:
        self.reopened += 1
        return self.open(prompt)


def test_a_refused_step_is_undone_and_the_output_is_unchanged(tiny: LoadedModel, tmp_path: Path) -> None:
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = _generator(tiny, tmp_path, "plain")
    expected = list(plain.generate(_prompt(40), params))
    plain.close()

    gen = _generator(tiny, tmp_path, "refused")
    refusing = _Refusing(gen, refuse={5, 6, 11})  # two in a row, then one more later
    gen.decode = refusing  # type: ignore[method-assign]
    gen.open_sequence = refusing.open_sequence  # type: ignore[method-assign]
    out = list(gen.generate(_prompt(40), params))
    assert out == expected
    assert refusing.reopened == 1 + 3  # the first open, then one per undone step
    assert gen.cache.num_sequences == 0  # every reopened sequence was released
    gen.close()


def test_a_tier_that_keeps_refusing_ends_with_the_error(tiny: LoadedModel, tmp_path: Path) -> None:
    gen = _generator(tiny, tmp_path, "full")
    refusing = _Refusing(gen, refuse=set(range(3, 100)))
    gen.decode = refusing  # type: ignore[method-assign]
    out: list[int] = []
    with pytest.raises(CacheFullError, match=f"{MAX_UNDONE_STEPS + 1} steps in a row"):
        for tok in gen.generate(_prompt(40), SamplingParams(max_tokens=16, ignore_eos=True)):
            out.append(tok)
    # the prefill's token and two decodes', then one token per undone step (its reopened prefill gives it)
    assert len(out) == 3 + MAX_UNDONE_STEPS
    assert gen.cache.num_sequences == 0
    gen.close()
