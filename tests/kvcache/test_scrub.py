"""One checksum failure scrubs the whole SSD tier: every other corrupt copy is dropped at once.

Half the SSD tier's slots get a flipped byte on disk (every other slot, as a failing disk region might).
The first read that meets one reports a miss for it, as always; the scrub it starts then drops every other
corrupt copy, so later reads see clean misses (recompute) instead of one checksum failure each, found one
decode step at a time. Healthy copies are untouched.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from kvstore_helpers import LAYOUT, blocks_for, make_keys, read, tiers_of

from kvdrive.runtime.kvcache.mover import Mover
from kvdrive.runtime.kvcache.placement import TierEviction
from kvdrive.runtime.kvcache.store import BlockStore
from kvdrive.runtime.kvcache.store.budgets import TierBudgets


def test_a_checksum_failure_scrubs_the_tier_and_drops_every_corrupt_copy(tmp_path: Path) -> None:
    store = BlockStore.build(LAYOUT, TierBudgets(0, 0, 4 << 20), TierEviction(), ssd_dir=str(tmp_path / "kv"), device=torch.device("cpu"))
    mover = Mover(store)
    keys = make_keys(64)
    mover.put(keys, blocks_for(keys), "ssd", needed=False, persistent=True)
    tier = store.tiers["ssd"]
    slot = {k: store.table.blocks[k].copies["ssd"].slot for k in keys}
    bad = set(keys[::2])
    fd = os.open(tmp_path / "kv" / "slab-00000.kv", os.O_RDWR)
    for k in bad:
        off = slot[k] * tier.slot_bytes + 7
        os.pwrite(fd, bytes([os.pread(fd, 1, off)[0] ^ 0x5A]), off)
    os.close(fd)

    out, found = read(mover, [keys[0]])  # the first corrupt block met by a read: a miss, and a scrub
    assert found == [False]
    mover.reader.wait_for_scrub(30)
    assert store.counters().scrubbed == len(bad) - 1  # all the others, in one pass
    assert all(tiers_of(store, k) == [] for k in bad)
    out, found = read(mover, keys)
    assert found == [k not in bad for k in keys]
    good = [i for i, k in enumerate(keys) if k not in bad]
    assert torch.equal(out[good], blocks_for([keys[i] for i in good]))
    assert tier.corrupt == len(bad)  # each corrupt copy failed its checksum exactly once
    store.close()
