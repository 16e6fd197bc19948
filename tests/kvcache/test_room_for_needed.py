"""While the needed blocks are fewer than the tiers' slots, one more needed block always finds room.

Write-through leaves blocks with copies in two tiers (device or DRAM, and the SSD), so the tiers' slots
fill before the needed blocks do. Room is then made by dropping an upper copy whose block is clean below.
Eviction used to pick the same coldest victims on every pass: needed blocks that could neither move (the
tiers below full of needed blocks) nor be dropped (no copy below). The pass never reached the blocks it
could drop, and the store refused a seal with "every block is pinned or needed". In the soak that was a
step undone every ~13 s. This fills stores of random sizes as a server does and checks every seal that
should fit does.
"""

from __future__ import annotations

import random
from pathlib import Path

from kvstore_helpers import BB, LAYOUT, blocks_for, make_keys

from kvdrive.runtime.kvcache.mover import Mover
from kvdrive.runtime.kvcache.placement import TierEviction
from kvdrive.runtime.kvcache.store import BlockStore, CacheFullError, TierBudgets


def test_a_needed_block_fits_while_needed_blocks_are_fewer_than_the_slots(tmp_path: Path) -> None:
    rng = random.Random(1)
    for trial in range(60):
        gpu, dram, ssd = rng.randrange(8, 40), rng.randrange(4, 30), rng.randrange(20, 120)
        store = BlockStore.build(LAYOUT, TierBudgets(gpu * BB, dram * BB, ssd * BB), TierEviction(), ssd_dir=str(tmp_path / f"s{trial}"))
        mover = Mover(store)
        try:
            total = store.capacity_blocks
            sealed = []
            for _ in range(total - 2):  # sealed pages, half written through, some released
                keys = make_keys(1)
                needed = sum(b.needed for b in store.table.blocks.values())
                try:
                    mover.put(keys, blocks_for(keys), "gpu", needed=True, persistent=True)
                except CacheFullError as exc:
                    raise AssertionError(f"trial {trial} (gpu {gpu}, dram {dram}, ssd slots {total - gpu - dram}): "
                                         f"{needed} needed blocks of {total} slots, yet: {exc}") from exc
                if rng.random() < 0.5:
                    mover.replicate(keys, "ssd")
                sealed += keys
                if rng.random() < 0.2:
                    store.set_needed([rng.choice(sealed)], False)
        finally:
            store.close()
