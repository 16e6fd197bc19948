"""The shared tier's moves: a page's blocks from the local tiers to the shared store, and back into them.

The ``Mover``'s part for the shared tier (``store.shared.SharedTier``), the only caller of its ``fetch`` and
``publish``. Pages travel whole (every layer): ``publish`` reads a page's blocks from their fastest local
copies and writes one value; ``fetch`` returns verified pages; ``land`` stores fetched pages as ordinary
stored pages of a local tier (content addressed: a page already there is only touched), where the prefix
lookup finds them. Which pages and which tier is placement's choice; when, the caller's: ``publish`` and
``fetch`` on a transfer worker, ``land`` on the engine thread (the contract's thread rule).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvdrive.runtime.kvcache.mover.mover import Mover
from kvdrive.runtime.kvcache.store.budgets import TierName
from kvdrive.runtime.kvcache.store.keys import BlockKey
from kvdrive.runtime.kvcache.store.shared import SharedTier

CPU = torch.device("cpu")


class SharedMoves:
    def __init__(self, mover: Mover, tier: SharedTier, num_layers: int) -> None:
        self.mover, self.tier, self.num_layers = mover, tier, num_layers

    def keys(self, digests: Sequence[bytes]) -> list[BlockKey]:
        """Every layer's block of each page, page-major."""
        return [BlockKey(d, layer) for d in digests for layer in range(self.num_layers)]

    def publish(self, digests: Sequence[bytes]) -> int:
        """Write the pages of ``digests`` that this replica has not published lately and that every layer of
        is still stored locally; returns how many were written."""
        todo = self.tier.unpublished(digests)
        if not todo:
            return 0
        raw, served = self.mover.fetch(self.keys(todo), CPU, count=False)  # [n * L, block_bytes]
        L = self.num_layers
        pages = [(d, raw[i * L : (i + 1) * L]) for i, d in enumerate(todo)
                 if all(t is not None for t in served[i * L : (i + 1) * L])]
        return self.tier.publish(pages)

    def fetch(self, digests: Sequence[bytes]) -> list[torch.Tensor | None]:
        """Each page's verified blocks [num_layers, block_bytes] uint8, or None (a miss: recompute it)."""
        return self.tier.fetch(digests)

    def land(self, digests: Sequence[bytes], pages: Sequence[torch.Tensor], tier: TierName) -> None:
        """Store fetched pages (blocks [num_layers, block_bytes] each) in the local ``tier``, not needed by any
        sequence yet (the prefix lookup references them). CacheFullError when ``tier`` has no room."""
        if digests:
            self.mover.put(self.keys(digests), torch.cat(list(pages)), tier, needed=False, persistent=True)
