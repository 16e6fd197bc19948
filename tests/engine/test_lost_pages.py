"""Unreadable KV pages never loop a request forever, and never serve bad data.

A tiny model decodes with a device tier of 4 pages (a step selects up to 8 per layer, of a 100-page
context) and an SSD tier below it, so that every step reads pages from the SSD (a larger device tier
would keep the pages a step keeps selecting, and a dead disk would then go unnoticed). When the SSD tier
turns unreadable (every read fails, as a dying disk would), each lost page preempts the request and it is
recomputed; after MAX_LOST_PAGE_RESTARTS recomputations it ends with a clear error instead of looping
(before: preempted again and again, never finishing, everything queued behind it). A healthy request in
the same engine is unaffected.
"""

from __future__ import annotations

from pathlib import Path

import torch
from enginekit import PAGE, tiered_engine

from kvdrive.runtime.engine import LLMEngine, Request, SamplingParams
from kvdrive.runtime.engine.llm_engine import MAX_LOST_PAGE_RESTARTS
from kvdrive.runtime.model import LoadedModel, load_model


def _engine(loaded: LoadedModel, ssd: Path) -> LLMEngine:
    return tiered_engine(loaded, hot_pages=4, ssd=ssd, token_budget=8 * PAGE)


def test_a_request_whose_pages_stay_unreadable_ends_with_an_error(hf_model_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path, _ = hf_model_factory(arch="llama", max_position_embeddings=4096)
    engine = _engine(load_model(str(path), progress=False), tmp_path / "ssd")
    ssd = engine.runner.cache.store.tiers["ssd"]
    healthy_read = ssd.read
    g = torch.Generator().manual_seed(0)
    prompt = tuple(torch.randint(3, 250, (400,), generator=g).tolist())  # 100 pages: most of them on the ssd
    engine.add_request(Request("doomed", prompt, SamplingParams(max_tokens=40, ignore_eos=True), 0.0))
    reads: list[int] = []

    def counted_read(slots, out):  # type: ignore[no-untyped-def]
        reads.append(len(slots))
        return healthy_read(slots, out)

    ssd.read = counted_read  # type: ignore[method-assign]
    for i in range(30):  # prefill (pages written through to the ssd) and a few decode steps
        engine.step()
        if i == 19:
            reads.clear()
    assert sum(reads) >= 10, f"the scenario needs decode steps that read the ssd, read {reads}"
    ssd.read = lambda slots, out: [False] * len(slots)  # type: ignore[method-assign]  # the disk dies
    outputs = []
    for _ in range(2000):
        if not engine.has_work():
            break
        outputs += engine.step()
    assert not engine.has_work(), "the request is still looping"
    (last,) = [o for o in outputs if o.finished]
    assert last.finish_reason == "error"
    # bounded recomputation: exactly MAX_LOST_PAGE_RESTARTS for lost pages. preemptions_total also counts the
    # preemptions a 4-page device tier may need for room (CI once saw one more), so it is only a lower bound
    assert f"could not be read after {MAX_LOST_PAGE_RESTARTS} recomputations" in (last.error or "")
    assert engine.stats().preemptions_total >= MAX_LOST_PAGE_RESTARTS
    assert engine.stats().running == 0
    # the disk comes back: the engine serves again
    ssd.read = healthy_read  # type: ignore[method-assign]
    engine.add_request(Request("after", prompt[:50], SamplingParams(max_tokens=5, ignore_eos=True), 0.0))
    done = []
    for _ in range(500):
        if not engine.has_work():
            break
        done += [o for o in engine.step() if o.finished]
    assert [o.finish_reason for o in done] == ["length"]
