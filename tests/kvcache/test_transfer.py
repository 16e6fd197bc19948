"""The transfer engine: priority order, merging and upgrading queued jobs, failed jobs, worker
restarts, and prefetch/fetch moving real blocks between tiers."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from kvstore_helpers import BB, LAYOUT, blocks_for, make_keys

from kvdrive.runtime.kvcache import TierBudgets, TieredKVStore
from kvdrive.runtime.pipeline import Priority, TransferEngine


def busy(eng: TransferEngine, gate: threading.Event) -> None:
    """Occupy the engine's only worker until ``gate`` is set."""
    started = threading.Event()
    eng.submit(lambda: (started.set(), gate.wait(10)), Priority.DEMAND)
    assert started.wait(10)


@pytest.fixture
def store(tmp_path: Path) -> TieredKVStore:
    return TieredKVStore(LAYOUT, TierBudgets(8 * BB, 8 * BB, 2 << 20), ssd_dir=str(tmp_path / "ssd"))


def test_demand_before_prefetch_before_writeback(store: TieredKVStore) -> None:
    eng = TransferEngine(store, workers=1)
    gate, order = threading.Event(), []
    busy(eng, gate)
    handles = [eng.submit(lambda p=p: order.append(p), p)
               for p in (Priority.WRITEBACK, Priority.PREFETCH, Priority.WRITEBACK, Priority.DEMAND)]
    gate.set()
    for h in handles:
        h.wait(10)
    assert order == [Priority.DEMAND, Priority.PREFETCH, Priority.WRITEBACK, Priority.WRITEBACK]
    assert eng.completed == {"DEMAND": 2, "PREFETCH": 1, "WRITEBACK": 2}
    eng.close()


def test_a_queued_prefetch_becomes_urgent(store: TieredKVStore) -> None:
    keys = make_keys(3)
    store.put(keys, blocks_for(keys), tier="ssd")
    eng = TransferEngine(store, workers=1)
    gate = threading.Event()
    busy(eng, gate)
    other = eng.prefetch(keys[:1])
    pre = eng.prefetch(keys[1:])
    again = eng.move(keys[1:], "gpu", Priority.DEMAND)  # same job: merged, jumps ahead of `other`
    assert again is pre and eng.upgraded == 1 and eng.queue_depth == 2
    gate.set()
    assert pre.wait(10) == [True, True] and other.wait(10) == [True]
    assert all(store.where(k) == "gpu" for k in keys)
    eng.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_failed_jobs_complete_with_the_error_and_workers_survive(store: TieredKVStore) -> None:
    eng = TransferEngine(store, workers=1)

    def boom() -> None:
        raise OSError(5, "simulated EIO")

    with pytest.raises(OSError, match="simulated EIO"):
        eng.submit(boom, Priority.PREFETCH).wait(10)
    assert eng.failed["PREFETCH"] == 1

    def die() -> None:
        raise SystemExit  # not an Exception: kills the worker thread
    eng.submit(die, Priority.WRITEBACK)
    eng._threads[0].join(10)
    assert not eng._threads[0].is_alive()
    assert eng.submit(lambda: 42, Priority.DEMAND).wait(10) == 42  # replaced on submit
    assert eng.worker_restarts == 1
    eng.close()


def test_prefetch_then_fetch_moves_real_blocks(store: TieredKVStore) -> None:
    keys = make_keys(6)
    store.put(keys, blocks_for(keys), tier="ssd", persistent=True, needed=False)
    eng = TransferEngine(store, workers=2)
    assert eng.prefetch(keys[:3], "dram").wait(10) == [True] * 3
    blocks, hit = eng.fetch(keys).wait(10)
    assert hit == [True] * 6 and torch.equal(blocks, blocks_for(keys))
    assert [store.where(k) for k in keys] == ["dram"] * 3 + ["ssd"] * 3
    assert eng.write_back(keys[:3], "ssd").wait(10) == [True] * 3  # already has a clean ssd copy
    assert store.transfer_bytes[("ssd", "dram")] == 3 * BB
    eng.close()
