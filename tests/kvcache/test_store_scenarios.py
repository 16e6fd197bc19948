"""Narrated scenarios of the three-tier store: budgets, eviction order by tier, live shrink/grow,
pinning, write visibility, corrupt copies, restart with persisted prefix pages."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from kvstore_helpers import BB, LAYOUT, blocks_for, make_keys, pinned, read, tiers_of

from kvdrive.runtime.kvcache.mover import Mover
from kvdrive.runtime.kvcache.placement import TierEviction
from kvdrive.runtime.kvcache.store import (
    BlockKey,
    BlockStore,
    BudgetError,
    CacheFullError,
    TierBudgets,
)
from kvdrive.runtime.kvcache.store.tiers import PosixIO, SsdTier
from kvdrive.runtime.prompt.digests import chain_digest, root_digest


def store(tmp_path: Path, gpu: int, dram: int, ssd_bytes: int = 2 << 20, **kw: object) -> BlockStore:
    return BlockStore.build(LAYOUT, TierBudgets(gpu * BB, dram * BB, ssd_bytes), TierEviction(), ssd_dir=str(tmp_path / "ssd"), **kw)


def assert_within_budgets(s: BlockStore) -> None:
    for u in s.usage():
        assert u.used_bytes <= u.capacity_bytes <= max(u.budget_bytes, 0)


def test_blocks_flow_down_in_lru_order(tmp_path: Path) -> None:
    """12 blocks into a store with 4 gpu + 4 dram pages: the newest 4 stay on the gpu, the next 4
    were demoted to dram, the oldest 4 went on to the ssd; no tier ever exceeds its budget."""
    s = store(tmp_path, 4, 4)
    m = Mover(s)
    keys = make_keys(12)
    for k in keys:
        m.put([k], blocks_for([k]))
        assert_within_budgets(s)
    assert [s.where(k) for k in keys] == ["ssd"] * 4 + ["dram"] * 4 + ["gpu"] * 4
    # touching the oldest gpu block makes it recent: the next put demotes keys[9] instead
    read(m, [keys[8]])
    m.put(make_keys(1), torch.zeros((1, BB), dtype=torch.uint8))
    assert s.where(keys[8]) == "gpu" and s.where(keys[9]) == "dram"
    out, hit = read(m, keys)
    assert all(hit) and torch.equal(out, blocks_for(keys))
    assert s.counters().transfer_bytes[("gpu", "dram")] >= 5 * BB and s.counters().transfer_bytes[("dram", "ssd")] >= 5 * BB
    reads = {u.tier: u.page_reads for u in s.usage()}
    assert reads == {"gpu": 3 + 1, "dram": 4, "ssd": 5}  # keys[4] went on to the ssd with the last put


def test_live_shrink_demotes_and_grow_adds_room(tmp_path: Path) -> None:
    """Shrink the gpu from 8 to 3 pages and dram from 8 to 2 while holding 10 needed blocks: the
    extra blocks move down (nothing lost), memory follows the budget; growing back adds room."""
    s = store(tmp_path, 8, 8)
    m = Mover(s)
    keys = make_keys(10)
    for k in keys:  # 8 land on the gpu, the 2 oldest are pushed to dram
        m.put([k], blocks_for([k]))
    m.set_budgets(hot_bytes=3 * BB, dram_bytes=2 * BB)
    assert_within_budgets(s)
    where = [s.where(k) for k in keys]
    assert where.count("gpu") == 3 and where.count("dram") == 2 and where.count("ssd") == 5
    assert s.tiers["gpu"].allocated_bytes == 3 * BB  # type: ignore[attr-defined]
    assert s.tiers["dram"].allocated_bytes == 2 * BB  # type: ignore[attr-defined]
    out, hit = read(m, keys)
    assert all(hit) and torch.equal(out, blocks_for(keys))
    m.set_budgets(hot_bytes=16 * BB)
    assert {u.tier: u.capacity_bytes for u in s.usage()}["gpu"] == 16 * BB
    assert m.promote(keys, "gpu") == 7  # 3 were on the gpu already
    assert all(s.where(k) == "gpu" for k in keys)


def test_impossible_shrink_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    s = store(tmp_path, 4, 4, ssd_bytes=0)
    m = Mover(s)
    keys = make_keys(7)
    m.put(keys, blocks_for(keys))
    before = [s.where(k) for k in keys]
    with pytest.raises(BudgetError, match="7 pages needed by running sequences do not fit in 5"):
        m.set_budgets(hot_bytes=2 * BB, dram_bytes=3 * BB)
    assert s.budgets == TierBudgets(4 * BB, 4 * BB, 0) and [s.where(k) for k in keys] == before


def test_bottom_tier_drops_only_recomputable_blocks(tmp_path: Path) -> None:
    """With no ssd, a full store drops blocks nobody needs; needed blocks make the put fail instead."""
    s = BlockStore.build(LAYOUT, TierBudgets(2 * BB, 2 * BB, 0), TierEviction())
    m = Mover(s)
    old = make_keys(4)
    m.put(old, blocks_for(old), needed=False)
    new = make_keys(2)
    m.put(new, blocks_for(new))
    assert sum(s.where(k) is None for k in old) == 2 and s.counters().dropped == 2
    more = make_keys(3)
    with pytest.raises(CacheFullError):
        m.put(more, blocks_for(more))  # 2 recomputable go, the 3rd needed page has nowhere to go
    assert all(s.where(k) for k in new)


def test_pinned_blocks_are_not_evicted_or_shrunk_away(tmp_path: Path) -> None:
    """A new block finds the gpu tier holding only pinned blocks: it goes to the tier below at once (a step
    never waits for the transfers that pinned them); only when no tier can take it does the put fail."""
    s = store(tmp_path, 2, 4)
    m = Mover(s)
    a = make_keys(2)
    m.put(a, blocks_for(a))
    with pinned(s, a):
        b = make_keys(2)
        m.put(b, blocks_for(b), tier="dram")
        c = make_keys(1)
        m.put(c, blocks_for(c))  # the gpu holds only pinned blocks
        assert s.where(c[0]) == "dram" and m.spilled == 1 and torch.equal(read(m, c)[0], blocks_for(c))
        assert [s.where(k) for k in a] == ["gpu", "gpu"]
        with pytest.raises(BudgetError, match="2 pages are pinned"):
            m.set_budgets(hot_bytes=BB)
    m.set_budgets(hot_bytes=BB)
    assert sorted(str(s.where(k)) for k in a) == ["dram", "gpu"]


def test_a_put_with_no_tier_to_take_it_waits_for_the_pins_then_fails(tmp_path: Path) -> None:
    s = BlockStore.build(LAYOUT, TierBudgets(2 * BB, 0, 0), TierEviction())
    m = Mover(s)
    a = make_keys(2)
    m.put(a, blocks_for(a))
    with pinned(s, a):
        with pytest.raises(CacheFullError, match="every block is pinned or needed"):
            m.put(make_keys(1), torch.zeros((1, BB), dtype=torch.uint8), pin_wait_s=0.05)
    assert [s.where(k) for k in a] == ["gpu", "gpu"] and m.spilled == 0


class GatedIO(PosixIO):
    """Blocks inside pwritev / preadv until released, to look inside an I/O in flight."""

    def __init__(self) -> None:
        self.write_gate, self.read_gate = threading.Event(), threading.Event()
        self.write_gate.set()
        self.read_gate.set()
        self.in_write, self.in_read = threading.Event(), threading.Event()

    def pwritev(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        self.in_write.set()
        self.write_gate.wait(10)
        return super().pwritev(fd, bufs, offset)

    def preadv(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        self.in_read.set()
        self.read_gate.wait(10)
        return super().preadv(fd, bufs, offset)


def test_a_block_being_written_is_not_readable(tmp_path: Path) -> None:
    io = GatedIO()
    ssd = SsdTier(str(tmp_path / "ssd"), BB, 2 << 20, io=io)
    s = BlockStore.build(LAYOUT, TierBudgets(2 * BB, 2 * BB, 2 << 20), TierEviction(), ssd_tier=ssd)
    m = Mover(s)
    key = make_keys(1)
    io.write_gate.clear()
    writer = threading.Thread(target=m.put, args=(key, blocks_for(key)), kwargs={"tier": "ssd"})
    writer.start()
    assert io.in_write.wait(10)
    assert s.where(key[0]) is None and read(m, key)[1] == [False]  # mid-write: a miss, never half a block
    io.write_gate.set()
    writer.join()
    out, hit = read(m, key)
    assert hit == [True] and torch.equal(out, blocks_for(key))


def test_a_block_being_read_is_pinned_against_eviction(tmp_path: Path) -> None:
    io = GatedIO()
    ssd = SsdTier(str(tmp_path / "ssd"), BB, 2 << 20, io=io)
    s = BlockStore.build(LAYOUT, TierBudgets(0, 0, 2 << 20), TierEviction(), ssd_tier=ssd)
    m = Mover(s)
    cap = ssd.allocator.capacity
    key = make_keys(1)
    m.put(key, blocks_for(key), tier="ssd", needed=False)
    io.read_gate.clear()
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(read(m, key)))
    reader.start()
    assert io.in_read.wait(10)
    others = make_keys(cap - 1)
    m.put(others, blocks_for(others), tier="ssd", needed=False)  # the tier is now full
    extra = make_keys(1)  # pressure: the ssd must drop a recomputable block, never the pinned one
    m.put(extra, blocks_for(extra), tier="ssd")
    assert s.where(key[0]) == "ssd" and s.counters().dropped == 1
    with pytest.raises(BudgetError):
        m.set_budgets(ssd_bytes=0)
    io.read_gate.set()
    reader.join()
    out, hit = got[0]  # type: ignore[misc]
    assert hit == [True] and torch.equal(out, blocks_for(key))


def test_corrupt_ssd_copy_is_a_miss_and_a_dram_copy_is_used(tmp_path: Path) -> None:
    s = store(tmp_path, 0, 4)
    m = Mover(s)
    keys = make_keys(2)
    m.put(keys, blocks_for(keys), tier="ssd")
    assert m.promote([keys[1]], "dram") == 1 and tiers_of(s, keys[1]) == ["dram", "ssd"]
    ssd = s.tiers["ssd"]
    assert isinstance(ssd, SsdTier)
    for k in keys:  # corrupt both ssd copies on disk
        slot = next(sl for (t, sl), kk in s.table.owner.items() if t == "ssd" and kk == k)
        with open(tmp_path / "ssd" / "slab-00000.kv", "r+b") as f:
            f.seek(slot * ssd.slot_bytes + 100)
            f.write(b"\xff\x00\xff")
    out, hit = read(m, keys)
    assert hit == [False, True] and s.where(keys[0]) is None
    assert torch.equal(out[1], blocks_for(keys[1:])[0])  # dram copy served first
    m.reader.wait_for_scrub()  # the checksum failure started a scrub: it finds keys[1]'s corrupt ssd copy too
    assert ssd.corrupt == 2 and tiers_of(s, keys[1]) == ["dram"] and s.counters().scrubbed == 1
    s.table.drop(s.table.blocks[keys[1]], "dram")
    assert read(m, keys[1:])[1] == [False] and ssd.corrupt == 2  # a miss: nothing corrupt is read again


def prefix_digests(fingerprint: str, tokens: list[int], page: int) -> list[bytes]:
    """The digest of every full page of ``tokens``, chained from the model fingerprint."""
    prev, out = root_digest(fingerprint), []
    for start in range(0, len(tokens) - page + 1, page):
        prev = chain_digest(prev, tokens[start : start + page])
        out.append(prev)
    return out


def test_prefix_pages_survive_a_restart(tmp_path: Path) -> None:
    tokens = list(range(100, 164))
    digests = prefix_digests("smollm2-135m/q4_1", tokens, 16)
    assert len(digests) == 4 and digests == prefix_digests("smollm2-135m/q4_1", tokens + [1, 2], 16)
    assert digests[0] != prefix_digests("other-model", tokens, 16)[0]
    keys = [BlockKey(d, layer) for d in digests for layer in range(LAYOUT.num_layers)]
    s = store(tmp_path, 2, 2)
    m = Mover(s)
    m.put(keys, blocks_for(keys), tier="ssd", persistent=True, needed=False)
    s.close()
    again = store(tmp_path, 2, 2)
    again_mover = Mover(again)
    assert all(again.where(k) == "ssd" for k in keys)
    out, hit = read(again_mover, keys)
    assert all(hit) and torch.equal(out, blocks_for(keys))


def test_a_fetch_across_tiers_returns_key_order_and_the_serving_tier(tmp_path: Path) -> None:
    """Blocks spread over the three tiers, asked for interleaved with a missing one: each row holds its
    key's bytes (a miss is zeros), the tier that served each key is reported, and the buffer is aligned
    (each tier reads its part in place, then one gather restores key order)."""
    s = store(tmp_path, 4, 4)
    m = Mover(s)
    keys = make_keys(12)
    for k in keys:
        m.put([k], blocks_for([k]))
    ask = [keys[0], keys[11], keys[5], keys[1], keys[10], keys[6]]  # ssd, gpu, dram, ssd, gpu, dram
    missing = make_keys(13)[12]
    ask.insert(3, missing)
    out, served = m.fetch(ask)
    assert served == ["ssd", "gpu", "dram", None, "ssd", "gpu", "dram"]
    for row, k in enumerate(ask):
        want = torch.zeros(BB, dtype=torch.uint8) if k == missing else blocks_for([k])[0]
        assert torch.equal(out[row], want)
