"""Continuous batching: mixed prefill/decode steps, preemption under a tiny cache, aborts, back-pressure."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from kvdrive.runtime.engine import (
    AsyncEngine,
    EngineConfig,
    LLMEngine,
    ModelRunner,
    PromptTooLongError,
    QueueFullError,
    Request,
    SamplingParams,
    SchedulerConfig,
    TierConfig,
)
from kvdrive.runtime.kvcache.envelope import reserve_bytes
from kvdrive.runtime.model import load_model


def _held_bytes(engine: LLMEngine) -> int:
    """KV bytes the tiers hold for running sequences (cached, reusable pages excluded)."""
    return sum(u.used_bytes - u.cached_bytes for u in engine.runner.cache.usage())


def _engine(path, pages: int, **sched) -> LLMEngine:  # type: ignore[no-untyped-def]
    loaded = load_model(str(path), progress=False)
    gen = ModelRunner(loaded, EngineConfig(page_size=4))
    # the gpu budget holds `pages` sealed pages plus what the running sequences reserve (open pages, step buffers)
    budget = pages * gen.cache.layout.page_bytes + reserve_bytes(gen.cache.layout, EngineConfig(page_size=4))
    gen = ModelRunner(loaded, EngineConfig(page_size=4, tiers=TierConfig(envelope_bytes=budget)))
    return LLMEngine(gen, SchedulerConfig(**sched))


def _run_all(engine: LLMEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not engine.has_work():
            break
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41], [100, 101, 102, 103, 104, 105], [7] * 15]


def _expected(path, n_tokens: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    gen = ModelRunner(load_model(str(path), progress=False), EngineConfig(page_size=4))
    return [list(LLMEngine(gen).generate_tokens(p, SamplingParams(max_tokens=n_tokens, ignore_eos=True))) for p in PROMPTS]


def test_batched_engine_equals_one_by_one_generation(hf_model_factory) -> None:
    path, _ = hf_model_factory(arch="llama")
    engine = _engine(path, pages=64, step_token_budget=5)  # small budget: prompts go in several chunks
    for i, p in enumerate(PROMPTS):
        engine.add_request(Request(f"r{i}", tuple(p), SamplingParams(max_tokens=12, ignore_eos=True), 0.0))
    out = _run_all(engine)
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == _expected(path, 12)
    assert engine.runner.cache.free_pages == engine.runner.cache.num_pages


def test_preemption_under_a_tiny_cache_keeps_outputs_identical(hf_model_factory) -> None:
    """12 pages of 4 tokens cannot hold all four sequences at full length: some are preempted and
    recomputed later, yet every output equals the one generated alone."""
    path, _ = hf_model_factory(arch="llama")
    engine = _engine(path, pages=12)
    for i, p in enumerate(PROMPTS):
        engine.add_request(Request(f"r{i}", tuple(p), SamplingParams(max_tokens=20, ignore_eos=True), 0.0))
    out = _run_all(engine)
    assert engine.stats().preemptions_total > 0
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == _expected(path, 20)
    assert _held_bytes(engine) == 0


def test_sequence_outgrowing_the_cache_ends_with_length(hf_model_factory) -> None:
    path, _ = hf_model_factory(arch="llama")
    engine = _engine(path, pages=3)  # 12 tokens at most
    engine.add_request(Request("r", (1, 2, 3, 4, 5), SamplingParams(max_tokens=50, ignore_eos=True), 0.0))
    out = []
    for _ in range(200):
        out += engine.step()
        if not engine.has_work():
            break
    assert out[-1].finished and out[-1].finish_reason == "length"
    assert 0 < out[-1].completion_tokens < 50


def test_back_pressure_and_impossible_prompts(hf_model_factory) -> None:
    path, _ = hf_model_factory(arch="llama")
    engine = _engine(path, pages=4, max_waiting=1)
    with pytest.raises(PromptTooLongError, match="KV tiers hold at most 19 tokens"):
        engine.add_request(Request("big", tuple(range(20)), SamplingParams(), 0.0))
    engine.add_request(Request("a", (1, 2), SamplingParams(), 0.0))
    with pytest.raises(QueueFullError):
        engine.add_request(Request("b", (1, 2), SamplingParams(), 0.0))


def test_abort_frees_pages_at_once(hf_model_factory) -> None:
    path, _ = hf_model_factory(arch="llama")
    engine = _engine(path, pages=16)
    engine.add_request(Request("a", (1, 2, 3, 4, 5, 6), SamplingParams(max_tokens=30, ignore_eos=True), 0.0))
    engine.step()
    engine.step()
    assert _held_bytes(engine) > 0
    out = engine.abort("a")
    assert out is not None and out.finish_reason == "abort"
    assert _held_bytes(engine) == 0 and not engine.has_work()


async def test_async_engine_streams_concurrent_requests_and_survives_consumer_exit(hf_model_factory) -> None:
    path, _ = hf_model_factory(arch="llama")
    engine = _engine(path, pages=64)
    runner = AsyncEngine(engine)
    runner.start()
    try:
        async def consume(i: int, limit: int | None) -> list[int]:
            toks: list[int] = []
            agen = runner.generate(Request(f"r{i}", tuple(PROMPTS[i]),
                                           SamplingParams(max_tokens=12, ignore_eos=True), time.perf_counter()))
            async for o in agen:
                toks.extend(o.new_token_ids)
                if limit is not None and len(toks) >= limit:
                    break  # the client goes away
            await agen.aclose()
            return toks

        results = await asyncio.gather(*(consume(i, 3 if i == 1 else None) for i in range(4)))
        expected = _expected(path, 12)
        assert results[0] == expected[0] and results[2] == expected[2] and results[3] == expected[3]
        assert results[1] == expected[1][:3]
        for _ in range(50):  # the abort reaches the engine thread between steps
            if _held_bytes(engine) == 0:
                break
            await asyncio.sleep(0.02)
        assert _held_bytes(engine) == 0 and runner.alive
    finally:
        runner.shutdown()


async def test_a_slow_engine_turn_is_logged_with_what_it_did(hf_model_factory, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """A turn over SLOW_TURN_S says where its time went (admin commands, scheduling with prefix loads,
    the forward pass) and what the step fed, so that a stall in kvdrive_engine_step_seconds can be told
    apart from prefill work."""
    import logging

    from kvdrive.runtime.engine import async_engine

    monkeypatch.setattr(async_engine, "SLOW_TURN_S", 0.0)  # every turn counts as slow here
    path, _ = hf_model_factory(arch="llama")
    runner = AsyncEngine(_engine(path, pages=64))
    runner.start()
    try:
        with caplog.at_level(logging.WARNING, logger="kvdrive.runtime.engine.async_engine"):
            agen = runner.generate(Request("r0", tuple(PROMPTS[0]), SamplingParams(max_tokens=4, ignore_eos=True),
                                           time.perf_counter()))
            async for _ in agen:
                pass
        lines = [r.getMessage() for r in caplog.records if "slow engine turn" in r.getMessage()]
        assert len(lines) == 1  # rate-limited: one line per 10 s, however many turns
        assert f"{len(PROMPTS[0])} prompt tokens, 0 decodes" in lines[0] and "forward" in lines[0]
    finally:
        runner.shutdown()


async def test_an_error_outside_the_step_ends_the_running_requests_and_never_the_engine_thread(
        hf_model_factory, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """An abort that raises (a client going away while its pages are released) killed the engine thread
    once in the cluster e2e: /healthz then said 503 and the kubelet restarted the pod. Now the error is
    logged with its traceback, the running requests end with an error, and the thread serves the next."""
    path, _ = hf_model_factory(arch="llama")
    engine = _engine(path, pages=64)
    runner = AsyncEngine(engine)
    runner.start()
    real_abort = engine.abort

    def broken_abort(request_id: str):  # type: ignore[no-untyped-def]
        raise RuntimeError("releasing the pages failed (test)")

    real_step = engine.step

    def slow_step():  # type: ignore[no-untyped-def]
        time.sleep(0.02)  # "long" must still run when the abort arrives (the tiny model steps in ~1 ms)
        return real_step()

    try:
        monkeypatch.setattr(engine, "step", slow_step)
        monkeypatch.setattr(engine, "abort", broken_abort)
        long = runner.generate(Request("long", tuple(PROMPTS[0]), SamplingParams(max_tokens=400, ignore_eos=True),
                                       time.perf_counter()))
        gone = runner.generate(Request("gone", tuple(PROMPTS[1]), SamplingParams(max_tokens=400, ignore_eos=True),
                                       time.perf_counter()))
        with caplog.at_level(logging.ERROR, logger="kvdrive.runtime.engine.async_engine"):
            outs = [await long.__anext__()]  # both run (a request is added when its stream is first read)
            await gone.__anext__()
            await gone.aclose()  # the client goes away: the abort raises on the engine thread
            async def rest() -> list:  # type: ignore[type-arg]
                return [o async for o in long]

            outs += await asyncio.wait_for(rest(), 30)  # a dead engine thread never ends the stream
        _ended_by(outs, runner, caplog, "releasing the pages failed (test)")
        monkeypatch.setattr(engine, "abort", real_abort)
        await _serves_the_next(runner, PROMPTS[2])
    finally:
        runner.shutdown()


async def test_an_error_inside_the_step_ends_the_running_requests_and_the_next_request_runs(
        hf_model_factory, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """A step that raises (a bug, a tier failing in a way nothing handles) goes through the same one handler
    as any other failed turn: the running requests end with an error naming it, the thread lives on."""
    path, _ = hf_model_factory(arch="llama")
    engine = _engine(path, pages=64)
    runner = AsyncEngine(engine)
    runner.start()
    real_step = engine.step
    calls = {"n": 0}

    def failing_step():  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("the forward pass failed (test)")
        return real_step()

    try:
        monkeypatch.setattr(engine, "step", failing_step)
        with caplog.at_level(logging.ERROR, logger="kvdrive.runtime.engine.async_engine"):
            outs = [o async for o in runner.generate(Request("a", tuple(PROMPTS[0]),
                                                             SamplingParams(max_tokens=50, ignore_eos=True),
                                                             time.perf_counter()))]
        _ended_by(outs, runner, caplog, "the forward pass failed (test)")
        await _serves_the_next(runner, PROMPTS[1])
    finally:
        runner.shutdown()


def _ended_by(outs: list, runner: AsyncEngine, caplog, error: str) -> None:  # type: ignore[no-untyped-def,type-arg]
    """The request ended with an error naming ``error``, logged with its traceback; the thread lives on."""
    assert outs[-1].finished and outs[-1].finish_reason == "error"
    assert f"internal engine error: {error}" in (outs[-1].error or "")
    assert runner.alive and runner.step_failures == 1
    assert any("engine turn failed" in r.message and r.exc_info for r in caplog.records)


async def _serves_the_next(runner: AsyncEngine, prompt: list[int]) -> None:
    after = [o async for o in runner.generate(Request("after", tuple(prompt), SamplingParams(max_tokens=5, ignore_eos=True),
                                                      time.perf_counter()))]
    assert sum(len(o.new_token_ids) for o in after) == 5 and after[-1].finish_reason == "length"


async def test_a_release_that_fails_while_ending_the_requests_still_ends_every_one(
        hf_model_factory, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """After a failed step every request is ended; when releasing one's pages raises as well, it is still
    ended (the cluster e2e once saw the engine wedged: a request left behind failed every later turn)."""
    path, _ = hf_model_factory(arch="llama")
    engine = _engine(path, pages=64)
    runner = AsyncEngine(engine)
    runner.start()
    real_step, real_release = engine.step, engine.runner.release
    calls = {"step": 0, "release": 0}

    def failing_step():  # type: ignore[no-untyped-def]
        calls["step"] += 1
        if calls["step"] == 3:
            raise RuntimeError("the forward pass failed (test)")
        return real_step()

    def failing_release(seq_id: int) -> None:
        calls["release"] += 1
        if calls["release"] == 1:
            raise KeyError(seq_id)
        real_release(seq_id)

    try:
        monkeypatch.setattr(engine, "step", failing_step)
        monkeypatch.setattr(engine.runner, "release", failing_release)
        with caplog.at_level(logging.ERROR, logger="kvdrive.runtime.engine.async_engine"):
            outs = [o async for o in runner.generate(Request("a", tuple(PROMPTS[0]),
                                                             SamplingParams(max_tokens=50, ignore_eos=True),
                                                             time.perf_counter()))]
        _ended_by(outs, runner, caplog, "the forward pass failed (test)")
        assert engine.stats().running == 0 and calls["release"] == 1
        await _serves_the_next(runner, PROMPTS[1])
    finally:
        runner.shutdown()
