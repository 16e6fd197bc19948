"""The transfer engine: priority order, merging and upgrading queued jobs, failed jobs, worker
restarts, prepared promotions and write-backs moving real blocks between tiers, draining."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from kvstore_helpers import BB, LAYOUT, blocks_for, make_keys, read

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


def test_a_queued_job_submitted_again_at_a_higher_priority_jumps_the_queue(store: TieredKVStore) -> None:
    eng = TransferEngine(store, workers=1)
    gate, order = threading.Event(), []
    busy(eng, gate)
    other = eng.submit(lambda: order.append("other"), Priority.PREFETCH)
    wb = eng.submit(lambda: order.append("merged"), Priority.WRITEBACK, dedupe=("job", 1))
    again = eng.submit(lambda: order.append("never"), Priority.DEMAND, dedupe=("job", 1))  # same job
    assert again is wb and eng.upgraded == 1 and eng.queue_depth == 2
    gate.set()
    wb.wait(10)
    other.wait(10)
    assert order == ["merged", "other"]
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


def test_prepared_promotions_run_on_a_worker_and_write_backs_skip_clean_copies(store: TieredKVStore) -> None:
    """The engine thread prepares (slots reserved, sources pinned); a worker copies and publishes."""
    keys = make_keys(6)
    store.put(keys, blocks_for(keys), tier="ssd", persistent=True, needed=False)
    eng = TransferEngine(store, workers=2)
    moves = store.prepare_promote(keys[:3], "dram")
    assert [store.where(k) for k in keys[:3]] == ["ssd"] * 3  # reserved, not yet readable there
    assert eng.run(moves).wait(10) == 3
    out, hit = read(store, keys)
    assert all(hit) and torch.equal(out, blocks_for(keys))
    assert [store.where(k) for k in keys] == ["dram"] * 3 + ["ssd"] * 3
    assert eng.replicate(keys[:3], "ssd").wait(10) == 0  # they already have a clean ssd copy
    assert store.transfer_bytes[("ssd", "dram")] == 3 * BB
    assert eng.drain(10) and eng.queue_depth == 0
    eng.close()
