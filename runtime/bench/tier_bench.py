"""Tier benchmark: read/write bandwidth of the gpu (device), dram and ssd tiers for page batches of
64 KiB .. 4 MiB, beside a raw O_DIRECT read/write of the same slab file in the same run, plus the RSS
cost of a filled DRAM tier. JSON + PNG. ``run_tier_bench`` is what ``kvdrive bench tiers`` calls.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvdrive.runtime.kvcache import KVLayout
from kvdrive.runtime.kvcache.tiers import DeviceTier, DramTier, SsdTier
from kvdrive.runtime.kvcache.tiers.aligned import AlignedBuffer
from kvdrive.runtime.kvcache.tiers.memory import ChunkedMemoryTier

log = logging.getLogger(__name__)

DEMO_LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16, dtype=torch.float16)
BATCHES = (64 << 10, 256 << 10, 1 << 20, 4 << 20)


def _best(fn: Callable[[], int], repeats: int) -> float:
    """Best bandwidth (bytes/s) over ``repeats`` runs of fn (which returns bytes moved)."""
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        n = fn()
        best = max(best, n / (time.perf_counter() - t))
    return best


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _memory_tier(tier: ChunkedMemoryTier, n: int, blocks: torch.Tensor, repeats: int) -> dict[str, float]:
    slots = list(range(n))
    for _ in slots:
        tier.allocator.alloc()
    out = torch.empty_like(blocks)
    w = _best(lambda: (tier.write(slots, blocks, [], []), blocks.numel())[1], repeats)
    r = _best(lambda: (tier.read(slots, out), blocks.numel())[1], repeats)
    return {"read_GBps": r / 1e9, "write_GBps": w / 1e9}


def run_tier_bench(ssd_dir: str, out_json: str | None = None, out_png: str | None = None,
                   batch_bytes: Sequence[int] = BATCHES, region_bytes: int = 256 << 20, repeats: int = 3,
                   layout: KVLayout = DEMO_LAYOUT, dram_rss_bytes: int = 128 << 20) -> dict[str, Any]:
    """Measure every tier; returns (and writes, when paths are given) the JSON result."""
    bb = layout.block_bytes
    region_slots = region_bytes // bb
    ssd = SsdTier(os.path.join(ssd_dir, "bench-ssd"), bb, region_slots * bb + (16 << 20), io_threads=4)
    assert ssd.allocator.capacity >= region_slots, "budget too small for the region"
    for _ in range(region_slots):
        ssd.allocator.alloc()
    slab_fd = os.open(os.path.join(ssd.dir, "slab-00000.kv"), os.O_RDWR | os.O_DIRECT)
    raw_buf = AlignedBuffer(max(batch_bytes) + (1 << 20))
    results: list[dict[str, Any]] = []
    for nominal in batch_bytes:
        n = max(1, nominal // bb)
        nbytes = n * bb
        blocks = torch.randint(0, 256, (n, bb), dtype=torch.uint8)
        batches = [list(range(s, s + n)) for s in range(0, region_slots - n + 1, n)]
        usable = [b for b in batches if b[-1] // ssd.slab_slots == b[0] // ssd.slab_slots]
        out_buf = AlignedBuffer(nbytes)  # page-aligned like the DRAM tier's slots: read without a copy
        out = out_buf.tensor[:nbytes].view(n, bb)

        def ssd_write(batches: list[list[int]] = usable, blocks: torch.Tensor = blocks) -> int:
            for b in batches:
                ssd.write(b, blocks, [], [False] * len(b))
            return len(batches) * blocks.numel()

        def ssd_read(batches: list[list[int]] = usable, out: torch.Tensor = out) -> int:
            for b in batches:
                assert all(ssd.read(b, out))
            return len(batches) * out.numel()

        def raw(write: bool, batches: list[list[int]] = usable, nbytes: int = nbytes) -> int:
            view = raw_buf.mv[:nbytes]
            for b in batches:
                slab, row = divmod(b[0], ssd.slab_slots)
                fd = slab_fd if slab == 0 else ssd._fds[slab]
                (os.pwritev if write else os.preadv)(fd, [view], row * ssd.slot_bytes)
            return len(batches) * nbytes

        row: dict[str, Any] = {"batch_bytes": nbytes, "pages": n}
        row["gpu"] = _memory_tier(DeviceTier(bb, n), n, blocks, repeats)
        row["dram"] = _memory_tier(DramTier(bb, n), n, blocks, repeats)
        row["ssd"] = {"write_GBps": _best(ssd_write, repeats) / 1e9}
        r_tier, r_raw = 0.0, 0.0
        for _ in range(repeats):  # interleaved so that both see the same disk state
            r_tier = max(r_tier, _best(ssd_read, 1))
            r_raw = max(r_raw, _best(lambda: raw(False), 1))
        row["ssd"]["read_GBps"] = r_tier / 1e9
        row["raw_odirect"] = {"read_GBps": r_raw / 1e9, "write_GBps": _best(lambda: raw(True), repeats) / 1e9}
        row["ssd_read_vs_raw"] = r_tier / r_raw
        log.info("batch %d bytes: %s", nbytes, row)
        results.append(row)
    os.close(slab_fd)
    ssd.close()

    before = _rss()
    dram = DramTier(bb, dram_rss_bytes // bb)
    fill = torch.randint(0, 256, (dram.chunk_slots, bb), dtype=torch.uint8)
    slots = [dram.allocator.alloc() for _ in range(dram.allocator.capacity)]
    for i in range(0, len(slots), dram.chunk_slots):
        part = slots[i : i + dram.chunk_slots]
        dram.write(part, fill[: len(part)], [], [])  # type: ignore[arg-type]
    rss = {"dram_budget_bytes": dram_rss_bytes, "rss_growth_bytes": _rss() - before,
           "overhead_bytes": _rss() - before - dram_rss_bytes, "backing": dram.backing}
    dram.close()
    report = {"layout": {"block_bytes": bb, "page_size": layout.page_size}, "ssd_backing": ssd.backing,
              "ssd_dir": ssd_dir, "region_bytes": region_slots * bb, "repeats": repeats,
              "results": results, "dram_rss": rss}
    if out_json:
        Path(out_json).write_text(json.dumps(report, indent=2))
    if out_png:
        _plot(report, out_png)
    return report


def _plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    x = [r["batch_bytes"] / 1024 for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, op in zip(axes, ("read", "write"), strict=True):
        for tier in ("gpu", "dram", "ssd", "raw_odirect"):
            ax.plot(x, [r[tier][f"{op}_GBps"] for r in rows], marker="o", label=tier)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (KiB)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{op} bandwidth per tier")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
