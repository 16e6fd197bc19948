"""The SSD index compacts without making anyone wait for its fsyncs: appends switch to the next journal
under the tier's lock, the snapshot is written on a background thread. Writes, reads and frees go on
while a snapshot's fsync is held up, and a crash between the two phases loses no record."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from kvstore_helpers import BB, blocks_for, make_keys

from kvdrive.runtime.kvcache.store.tiers import SsdTier, ssd_index
from kvdrive.runtime.kvcache.store.tiers.ssd import MIN_JOURNAL_CAP, journal_cap_for
from kvdrive.runtime.kvcache.store.tiers.ssd_index import IndexEntry, SsdIndex

GEOMETRY: dict[str, object] = {"block_bytes": BB, "codec": "none", "slot_bytes": BB, "slab_slots": 64}


def _journals(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("journal."))


def test_writes_reads_and_frees_go_on_while_a_snapshot_fsync_is_held_up(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    held, entered = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:  # the snapshot's fsync hangs, as on a saturated drive
        entered.set()
        assert held.wait(60)
        real_fsync(fd)

    tier = SsdTier(str(tmp_path), BB, 4 << 20, journal_cap=4 << 10)  # ~85 records a journal
    monkeypatch.setattr(ssd_index.os, "fsync", slow_fsync)  # from now on: the index's fsyncs hang
    keys = make_keys(120)  # 120 writes and 20 frees: 140 records, the second journal stays under its cap
    slots = [tier.allocator.alloc() for _ in keys]
    done = threading.Event()

    def work() -> None:
        for i in range(0, 120, 10):  # crosses the cap: a compaction starts and its fsync hangs
            tier.write(slots[i : i + 10], blocks_for(keys[i : i + 10]), keys[i : i + 10], [True] * 10)
        out = torch.empty((120, BB), dtype=torch.uint8)
        assert all(tier.read(slots, out)) and torch.equal(out, blocks_for(keys))
        for s in slots[:20]:
            tier.discard(s)
            tier.allocator.release(s)
        done.set()

    worker = threading.Thread(target=work)
    worker.start()
    assert entered.wait(30), "no compaction started"
    worker.join(30)
    assert done.is_set(), "the tier waited for the snapshot's fsync"
    assert len(_journals(tmp_path)) == 2  # the old journal stays until its snapshot is in place
    held.set()
    tier.close()  # waits for the snapshot
    assert len(_journals(tmp_path)) == 1
    again = SsdTier(str(tmp_path), BB, 4 << 20, journal_cap=4 << 10)
    assert dict(again.recovered()) == dict(zip(slots[20:], keys[20:], strict=True))
    out = torch.empty((100, BB), dtype=torch.uint8)
    assert all(again.read(slots[20:], out)) and torch.equal(out, blocks_for(keys[20:]))
    again.close()


def test_a_crash_between_the_phases_loses_no_record(tmp_path: Path) -> None:
    never: list[object] = []  # the background runner that never ran: the process died first
    index = SsdIndex(str(tmp_path), GEOMETRY, journal_cap=2 << 10, background=never.append)  # 42 records
    keys = make_keys(50)
    for slot, key in enumerate(keys):  # the 43rd record switches journals
        assert index.put([(slot, IndexEntry(key, slot))])
    for slot in range(0, 50, 3):
        assert index.delete(slot)
    assert index.flush_deletes()  # the DEL records are out (the tier's index thread does this)
    assert never, "no compaction was started"
    assert len(_journals(tmp_path)) == 2  # switched, no snapshot: the state lives in both journals
    want = dict(index.entries)
    os.close(index._fd)  # killed: nothing else closed or flushed (writes are unbuffered)

    reopened = SsdIndex(str(tmp_path), GEOMETRY, journal_cap=2 << 10)
    assert reopened.entries == want
    assert len(_journals(tmp_path)) == 1  # what it replayed is one snapshot now
    reopened.close()
    assert SsdIndex(str(tmp_path), GEOMETRY, journal_cap=2 << 10).entries == want


def test_a_failing_snapshot_is_retried_and_the_journals_stay_within_their_caps(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    failing = {"on": True}
    real_replace = os.replace

    def replace(src: str, dst: str) -> None:
        if failing["on"]:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    faults: list[str] = []
    index = SsdIndex(str(tmp_path), GEOMETRY, journal_cap=2 << 10, on_fault=lambda exc, what: faults.append(what))
    monkeypatch.setattr(ssd_index.os, "replace", replace)  # from now on: every snapshot fails to go in
    keys = make_keys(200)
    ok = [index.put([(slot, IndexEntry(key, slot))]) for slot, key in enumerate(keys)]
    assert any("snapshot" in f for f in faults)
    assert not all(ok)  # past the caps, appends are refused (blocks stay usable, not persisted)
    total = sum((tmp_path / j).stat().st_size for j in _journals(tmp_path))
    assert total <= 2 * index.journal_cap + ssd_index.REC_BYTES
    failing["on"] = False
    index.compact()  # the retry: a snapshot of the entries as they are now
    assert len(_journals(tmp_path)) == 1
    want = dict(index.entries)
    index.close()
    assert SsdIndex(str(tmp_path), GEOMETRY, journal_cap=2 << 10).entries == want


def test_freeing_a_slot_writes_nothing_until_its_delete_is_flushed_and_a_put_waits_for_it(tmp_path: Path) -> None:
    """``delete`` does no I/O (the store frees SSD slots under its lock): the DEL record is appended by
    ``flush_deletes``, or by the next PUT before its own record, so that a reused slot replays in order. A
    crash before the flush brings the freed block back (its bytes untouched, its CRC still checked)."""
    index = SsdIndex(str(tmp_path), GEOMETRY)
    keys = make_keys(6)
    for slot, key in enumerate(keys[:4]):
        assert index.put([(slot, IndexEntry(key, slot))])
    journal = tmp_path / _journals(tmp_path)[0]
    size = journal.stat().st_size
    assert index.delete(1) and index.delete(2) and not index.delete(9)  # 9 was never indexed
    assert journal.stat().st_size == size and 1 not in index.entries
    assert index.put([(2, IndexEntry(keys[4], 44))])  # slot 2 reused: its DEL goes out first, then the PUT
    os.close(index._fd)  # killed before slot 1's DEL had another chance: it went out with the PUT
    reopened = SsdIndex(str(tmp_path), GEOMETRY)
    assert reopened.entries == {0: IndexEntry(keys[0], 0), 2: IndexEntry(keys[4], 44), 3: IndexEntry(keys[3], 3)}
    assert reopened.delete(3)
    os.close(reopened._fd)  # killed with slot 3's DEL pending
    assert 3 in SsdIndex(str(tmp_path), GEOMETRY).entries


def test_a_read_does_not_wait_for_another_writes_journal_append(tmp_path: Path) -> None:
    """A write's PUT records go to the journal under the tier's index lock, not the lock a read takes: while
    one write's append is held up (a slow disk), a read of other slots completes with the right bytes."""
    tier = SsdTier(str(tmp_path), BB, 4 << 20)
    keys = make_keys(4)
    slots = [tier.allocator.alloc() for _ in keys]
    tier.write(slots[:2], blocks_for(keys[:2]), keys[:2], [True, True])
    assert tier.index is not None
    held, entered = threading.Event(), threading.Event()
    real_append = tier.index._append

    def slow_append(rec: bytes) -> bool:
        entered.set()
        assert held.wait(30)
        return real_append(rec)

    tier.index._append = slow_append  # type: ignore[method-assign]
    writer = threading.Thread(target=tier.write, args=(slots[2:], blocks_for(keys[2:]), keys[2:], [True, True]))
    writer.start()
    try:
        assert entered.wait(10)
        out = torch.empty((2, BB), dtype=torch.uint8)
        reader = threading.Thread(target=lambda: out.copy_(out) if all(tier.read(slots[:2], out)) else None)
        reader.start()
        reader.join(10)
        assert not reader.is_alive(), "the read waited for the other write's journal append"
        assert torch.equal(out, blocks_for(keys[:2]))
    finally:
        held.set()
        writer.join(10)
    tier.close()
    again = SsdTier(str(tmp_path), BB, 4 << 20)
    assert dict(again.recovered()) == dict(zip(slots, keys, strict=True))
    again.close()


def test_the_journal_is_sized_to_the_tier_so_a_pending_snapshot_never_fills_it(tmp_path: Path) -> None:
    # a compaction writes a record per live slot: the journal holds half a snapshot, so what arrives while
    # one is written fits (a fixed 256 KiB filled on a 16 GiB tier under prefill: "journal full")
    big = SsdTier(str(tmp_path / "big"), BB, 256 << 20)  # ~21K slots of 12 KiB
    slots = big.allocator.capacity
    assert big.journal_cap == big.index.journal_cap >= slots * ssd_index.REC_BYTES // 2 - ssd_index.REC_BYTES
    assert big.journal_cap > MIN_JOURNAL_CAP and big.journal_cap % ssd_index.REC_BYTES == 0
    small = SsdTier(str(tmp_path / "small"), BB, 2 << 20)
    assert small.journal_cap == MIN_JOURNAL_CAP  # a small tier keeps the floor
    assert SsdTier(str(tmp_path / "given"), BB, 64 << 20, journal_cap=4 << 10).index.journal_cap == 4 << 10
    # a 16 GiB tier of 16 KiB blocks: ~1M slots; its journal takes > 40 prompts of 8K tokens over 24 layers
    assert journal_cap_for(1 << 20) // ssd_index.REC_BYTES > 40 * 512 * 24
    # a tier of 32K slots: with its snapshot never written, the next journal still takes a quarter of the
    # slots in records after the first one's half (the floor's journals would refuse them past ~11K)
    never: list[object] = []
    (tmp_path / "pending").mkdir()
    cap = journal_cap_for(1 << 15)
    assert cap // ssd_index.REC_BYTES == 1 << 14
    index = SsdIndex(str(tmp_path / "pending"), GEOMETRY, journal_cap=cap, background=never.append)
    keys = make_keys((1 << 14) + (1 << 13))
    assert all(index.put([(slot, IndexEntry(key, slot))]) for slot, key in enumerate(keys))
    assert never and len(_journals(tmp_path / "pending")) == 2  # switched; the snapshot is still pending
    index.close()
    for tier in (big, small):
        tier.close()
