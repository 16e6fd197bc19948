"""A step whose pages a tier cannot take is undone, never the end of the batch.

Found by the soak (`bench/soak.py`): right after a live `PUT /admin/tiers` moved bytes between the
tiers, a prompt chunk's seal found every slot of the device tier pinned or needed, raised
``CacheFullError`` in the middle of the forward pass, and the engine ended all 13 running requests
with an error (HTTP 503 and error chunks). Now the step is undone like one that lost a page: its
sequences are preempted and recomputed through prefix reuse, with the same tokens. A tier that stays
full ends the newest request with a clear error after a bounded number of steps, so nothing loops.
"""

from __future__ import annotations

from pathlib import Path

import torch
from enginekit import run_dry, small_engine, submit, tokens

from kvdrive.runtime.engine import Request, SamplingParams
from kvdrive.runtime.engine.llm_engine import MAX_CACHE_FULL_STEPS
from kvdrive.runtime.kvcache.store import CacheFullError
from kvdrive.runtime.model import LoadedModel, load_model


def _engine(loaded: LoadedModel, ssd: Path):  # type: ignore[no-untyped-def]
    return small_engine(loaded, ssd, gpu_pages=24, dram_pages=8, token_budget_pages=8)


def _prompts() -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(3)
    return [tuple(torch.randint(3, 250, (n,), generator=g).tolist()) for n in (90, 60)]


def _submit(engine) -> None:  # type: ignore[no-untyped-def]
    submit(engine, _prompts(), max_tokens=24)


def test_a_step_the_tiers_cannot_take_is_recomputed_with_the_sametokens(hf_model_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path, _ = hf_model_factory(arch="llama", max_position_embeddings=4096)
    loaded = load_model(str(path), progress=False)
    clean = _engine(loaded, tmp_path / "clean")
    _submit(clean)
    want = {rid: tokens(o) for rid, o in run_dry(clean).items()}

    engine = _engine(loaded, tmp_path / "ssd")
    mover = engine.runner.cache.mover
    real_put = mover.put
    puts = {"n": 0}

    def put_with_a_full_tier(*args, **kwargs):  # type: ignore[no-untyped-def]
        puts["n"] += 1
        if puts["n"] in (3, 9):  # two seals (one while both requests run): no slot left for a moment
            raise CacheFullError("gpu tier: no slot for a block: every block is pinned or needed")
        return real_put(*args, **kwargs)

    mover.put = put_with_a_full_tier  # type: ignore[method-assign]
    _submit(engine)
    got = run_dry(engine)
    assert puts["n"] > 9, "the injected failures never happened"
    assert {rid: o[-1].finish_reason for rid, o in got.items()} == {"r0": "length", "r1": "length"}
    assert {rid: tokens(o) for rid, o in got.items()} == want  # recomputed, not corrupted or cut short
    assert engine.stats().preemptions_total >= 2
    assert engine.stats().running == 0


def test_a_tier_that_stays_full_ends_requests_with_an_error_instead_of_looping(hf_model_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path, _ = hf_model_factory(arch="llama", max_position_embeddings=4096)
    engine = _engine(load_model(str(path), progress=False), tmp_path / "ssd")
    mover = engine.runner.cache.mover
    real_put = mover.put

    def no_room(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise CacheFullError("gpu tier: no slot for a block: every block is pinned or needed")

    mover.put = no_room  # type: ignore[method-assign]
    _submit(engine)
    got = run_dry(engine, steps=200)
    assert {rid: o[-1].finish_reason for rid, o in got.items()} == {"r0": "error", "r1": "error"}
    assert all("no room for this request's pages" in (o[-1].error or "") for o in got.values())
    # each ended after a bounded number of undone steps (each undone step preempts at most both)
    assert engine.stats().preemptions_total <= 2 * 2 * (MAX_CACHE_FULL_STEPS + 1)
    mover.put = real_put  # type: ignore[method-assign]  # room again: the engine serves
    engine.add_request(Request("after", _prompts()[1][:20], SamplingParams(max_tokens=5, ignore_eos=True), 9.0))
    assert [o[-1].finish_reason for o in run_dry(engine).values()] == ["length"]


def test_a_request_undone_again_and_again_between_good_steps_ends_instead_of_looping(hf_model_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The soak's livelock: a step fails, its sequences are recomputed (good steps, so never 'in a row'),
    the next step fails again, forever. Each request may be undone MAX_CACHE_FULL_STEPS times; then the
    newest of the failing step ends with an error, and the engine runs dry."""
    path, _ = hf_model_factory(arch="llama", max_position_embeddings=4096)
    engine = _engine(load_model(str(path), progress=False), tmp_path / "ssd")
    mover = engine.runner.cache.mover
    real_put = mover.put
    puts = {"n": 0}

    def full_every_third_put(*args, **kwargs):  # type: ignore[no-untyped-def]
        puts["n"] += 1
        if puts["n"] % 3 == 0:
            raise CacheFullError("gpu tier: no slot for a block: every block is pinned or needed")
        return real_put(*args, **kwargs)

    mover.put = full_every_third_put  # type: ignore[method-assign]
    _submit(engine)
    got = run_dry(engine, steps=3000)  # asserts the engine ran dry
    assert set(got) == {"r0", "r1"} and all(o[-1].finished for o in got.values())
    assert any(o[-1].finish_reason == "error" for o in got.values())
