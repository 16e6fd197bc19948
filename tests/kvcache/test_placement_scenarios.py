"""Narrated placement scenarios: attention hotness decides which blocks stay on the device tier.

The placer records the attention mass each block received (a tensor per layer and page id); the store
evicts in the order the placer gives (coldest first). LRU is the contrast.
"""

from __future__ import annotations

from pathlib import Path

import torch
from kvstore_helpers import BB, LAYOUT, blocks_for, make_keys, tiers_of

from kvdrive.runtime.kvcache.contract import CopyPlan
from kvdrive.runtime.kvcache.mover import Mover
from kvdrive.runtime.kvcache.placement import (
    Placer,
    PrefetchLedger,
    PrefetchThrottle,
    TierEviction,
    policy_for,
)
from kvdrive.runtime.kvcache.store import (
    BlockIndex,
    BlockKey,
    BlockStore,
    TierBudgets,
    build_tiers,
    device_tier,
)

BUDGETS = TierBudgets(3 * BB, 3 * BB, 2 << 20)


def _store(tmp_path: Path) -> BlockStore:
    return BlockStore.build(LAYOUT, BUDGETS, TierEviction(), ssd_dir=str(tmp_path / "ssd"))


def _placed(tmp_path: Path) -> tuple[BlockStore, Mover, Placer]:
    """A store evicting in the placer's order, composed as ``KVCache`` composes it."""
    tiers = build_tiers(LAYOUT, BUDGETS, ssd_dir=str(tmp_path / "ssd"))
    index = BlockIndex(LAYOUT.num_layers, device_tier(tiers).device)
    placer = Placer(policy_for("kvdrive"), index, tiers)
    s = BlockStore(LAYOUT, BUDGETS, tiers, placer.eviction, index)
    return s, Mover(s), placer


def _attend(placer: Placer, store: BlockStore, keys: list[BlockKey], masses: list[float]) -> None:
    """One decode step in which ``keys`` (layer 0) received ``masses`` of attention."""
    placer.begin_step(store.drain_freed())
    pids = torch.tensor([store.index.find(k.digest) for k in keys])
    placer.record(pids[None, :], torch.tensor(masses)[None, :])  # layer 0 (the layout's only one)
    placer.end_decode_step()


def test_a_page_that_keeps_receiving_attention_stays_on_the_device_tier(tmp_path: Path) -> None:
    """Three blocks fill the device tier. Block A was stored first but receives attention every step;
    B and C receive none. A new block arrives: the coldest (B) is demoted to DRAM, A stays, although
    plain LRU would have evicted A (the least recently stored)."""
    s, m, placer = _placed(tmp_path)
    a, b, c, d = make_keys(4)
    m.put([a, b, c], blocks_for([a, b, c]))
    for _ in range(5):
        _attend(placer, s, [a], [2.5])
    m.put([d], blocks_for([d]))
    assert [s.where(k) for k in (a, b, c, d)] == ["gpu", "dram", "gpu", "gpu"]

    lru = _store(tmp_path / "lru")
    lru_mover = Mover(lru)
    lru_mover.put([a, b, c], blocks_for([a, b, c]))
    lru_mover.put([d], blocks_for([d]))
    assert lru.where(a) == "dram"  # the contrast: recency alone demotes the attended block


def test_a_page_that_stops_receiving_attention_cools_down_and_is_demoted(tmp_path: Path) -> None:
    """A was hot, then attention moved to B and C; a few steps later A is the coldest and goes first."""
    s, m, placer = _placed(tmp_path)
    a, b, c, d = make_keys(4)
    m.put([a, b, c], blocks_for([a, b, c]))
    _attend(placer, s, [a], [3.0])
    for _ in range(8):
        _attend(placer, s, [b, c], [0.5, 0.5])
    ids = torch.tensor([s.index.find(k.digest) for k in (a, b)])
    score_a, score_b = placer.scores.of(torch.zeros(2, dtype=torch.int64), ids).tolist()
    assert score_a < score_b
    m.put([d], blocks_for([d]))
    assert s.where(a) == "dram" and s.where(b) == "gpu" and s.where(c) == "gpu"


def test_a_hot_block_read_from_the_ssd_is_admitted_over_a_cold_resident(tmp_path: Path) -> None:
    """The device tier is full of blocks nobody attends to; a block read from the SSD that received
    attention is admitted to the device tier (displacing the coldest), an unattended one is not."""
    s, m, placer = _placed(tmp_path)
    residents = make_keys(3)
    m.put(residents, blocks_for(residents))
    hot, cold = make_keys(2)
    m.put([hot, cold], blocks_for([hot, cold]), tier="ssd")
    _attend(placer, s, [hot], [2.0])
    placer.begin_step(s.drain_freed())
    pids = [s.index.find(k.digest) for k in (hot, cold)]
    assert placer.promotion([hot, cold], pids, ["ssd", "ssd"]) == [CopyPlan("gpu", (hot,), (0,)),
                                                                   CopyPlan("dram", (cold,), (1,))]


def test_promotion_puts_a_demoted_hot_block_back_and_keeps_its_lower_copy(tmp_path: Path) -> None:
    s, m, placer = _placed(tmp_path)
    keys = make_keys(5)
    m.put(keys, blocks_for(keys))  # 3 on gpu, 2 demoted to dram
    low = [k for k in keys if s.where(k) == "dram"]
    _attend(placer, s, low, [4.0] * len(low))
    assert m.promote(low, "gpu") == len(low)
    assert all(s.where(k) == "gpu" for k in low)
    assert all("dram" in tiers_of(s, k) for k in low)  # inclusive: the clean copy stays below


def test_prefetch_ledger_classifies_hits_late_and_wasted() -> None:
    class Job:
        def __init__(self, done: bool) -> None:
            self._done = done

        def done(self) -> bool:
            return self._done

        def wait(self, timeout: float | None = None) -> None:
            self._done = True

    a, b, c = make_keys(3)
    ledger = PrefetchLedger()
    ledger.issued([a], Job(True))
    running = Job(False)
    ledger.issued([b], running)
    ledger.issued([c], Job(True))
    assert ledger.claim([b]) == [running]  # the step must wait for b (late)
    ledger.settle({a, b})  # the step attended to a (landed: hit) and b; c was never needed
    assert ledger.counts() == {"hit": 1, "late": 1, "wasted": 1}


def test_prefetch_is_throttled_while_it_is_mostly_wasted_and_resumes_when_it_pays() -> None:
    """Narrated: prediction goes bad (1 block of 4 used), the throttle stops prefetching except every
    8th step (a probe); once probes are used again the estimate recovers and prefetch resumes."""
    throttle = PrefetchThrottle(min_precision=0.5, probe_every=8)
    counts = {"hit": 0, "late": 0, "wasted": 0}
    allowed: list[int] = []
    for step in range(1, 41):
        if throttle.allow(dict(counts), step):
            allowed.append(step)
            counts["hit"] += 1  # outcome of this step's prefetch, seen at the next step
            counts["wasted"] += 3
    assert throttle.precision < 0.5
    assert allowed[:3] == [1, 2, 3]  # a few steps to learn that it does not pay
    later = [s for s in allowed if s > 10]
    assert later and all(s % 8 == 0 for s in later)  # afterwards only probes
    assert throttle.throttled == 40 - len(allowed)
    step = 41
    while throttle.precision < 0.5:  # prediction is good again: every prefetched block is used
        if throttle.allow(dict(counts), step):
            counts["hit"] += 4
        step += 1
    assert step < 41 + 4 * 8  # recovered within a few probes
    assert throttle.allow(dict(counts), step) and throttle.allow(dict(counts), step + 1)


def test_steps_without_prefetch_do_not_move_the_throttle_estimate() -> None:
    throttle = PrefetchThrottle()
    counts = {"hit": 2, "late": 0, "wasted": 8}
    throttle.allow(counts, 1)
    before = throttle.precision
    for step in range(2, 6):  # nothing was prefetched: counts unchanged
        throttle.allow(counts, step)
    assert throttle.precision == before


def test_policies_are_switches_of_one_binary() -> None:
    assert policy_for("kvdrive").prefetch and policy_for("kvdrive").hotness_eviction
    assert not policy_for("lru").prefetch and policy_for("lru").promote_on_read
    assert not policy_for("ondemand").promote_on_read and policy_for("ondemand").sparse
    assert not policy_for("fullfetch").sparse and not policy_for("kvdrive", full_attention=True).sparse


def test_held_pages_grown_inside_a_forward_are_released_after_it(tmp_path: Path) -> None:
    """The page-id space grows while a forward pass (inference mode) ranks blocks; the prompt holding pages is
    released afterwards, outside it, as the engine frees a finished request. (A pod under load failed every
    request with "Inplace update to inference tensor outside InferenceMode" before the held counts were made a
    normal tensor.)"""
    s, _m, placer = _placed(tmp_path)
    placer.hold([1, 2])
    s.index.reserve(4 * s.index.capacity)  # more pages than the held counts cover
    with torch.inference_mode():
        ranked = placer._rank(torch.tensor([0, 0]), torch.tensor([1, 3]))  # grows the held counts here
    assert ranked[0] == torch.inf and ranked[1] != torch.inf
    placer.release([1, 2])  # outside inference mode
    placer.hold([s.index.capacity - 1])  # a page id only the grown counts cover
    assert placer.held_pages == 1
