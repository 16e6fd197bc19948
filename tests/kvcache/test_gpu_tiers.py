"""GPU-only paths of the KV tiers: the CUDA device tier, pinned (cudaHostRegister) DRAM, SSD reads into
device memory, the KvikIO (cuFile) SSD backend and the whole store on CUDA. Marked ``gpu``; every test
skips cleanly without CUDA (and the KvikIO ones without kvikio). Run them on a GPU machine with
``bench/gpu_check.sh tests`` (or ``pytest -m gpu tests/kvcache``).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from kvstore_helpers import BB, LAYOUT, blocks_for, make_keys, read

from kvdrive.runtime.kvcache.mover import Mover
from kvdrive.runtime.kvcache.placement import TierEviction
from kvdrive.runtime.kvcache.store import BlockStore, TierBudgets
from kvdrive.runtime.kvcache.store.tiers import DeviceTier, DramTier, SsdTier

CUDA = torch.cuda.is_available()
KVIKIO = CUDA and importlib.util.find_spec("kvikio") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]
needs_kvikio = pytest.mark.skipif(not KVIKIO, reason="needs kvikio (extra 'gpu') and a CUDA GPU")


def test_device_tier_lives_on_cuda_and_round_trips() -> None:
    tier = DeviceTier(BB, 3000)
    assert tier.device.type == "cuda" and tier.backing.startswith("cuda") and tier.pool.is_cuda
    keys = make_keys(64)
    slots = [tier.allocator.alloc() for _ in keys][::-1]  # reversed: rows out of order
    host = blocks_for(keys)
    tier.write(slots, host.cuda(), keys, [False] * 64)  # type: ignore[arg-type]
    out = torch.empty((64, BB), dtype=torch.uint8, device="cuda")
    assert all(tier.read(slots, out))  # type: ignore[arg-type]
    assert torch.equal(out.cpu(), host)
    cpu_out = torch.empty((64, BB), dtype=torch.uint8)
    assert all(tier.read(slots, cpu_out)) and torch.equal(cpu_out, host)  # type: ignore[arg-type]
    for slot in slots:
        tier.allocator.release(slot)
    tier.resize(10)  # shrink releases device memory
    assert tier.allocated_bytes == 10 * BB
    tier.close()


def test_dram_tier_is_pinned_with_cuda_host_register() -> None:
    tier = DramTier(BB, 1000)
    assert tier.backing.endswith("+pinned")
    assert tier._handle.pinned and tier.pool.is_pinned()
    keys = make_keys(32)
    slots = [tier.allocator.alloc() for _ in keys]
    tier.write(slots, blocks_for(keys).cuda(), keys, [False] * 32)  # type: ignore[arg-type]
    dev = torch.empty((32, BB), dtype=torch.uint8, device="cuda")
    dev.copy_(tier.pool[:32], non_blocking=True)  # pinned source: an asynchronous DMA
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), blocks_for(keys))
    for slot in slots:
        tier.allocator.release(slot)
    tier.resize(0)  # the pool unregistered (cudaHostUnregister) and dropped
    assert tier.allocated_bytes == 0
    tier.close()


def test_pinning_can_be_turned_off() -> None:
    tier = DramTier(BB, 10, pin=False)
    assert not tier.backing.endswith("+pinned") and not tier._handle.pinned
    tier.close()


def test_posix_ssd_tier_reads_into_device_memory(tmp_path: Path) -> None:
    tier = SsdTier(str(tmp_path), BB, 4 << 20, max_io_bytes=8 * BB)
    keys = make_keys(40)
    slots = [tier.allocator.alloc() for _ in keys]
    tier.write(slots, blocks_for(keys).cuda(), keys, [True] * 40)  # type: ignore[arg-type]
    out = torch.empty((40, BB), dtype=torch.uint8, device="cuda")
    assert all(tier.read(slots, out))  # type: ignore[arg-type]
    assert torch.equal(out.cpu(), blocks_for(keys))
    tier.close()


@needs_kvikio
def test_kvikio_backend_round_trip_restart_and_corruption(tmp_path: Path) -> None:
    """Written and read back through KvikIO; after a restart every block is recovered; a byte flipped on
    disk is caught by its CRC at the next read, and the next restart's check forgets that block."""
    from kvdrive.runtime.kvcache.store.tiers.kvikio_backend import KvikioSsdTier, kvikio_unusable_reason

    assert kvikio_unusable_reason() is None
    tier = KvikioSsdTier(str(tmp_path), BB, 4 << 20)
    assert tier.backing.startswith("kvikio:")
    keys = make_keys(48)
    slots = [tier.allocator.alloc() for _ in keys]
    tier.write(slots, blocks_for(keys).cuda(), keys, [True] * 48)  # type: ignore[arg-type]
    out = torch.empty((48, BB), dtype=torch.uint8, device="cuda")
    assert all(tier.read(slots, out)) and torch.equal(out.cpu(), blocks_for(keys))  # type: ignore[arg-type]
    tier.close()
    again = KvikioSsdTier(str(tmp_path), BB, 4 << 20)
    rec = {k: s for s, k in again.recovered()}
    assert set(rec) == set(keys) and again.forgotten_at_start == 0
    fd = os.open(tmp_path / "slab-00000.kv", os.O_RDWR)  # flip one byte of block 5
    off = rec[keys[5]] * again.slot_bytes + 100  # type: ignore[operator]
    os.pwrite(fd, bytes([os.pread(fd, 1, off)[0] ^ 0xFF]), off)
    os.close(fd)
    ok = again.read([rec[k] for k in keys], out)
    assert ok == [i != 5 for i in range(48)] and again.corrupt == 1
    again.close()
    third = KvikioSsdTier(str(tmp_path), BB, 4 << 20)
    assert {k for _, k in third.recovered()} == set(keys) - {keys[5]} and third.forgotten_at_start == 1
    third.close()


@needs_kvikio
def test_the_store_uses_kvikio_only_when_asked(tmp_path: Path) -> None:
    s = BlockStore.build(LAYOUT, TierBudgets(4 * BB, 4 * BB, 4 << 20), TierEviction(), ssd_dir=str(tmp_path / "posix"))
    assert s.tiers["ssd"].backing.startswith("posix")
    s.close()
    s = BlockStore.build(LAYOUT, TierBudgets(4 * BB, 4 * BB, 4 << 20), TierEviction(), ssd_dir=str(tmp_path / "kv"),
                      ssd_backend="kvikio")
    assert s.tiers["ssd"].backing.startswith("kvikio:")
    s.close()


def test_store_on_cuda_moves_pages_through_all_tiers(tmp_path: Path) -> None:
    s = BlockStore.build(LAYOUT, TierBudgets(4 * BB, 4 * BB, 4 << 20), TierEviction(), ssd_dir=str(tmp_path / "kv"))
    m = Mover(s)
    assert s.device.type == "cuda"
    keys = make_keys(20)  # 4 fit on the gpu, 4 in dram, the rest demoted to the ssd
    m.put(keys, blocks_for(keys).cuda(), needed=False)
    assert {s.where(k) for k in keys} == {"gpu", "dram", "ssd"}
    out, hit = read(m, keys)
    assert all(hit) and out.is_cuda and torch.equal(out.cpu(), blocks_for(keys))
    s.close()
