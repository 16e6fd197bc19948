"""The device tier: one torch pool on the compute device (CUDA when present, else the CPU).

Same code on both: on a CPU-only host the "device" is the CPU and the pool is ordinary torch memory.
"""

from __future__ import annotations

import logging

import torch

from kvdrive.runtime.kvcache.store.budgets import TierName
from kvdrive.runtime.kvcache.store.tiers.memory import MemoryPoolTier

log = logging.getLogger(__name__)


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class DeviceTier(MemoryPoolTier):
    name: TierName = "gpu"

    def __init__(self, block_bytes: int, slots: int, device: torch.device | str | None = None,
                 extra_rows: int = 0) -> None:
        self.device = torch.device(device) if device is not None else default_device()
        self.backing = str(self.device)
        super().__init__(block_bytes, slots, extra_rows)
        log.info("gpu tier on %s: %d slots of %d bytes", self.device, self.allocator.capacity, block_bytes)

    def _new_pool(self, rows: int) -> tuple[torch.Tensor, None]:
        return torch.empty((rows, self.slot_bytes), dtype=torch.uint8, device=self.device), None
