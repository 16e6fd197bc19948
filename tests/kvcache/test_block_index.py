"""The tensor mirror of where blocks sit: writes are recorded and applied in batches, and every reader sees
every write made before its call (the last write to an entry wins)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvdrive.runtime.kvcache.store.block_index import BlockIndex

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_many_placements_reach_the_tables_in_one_batch_and_the_last_write_wins(device: str) -> None:
    idx = BlockIndex(num_layers=3, device=device, capacity=4)
    pids = [idx.acquire(bytes([i])) for i in range(40)]  # grows the tables past their first capacity
    for n, pid in enumerate(pids):
        for layer in range(3):
            idx.place("gpu", pid, layer, slot=3 * n + layer)
    idx.unplace("gpu", pids[5], 1, slot=3 * 5 + 1)  # before any reader: must end -1, not the earlier slot
    idx.place("dram", pids[5], 1, slot=7)
    with _counted_index_puts() as puts:
        gpu, dram = idx.slots("gpu").cpu(), idx.slots("dram").cpu()
    assert len(puts) == 4  # 121 slot writes and 122 owner writes: one indexed write per table
    assert gpu[2, pids[39]] == 3 * 39 + 2 and gpu[0, pids[0]] == 0
    assert gpu[1, pids[5]] == -1 and dram[1, pids[5]] == 7
    assert (gpu[:, idx.scratch] == -1).all()
    with _counted_index_puts() as puts:
        layers, held = idx.residents("gpu")
    assert puts == []  # nothing pending: reading again writes nothing
    assert len(held) == 119 and (pids[5], 1) not in set(zip(held.tolist(), layers.tolist(), strict=True))
    layers, held = idx.residents("dram")
    assert (held.tolist(), layers.tolist()) == ([pids[5]], [1])


@contextlib.contextmanager
def _counted_index_puts() -> Iterator[list[int]]:
    """The ``index_put_`` calls made inside the block (one entry each)."""
    calls: list[int] = []
    real = torch.Tensor.index_put_

    def counted(self: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
        calls.append(1)
        return real(self, *a, **kw)

    torch.Tensor.index_put_ = counted  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        torch.Tensor.index_put_ = real  # type: ignore[method-assign]


def test_the_merged_host_table_follows_both_tiers() -> None:
    idx = BlockIndex(num_layers=2, device="cpu", capacity=8)
    idx.set_dram_base(100)
    a, b = idx.acquire(b"a"), idx.acquire(b"b")
    idx.place("dram", a, 0, slot=5)
    idx.place("gpu", b, 1, slot=2)
    rows = idx.rows()
    assert rows[0, a] == 105 and rows[1, b] == 2 and rows[1, a] == -1
    idx.place("gpu", a, 0, slot=9)  # a device copy is read before the DRAM one
    assert idx.rows()[0, a] == 9
    idx.unplace("gpu", a, 0, slot=9)
    assert idx.rows()[0, a] == 105
    idx.unplace("dram", a, 0, slot=5)
    assert idx.rows()[0, a] == -1


def test_a_freed_page_id_is_reused_with_nothing_of_its_old_placement() -> None:
    idx = BlockIndex(num_layers=2, device="cpu", capacity=8)
    old = idx.acquire(b"old")
    idx.place("gpu", old, 0, slot=3)
    assert idx.slots("gpu")[0, old] == 3
    idx.unplace("gpu", old, 0, slot=3)
    idx.release(old)
    new = idx.acquire(b"new")
    assert new == old and idx.drain_freed() == [old]
    idx.place("dram", new, 1, slot=4)  # recorded after the release's clearing: it stands
    assert idx.slots("gpu")[0, new] == -1 and idx.slots("dram")[1, new] == 4
    assert idx.residents("gpu")[1].numel() == 0
