"""The transfer engine: priority order, merging queued write-backs, failed jobs, worker
restarts, prepared promotions and write-backs moving real blocks between tiers, draining."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from kvstore_helpers import BB, LAYOUT, blocks_for, make_keys, read

from kvdrive.runtime.kvcache.mover import Mover, Priority, TransferQueue
from kvdrive.runtime.kvcache.placement import TierEviction
from kvdrive.runtime.kvcache.store import BlockStore, TierBudgets


def busy(eng: TransferQueue, gate: threading.Event) -> None:
    """Occupy the engine's only worker until ``gate`` is set."""
    started = threading.Event()
    eng.submit(lambda: (started.set(), gate.wait(10)), Priority.PREFETCH)
    assert started.wait(10)


@pytest.fixture
def mover(tmp_path: Path) -> Mover:
    return Mover(BlockStore.build(LAYOUT, TierBudgets(8 * BB, 8 * BB, 2 << 20), TierEviction(), ssd_dir=str(tmp_path / "ssd")))


def test_prefetch_before_writeback_fifo_within_each(mover: Mover) -> None:
    eng = TransferQueue(mover, workers=1)
    gate, order = threading.Event(), []
    busy(eng, gate)
    jobs = [(Priority.WRITEBACK, "w1"), (Priority.PREFETCH, "p1"), (Priority.WRITEBACK, "w2"), (Priority.PREFETCH, "p2")]
    handles = [eng.submit(lambda n=n: order.append(n), p) for p, n in jobs]
    gate.set()
    for h in handles:
        h.wait(10)
    assert order == ["p1", "p2", "w1", "w2"]
    assert eng.completed == {"PREFETCH": 3, "WRITEBACK": 2}
    eng.close()


def test_a_queued_job_submitted_again_is_merged_into_it(mover: Mover) -> None:
    eng = TransferQueue(mover, workers=1)
    gate, order = threading.Event(), []
    busy(eng, gate)
    wb = eng.submit(lambda: order.append("queued"), Priority.WRITEBACK, dedupe=("job", 1))
    again = eng.submit(lambda: order.append("never"), Priority.WRITEBACK, dedupe=("job", 1))  # same job
    other = eng.submit(lambda: order.append("other"), Priority.WRITEBACK, dedupe=("job", 2))
    assert again is wb and other is not wb
    gate.set()
    wb.wait(10)
    other.wait(10)
    assert order == ["queued", "other"]
    assert eng.submitted["WRITEBACK"] == 2
    eng.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_failed_jobs_complete_with_the_error_and_workers_survive(mover: Mover) -> None:
    eng = TransferQueue(mover, workers=1)

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
    assert eng.submit(lambda: 42, Priority.PREFETCH).wait(10) == 42  # replaced on submit
    assert eng.worker_restarts == 1
    eng.close()


def test_prepared_promotions_run_on_a_worker_and_write_backs_skip_clean_copies(mover: Mover) -> None:
    """The engine thread prepares (slots reserved, sources pinned); a worker copies and publishes."""
    keys = make_keys(6)
    mover.put(keys, blocks_for(keys), tier="ssd", persistent=True, needed=False)
    eng = TransferQueue(mover, workers=2)
    moves = mover.prepare_promote(keys[:3], "dram")
    assert [mover.store.where(k) for k in keys[:3]] == ["ssd"] * 3  # reserved, not yet readable there
    assert eng.run(moves).wait(10) == 3
    out, hit = read(mover, keys)
    assert all(hit) and torch.equal(out, blocks_for(keys))
    assert [mover.store.where(k) for k in keys] == ["dram"] * 3 + ["ssd"] * 3
    assert eng.replicate(keys[:3], "ssd").wait(10) == 0  # they already have a clean ssd copy
    assert mover.store.counters().transfer_bytes[("ssd", "dram")] == 3 * BB
    assert eng.drain(10) and eng.completed["WRITEBACK"] == 1
    eng.close()
