"""Fault accounting: every fault counted, at most one log line per kind per interval, a degraded window.

A failing disk fails thousands of times; the log must stay readable (one line per fault kind per 10 s,
saying how many more happened), while the counts stay exact for the metrics.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from kvstore_helpers import BB, LAYOUT, blocks_for, make_keys, read
from test_faults_and_backings import FailingIO

from kvdrive.runtime.kvcache.mover import Mover
from kvdrive.runtime.kvcache.placement import TierEviction
from kvdrive.runtime.kvcache.store import BlockStore, TierBudgets
from kvdrive.runtime.kvcache.store.faults import FaultLog
from kvdrive.runtime.kvcache.store.tiers import SsdTier


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_kind_per_interval_and_exact_counts(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    faults = FaultLog(logging.getLogger("test.faults"), "ssd", clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.faults"):
        for i in range(1000):  # 1000 EIOs and 10 CRC failures within 5 s
            clock.now += 0.005
            faults.record("EIO", "read %d failed", i)
            if i % 100 == 0:
                faults.record("crc", "slot %d corrupt", i, level=logging.WARNING)
        assert [r.getMessage() for r in caplog.records] == ["read 0 failed", "slot 0 corrupt"]
        clock.now += 10
        faults.record("EIO", "read %d failed", 1000)
    assert caplog.records[-1].getMessage().startswith("read 1000 failed (+999 more EIO faults in the last 15 s)")
    assert faults.counts == {"EIO": 1001, "crc": 10}


def test_degraded_while_a_fault_is_recent() -> None:
    clock = Clock()
    faults = FaultLog(logging.getLogger("test.faults"), "ssd", clock=clock)
    assert faults.degraded() is None
    faults.record("ENOSPC", "full")
    assert "ENOSPC" in (faults.degraded() or "")
    clock.now += 59
    assert faults.degraded() is not None
    clock.now += 2
    assert faults.degraded() is None  # a minute without faults: healthy again


def test_a_failing_disk_logs_once_and_the_store_reports_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    io = FailingIO()
    ssd = SsdTier(str(tmp_path / "ssd"), BB, 2 << 20, io=io)
    s = BlockStore.build(LAYOUT, TierBudgets(2 * BB, 2 * BB, 2 << 20), TierEviction(), ssd_tier=ssd)
    m = Mover(s)
    keys = make_keys(40)
    m.put(keys, blocks_for(keys), tier="ssd", needed=False)
    assert s.health() == {}
    io.fail_reads = True
    with caplog.at_level(logging.DEBUG):
        for k in keys:  # 40 failing reads, one at a time
            assert read(m, [k])[1] == [False]
    eio_lines = [r for r in caplog.records if "EIO" in r.getMessage()]
    assert len(eio_lines) == 1, [r.getMessage() for r in eio_lines]
    assert ssd.faults["EIO"] == 40
    assert "EIO" in s.health()["ssd"] and s.faults() == {("ssd", "EIO"): 40}
    s.close()
