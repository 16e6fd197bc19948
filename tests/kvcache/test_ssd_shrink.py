"""Shrinking the SSD tier while it is in use: the engine's reads and writes go on beside the shrink.

The server applies a smaller SSD budget off the engine thread (``set_budgets(defer={"ssd"})`` between two
steps, then ``shrink("ssd", ...)`` on another thread). Here a worker thread plays the engine: it keeps
storing new blocks into the SSD tier and reading old ones while the tier shrinks from 2,000 slots to 200.
Nothing it reads is ever wrong, nothing lands at or above the new end, and the survivors read back intact.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import torch
from kvstore_helpers import LAYOUT, blocks_for, make_keys, read

from kvdrive.runtime.kvcache.mover import Mover
from kvdrive.runtime.kvcache.placement import TierEviction
from kvdrive.runtime.kvcache.store import BlockStore, TierBudgets


def test_ssd_shrink_beside_reads_and_writes(tmp_path: Path) -> None:
    s = BlockStore.build(LAYOUT, TierBudgets(0, 0, 2000 * 12288 + (8 << 20)), TierEviction(), ssd_dir=str(tmp_path / "kv"))
    m = Mover(s)
    ssd = s.tiers["ssd"]
    full = ssd.allocator.capacity
    assert full >= 2000
    keys = make_keys(full)
    for i in range(0, full, 250):
        m.put(keys[i : i + 250], blocks_for(keys[i : i + 250]), tier="ssd", needed=False, persistent=True)
    assert ssd.allocator.used == full
    small = ssd.slot_bytes * 200 + (s.budgets.ssd_bytes - full * ssd.slot_bytes)  # ~200 slots (and metadata)
    n = ssd.slots_for_budget(small)
    assert 150 <= n <= 250

    stop = threading.Event()
    seen = {"reads": 0, "hits": 0, "wrong": 0, "writes": 0}
    errors: list[BaseException] = []

    def engine() -> None:  # stores and reads, as decode steps do
        rng = random.Random(1)
        written = list(keys)
        try:
            while not stop.is_set():
                new = make_keys(4)
                m.put(new, blocks_for(new), tier="ssd", needed=False, persistent=True)
                written += new
                seen["writes"] += 4
                probe = rng.sample(written, 16)
                out, hit = read(m, probe)
                seen["reads"] += 16
                seen["hits"] += sum(hit)
                for row, (k, h) in enumerate(zip(probe, hit, strict=True)):
                    if h and not torch.equal(out[row], blocks_for([k])[0]):
                        seen["wrong"] += 1
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=engine)
    worker.start()
    try:
        m.set_budgets(ssd_bytes=small, defer=frozenset({"ssd"}))
        assert s.budgets.ssd_bytes != small and ssd.allocator.capacity == full  # deferred: nothing yet
        m.shrink("ssd", small)
    finally:
        stop.set()
        worker.join(60)
    assert not errors, errors
    assert seen["writes"] > 0 and seen["reads"] > 0 and seen["wrong"] == 0
    assert s.budgets.ssd_bytes == small and ssd.allocator.capacity == n
    assert ssd.allocator.used <= n and not ssd.allocator.used_at_or_above(n)
    left = [k for k in s.table.blocks if "ssd" in s.table.blocks[k].copies]
    out, hit = read(m, left)
    assert all(hit) and torch.equal(out, blocks_for(left))
    s.close()
