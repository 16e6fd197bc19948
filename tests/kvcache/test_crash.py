"""Crash safety: a child process writing (and freeing) persisted blocks is SIGKILLed at random
moments, 24 times, on the same directory. After every kill the parent reopens the tier: every block
the index returns must read back with a valid CRC and exactly the bytes its key names; a torn block
is never served."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from kvstore_helpers import BB, blocks_for

from kvdrive.runtime.kvcache.store.tiers import SsdTier

HERE = Path(__file__).parent

CHILD = f"""
import random, sys
sys.path.insert(0, {str(HERE)!r})
import torch
from kvstore_helpers import BB, blocks_for, make_keys
from kvdrive.runtime.kvcache.store.tiers import SsdTier
tier = SsdTier(sys.argv[1], BB, 2 << 20, journal_cap=8 << 10)  # tiny journal: frequent compactions
rng = random.Random(int(sys.argv[2]))
used = [s for s, _ in tier.recovered()]
print("ready", flush=True)
while True:
    n = rng.randint(1, 12)
    while tier.allocator.free_count < n:
        s = used.pop(rng.randrange(len(used)))
        tier.discard(s)
        tier.allocator.release(s)
    keys = make_keys(n)
    slots = [tier.allocator.alloc() for _ in range(n)]
    tier.write(slots, blocks_for(keys), keys, [True] * n)
    used.extend(slots)
"""


def test_sigkill_never_serves_a_torn_block(tmp_path: Path) -> None:
    script = tmp_path / "writer.py"
    script.write_text(CHILD)
    store = tmp_path / "ssd"
    rng = random.Random(2024)
    seen_blocks = 0
    for round_ in range(24):
        child = subprocess.Popen([sys.executable, str(script), str(store), str(round_)],
                                 stdout=subprocess.PIPE, cwd=tmp_path)
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.01, 0.25))
        child.send_signal(signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL

        tier = SsdTier(str(store), BB, 2 << 20, journal_cap=8 << 10)
        rec = tier.recovered()
        if rec:
            slots = [s for s, _ in rec]
            out = torch.empty((len(rec), BB), dtype=torch.uint8)
            ok = tier.read(slots, out)
            expected = blocks_for([k for _, k in rec])
            for i in range(len(rec)):
                # a block that reads OK must be exactly its key's bytes; a torn one must read as a miss
                assert not ok[i] or torch.equal(out[i], expected[i]), f"round {round_}: wrong bytes served"
                assert ok[i], f"round {round_}: indexed block {rec[i][1]} failed its CRC"
        seen_blocks += len(rec)
        tier.close()
    assert seen_blocks > 24 * 10  # the children did write between the kills
