"""The cache's budgets while it serves: what each tier may hold, changed live, and what each holds now.

``LiveBudgets`` owns the budgets in force: the device envelope (``--gpu-budget``: the hot tier plus the running
sequences' reserve, split by ``envelope``) and the DRAM and SSD budgets. A change is checked against what the host
has, converted for the store (its device tier gets the envelope's hot part: ``store_budgets``) and applied by the
Mover between steps, on the engine thread, with the transfer workers drained (``set_budgets``); an SSD shrink can
be left to another thread (``shrink_ssd``). It is the envelope's ``HotTier`` (the split moves the hot tier's
budget), and reports each tier's usage with the device tier's counted as the envelope.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import torch

from kvdrive.runtime.kvcache.envelope import Envelope
from kvdrive.runtime.kvcache.mover import Mover, TransferQueue
from kvdrive.runtime.kvcache.store import BlockStore, BudgetError, TierBudgets, TierUsage


def store_budgets(envelope: Envelope, envelope_bytes: int, dram_bytes: int, ssd_bytes: int) -> TierBudgets:
    """The store's tier budgets under ``envelope_bytes``: its device tier is the envelope's hot part."""
    return TierBudgets(hot_bytes=envelope.hot_bytes(envelope_bytes), dram_bytes=dram_bytes, ssd_bytes=ssd_bytes)


class LiveBudgets:
    def __init__(self, envelope: Envelope, store: BlockStore, mover: Mover, transfers: TransferQueue,
                 ssd_dir: str | None, held_bytes: Callable[[], int]) -> None:
        """``held_bytes``: the device bytes the running sequences hold outside the hot tier now (their open
        pages, windows and step buffers)."""
        self.envelope, self.store, self.mover, self.transfers = envelope, store, mover, transfers
        self.ssd_dir = ssd_dir
        self._held = held_bytes
        envelope.bind(self)

    # --- the envelope's split ---------------------------------------------------------------------
    def hot_budget(self) -> int:
        """``HotTier``: the device tier's budget now."""
        return self.store.budgets.hot_bytes

    def resize_hot(self, hot_bytes: int) -> None:
        """``HotTier``: the split moved (``Envelope.set_max_running``): the transfers drained, on this thread."""
        self.transfers.drain()
        self.store.bind_owner()
        self.mover.set_budgets(hot_bytes=hot_bytes)

    # --- budgets ----------------------------------------------------------------------------------
    def set_budgets(self, envelope_bytes: int, dram_bytes: int, ssd_bytes: int, defer_ssd_shrink: bool = False) -> bool:
        """Apply new budgets live (BudgetError, nothing changed, when impossible). Runs between steps on
        the engine thread; in-flight transfers finish first. With ``defer_ssd_shrink`` a smaller SSD budget
        is left to ``shrink_ssd`` (off the engine thread); returns whether one is pending."""
        if "ssd" not in self.store.tiers and ssd_bytes:
            raise BudgetError("the server has no SSD tier (start it with --ssd-dir to use one)")
        for tier, want, limit in (("gpu", envelope_bytes, _memory_limit(self.store.device)),
                                  ("dram", dram_bytes, _memory_limit(torch.device("cpu"))),
                                  ("ssd", ssd_bytes, self._disk_limit())):
            if want > limit:
                raise BudgetError(f"{tier} budget {want} bytes exceeds the {limit} bytes this host has for it")
        b = store_budgets(self.envelope, envelope_bytes, dram_bytes, ssd_bytes)
        if self.envelope.pending is not None and envelope_bytes != self.envelope.envelope_bytes:
            raise BudgetError(f"max_running is still shrinking to {self.envelope.pending} (sequences are "
                              "finishing); change the gpu budget after that")
        self.transfers.drain()
        self.store.bind_owner()
        has_ssd = "ssd" in self.store.tiers
        now = self.mover.set_budgets(b.hot_bytes, b.dram_bytes, b.ssd_bytes if has_ssd else None,
                                     defer=frozenset({"ssd"}) if defer_ssd_shrink else frozenset())
        self.envelope.envelope_bytes = envelope_bytes
        return has_ssd and now.ssd_bytes != b.ssd_bytes

    def shrink_ssd(self, ssd_bytes: int) -> None:
        """The SSD half of ``set_budgets(..., defer_ssd_shrink=True)``: any thread, while the engine steps."""
        self.mover.shrink("ssd", ssd_bytes)

    def _disk_limit(self) -> int:
        return shutil.disk_usage(self.ssd_dir).total if self.ssd_dir else 0

    # --- usage ------------------------------------------------------------------------------------
    def usage(self) -> list[TierUsage]:
        """Each tier's budget, capacity and use; the device tier's as the envelope (the hot tier and the running
        sequences' reserve)."""
        out = []
        reserve = self.envelope.reserve()
        held = self._held()
        for u in self.store.usage():
            if u.tier == "gpu":
                u = TierUsage(u.tier, u.budget_bytes + reserve, u.capacity_bytes + reserve,
                              u.used_bytes + held, u.pages, u.backing, u.page_reads, u.errors,
                              u.cached_bytes)
            out.append(u)
        return out


def _memory_limit(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
