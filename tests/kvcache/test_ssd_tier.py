"""The SSD tier on the real disk: O_DIRECT round trips, coalescing, budget on disk, persistence,
corruption detection, and the index surviving restarts."""

from __future__ import annotations

import os
import random
import zlib
from pathlib import Path

import torch
from kvstore_helpers import BB, blocks_for, make_keys

from kvdrive.runtime.kvcache.store import BlockKey
from kvdrive.runtime.kvcache.store.tiers import SsdTier
from kvdrive.runtime.kvcache.store.tiers.aligned import AlignedBuffer
from kvdrive.runtime.kvcache.store.tiers.checksum import CRC32_IMPL, slot_crcs
from kvdrive.runtime.kvcache.store.tiers.ssd_io import iovecs, plan


def _fill(tier: SsdTier, n: int, persist: bool = True) -> tuple[list[int], list[BlockKey]]:
    keys = make_keys(n)
    slots = [tier.allocator.alloc() for _ in range(n)]
    assert None not in slots
    tier.write(slots, blocks_for(keys), keys, [persist] * n)  # type: ignore[arg-type]
    return slots, keys  # type: ignore[return-value]


def test_round_trip_uses_o_direct_and_coalesces(tmp_path: Path) -> None:
    tier = SsdTier(str(tmp_path), BB, 4 << 20)
    assert tier.direct and tier.backing.startswith("posix-odirect")
    slots, keys = _fill(tier, 40)
    assert len(tier._pieces(slots)) == 1  # 40 adjacent 12 KiB slots: one call (<= 1 MiB pieces)
    shuffled = random.Random(1).sample(range(40), 40)
    out = torch.empty((40, BB), dtype=torch.uint8)
    ok = tier.read([slots[i] for i in shuffled], out)
    assert all(ok)
    assert torch.equal(out, blocks_for([keys[i] for i in shuffled]))
    assert tier.page_reads == 40 and tier.corrupt == 0
    tier.close()


def test_disk_never_exceeds_budget(tmp_path: Path) -> None:
    budget = 3 << 20
    tier = SsdTier(str(tmp_path), BB, budget, journal_cap=16 << 10)
    cap = tier.allocator.capacity
    assert cap > 100 and tier.disk_bytes <= budget
    for _ in range(6):  # fill, churn through many journal compactions, refill
        slots, _ = _fill(tier, tier.allocator.free_count)
        assert tier.allocator.alloc() is None  # full at the budget
        assert tier.disk_bytes <= budget, tier.disk_bytes
        for s in slots:
            tier.discard(s)
            tier.allocator.release(s)
    assert tier.disk_bytes <= budget
    tier.resize(cap // 2)  # shrinking the budget truncates the slabs
    assert tier.disk_bytes <= budget // 2 + (600 << 10)
    tier.close()


def test_index_survives_restart_and_freed_blocks_stay_gone(tmp_path: Path) -> None:
    tier = SsdTier(str(tmp_path), BB, 4 << 20)
    slots, keys = _fill(tier, 30)
    _fill(tier, 5, persist=False)  # private pages: not persisted
    for s in slots[:10]:
        tier.discard(s)
        tier.allocator.release(s)
    tier.close()
    again = SsdTier(str(tmp_path), BB, 4 << 20)
    rec = dict((k, s) for s, k in again.recovered())
    assert set(rec) == set(keys[10:])
    out = torch.empty((20, BB), dtype=torch.uint8)
    assert all(again.read([rec[k] for k in keys[10:]], out))
    assert torch.equal(out, blocks_for(keys[10:]))
    assert again.allocator.used == 20
    again.close()


def test_layout_change_discards_old_index(tmp_path: Path) -> None:
    tier = SsdTier(str(tmp_path), BB, 4 << 20)
    _fill(tier, 8)
    tier.close()
    other = SsdTier(str(tmp_path), BB // 2, 4 << 20)  # another page geometry
    assert other.recovered() == [] and other.allocator.used == 0
    other.close()


def test_flipped_bytes_are_always_detected(tmp_path: Path) -> None:
    """Flip one random byte in each of 64 stored blocks (in the slab file): 64/64 detected, also after
    a restart; the untouched blocks still read fine."""
    tier = SsdTier(str(tmp_path), BB, 4 << 20)
    slots, keys = _fill(tier, 96)
    rng = random.Random(7)
    victims = set(rng.sample(range(96), 64))
    slab = tmp_path / "slab-00000.kv"
    fd = os.open(slab, os.O_RDWR)
    for i in victims:
        off = slots[i] * tier.slot_bytes + rng.randrange(BB)
        byte = os.pread(fd, 1, off)
        os.pwrite(fd, bytes([byte[0] ^ (1 << rng.randrange(8))]), off)
    os.close(fd)
    for t in (tier, None):
        t = t or SsdTier(str(tmp_path), BB, 4 << 20)
        out = torch.empty((96, BB), dtype=torch.uint8)
        ok = t.read(slots, out)
        assert [not ok[i] for i in victims] == [True] * 64
        assert all(ok[i] for i in range(96) if i not in victims)
        assert t.corrupt == 64
        t.close()


def test_plan_coalesces_runs_and_cuts_at_slabs_and_piece_size() -> None:
    pieces = plan([5, 6, 7, 8, 9, 10], slab_slots=8, max_slots=2)  # one run in batch order
    assert [(p.slab, p.row, list(p.pos)) for p in pieces] == [(0, 5, [0, 1]), (0, 7, [2]), (1, 0, [3, 4]),
                                                              (1, 2, [5])]
    assert all(isinstance(p.pos, range) for p in pieces)
    pieces = plan([9, 3, 4, 8, 2], slab_slots=8, max_slots=4)  # shuffled: sorted runs, batch positions kept
    assert [(p.slab, p.row, list(p.pos)) for p in pieces] == [(0, 2, [4, 1, 2]), (1, 0, [3, 0])]
    mv = memoryview(bytearray(5 * 4))
    assert [len(v) for v in iovecs(mv, [4, 1, 2], 4)] == [4, 8]  # positions 1, 2 merged into one iovec


def test_reads_into_unaligned_and_strided_memory_and_writes_from_aligned(tmp_path: Path) -> None:
    tier = SsdTier(str(tmp_path), BB, 4 << 20, max_io_bytes=4 * BB)  # several pieces per batch
    keys = make_keys(24)
    slots = [tier.allocator.alloc() for _ in keys]
    src = AlignedBuffer(24 * BB).tensor[: 24 * BB].view(24, BB)  # page aligned: written without staging
    src.copy_(blocks_for(keys))
    assert tier._zero_copy(src)
    tier.write(slots, src, keys, [False] * 24)  # type: ignore[arg-type]
    raw = torch.empty(24 * BB + 1, dtype=torch.uint8)
    out = raw[1:].view(24, BB)  # odd address: staged, then each piece copies its rows out
    assert not tier._zero_copy(out)
    order = random.Random(3).sample(range(24), 24)
    assert all(tier.read([slots[i] for i in order], out))  # type: ignore[misc]
    assert torch.equal(out, blocks_for([keys[i] for i in order]))
    tier.close()


def test_checksum_is_zlib_crc32_whichever_implementation() -> None:
    data = memoryview(os.urandom(3 * BB))
    assert slot_crcs(data, 0, 3, BB) == [zlib.crc32(data[i * BB : (i + 1) * BB]) for i in range(3)]
    assert CRC32_IMPL in ("isal", "zlib")


def test_startup_checks_the_index_against_the_slabs(tmp_path: Path) -> None:
    """A deleted slab file is re-created empty at startup: its indexed blocks are forgotten, not trusted
    against zeros (before: one checksum miss per block, found one read at a time). A slab with damaged
    blocks fails its sampled read-back and has every block checked; the damaged ones are forgotten."""
    probe = SsdTier(str(tmp_path / "probe"), BB, 4 << 20)
    slab = 16 * probe.slot_bytes
    probe.close()
    tier = SsdTier(str(tmp_path), BB, 4 << 20, slab_bytes=slab)
    slots, keys = _fill(tier, 64)
    tier.close()
    os.unlink(tmp_path / "slab-00001.kv")  # slots 16..31
    fd = os.open(tmp_path / "slab-00002.kv", os.O_RDWR)
    damaged = [33, 40, 47]
    for s in damaged:
        off = (s - 32) * tier.slot_bytes + 11
        os.pwrite(fd, bytes([os.pread(fd, 1, off)[0] ^ 0xFF]), off)
    os.close(fd)
    again = SsdTier(str(tmp_path), BB, 4 << 20, slab_bytes=slab)
    kept = dict(again.recovered())
    lost = {slots[i] for i in range(16, 32)} | {slots[i] for i in damaged}
    assert set(kept) == {slots[i] for i in range(64)} - lost and again.forgotten_at_start == len(lost)
    out = torch.empty((len(kept), BB), dtype=torch.uint8)
    assert all(again.read(sorted(kept), out))  # every block still trusted reads back clean
    assert torch.equal(out, blocks_for([kept[s] for s in sorted(kept)]))
    again.close()
