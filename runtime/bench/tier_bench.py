"""Tier benchmark: read/write bandwidth of the gpu (device), dram and ssd tiers for page batches of
64 KiB .. 4 MiB, beside a raw O_DIRECT read/write of the same slab file in the same run, plus the RSS
cost of a filled DRAM tier. JSON + PNG. ``run_tier_bench`` is what ``kvdrive bench tiers`` calls.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvdrive.runtime.bench.model_bench import rss_bytes
from kvdrive.runtime.kvcache.store import KVLayout
from kvdrive.runtime.kvcache.store.tiers import DeviceTier, DramTier, SsdTier
from kvdrive.runtime.kvcache.store.tiers.aligned import AlignedBuffer
from kvdrive.runtime.kvcache.store.tiers.checksum import CRC32_IMPL, slot_crcs
from kvdrive.runtime.kvcache.store.tiers.memory import MemoryPoolTier
from kvdrive.runtime.kvcache.store.tiers.ssd_io import Piece, PieceRunner, plan

log = logging.getLogger(__name__)

DEMO_LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16, dtype=torch.float16)
BATCHES = (64 << 10, 256 << 10, 1 << 20, 4 << 20)
METHOD = ("ssd reads: rounds of interleaved passes (tier, raw qd1, raw pieces, verified qd1; order alternating), "
          "each pass ~64 MiB of whole batches of the same slab files; ratio = median over rounds of tier / best raw "
          "policy of that round; headline figures use rotating destinations (64 MiB arena); verified qd1 = raw qd1 "
          "plus the per-slot CRC pass, the floor of a checked read (ssd_read_vs_verified_raw)")


def _best(fn: Callable[[], int], repeats: int) -> float:
    """Best bandwidth (bytes/s) over ``repeats`` runs of fn (which returns bytes moved)."""
    return max(_rate(fn) for _ in range(repeats))


def _rate(fn: Callable[[], int]) -> float:
    t = time.perf_counter()
    n = fn()
    return n / (time.perf_counter() - t)


def _memory_tier(tier: MemoryPoolTier, n: int, blocks: torch.Tensor, repeats: int) -> dict[str, float]:
    slots = list(range(n))
    for _ in slots:
        tier.allocator.alloc()
    out = torch.empty_like(blocks)
    w = _best(lambda: (tier.write(slots, blocks, [], []), blocks.numel())[1], repeats)
    r = _best(lambda: (tier.read(slots, out), blocks.numel())[1], repeats)
    return {"read_GBps": r / 1e9, "write_GBps": w / 1e9}


class _SsdReads:
    """Tier reads beside raw O_DIRECT reads of the same slab files, batch for batch.

    Policies (the same for the tier and the raw reads): every pass reads ``batches`` (consecutive slots
    of one slab) in order; ``dest="fixed"`` reads every batch into one aligned buffer (a buffer that is
    never touched by the CPU stays in the host's cache on a virtio disk, which flatters raw reads),
    ``dest="rotating"`` puts batch i at offset i * batch bytes of an aligned 64 MiB arena, as pages land
    in different DRAM-tier slots. Raw baselines: ``qd1`` is one thread, one preadv of the whole batch;
    ``pieces`` is the tier's own plan (same pieces, same thread pool: the caller runs the first piece)
    without checksums. The ratio of a round is tier / max(raw qd1, raw pieces) of that round.
    """

    ARENA = 64 << 20

    def __init__(self, ssd: SsdTier, n: int, batches: list[list[int]], io_threads: int) -> None:
        self.ssd, self.sb, self.n, self.batches = ssd, ssd.slot_bytes, n, batches
        self.nbytes = n * self.sb
        self.arena = AlignedBuffer(max(self.ARENA, self.nbytes))
        self.per_arena = self.arena.nbytes // self.nbytes
        self.fds = [os.open(ssd.slabs.path(i), os.O_RDONLY | os.O_DIRECT) for i in range(len(ssd.slabs.fds))]
        self.pieces = plan(batches[0], ssd.slab_slots, ssd.max_io_slots)  # the tier's plan of every batch
        self.runner = PieceRunner(io_threads)  # a pool like the tier's, with as many threads

    def _at(self, i: int, rotating: bool) -> int:
        return (i % self.per_arena) * self.nbytes if rotating else 0

    def tier(self, rotating: bool) -> int:
        t = self.arena.tensor
        for i, b in enumerate(self.batches):
            o = self._at(i, rotating)
            assert all(self.ssd.read(b, t[o : o + self.nbytes].view(self.n, self.sb)))
        return len(self.batches) * self.nbytes

    def raw_qd1(self, rotating: bool) -> int:
        for i, b in enumerate(self.batches):
            slab, row = divmod(b[0], self.ssd.slab_slots)
            o = self._at(i, rotating)
            os.preadv(self.fds[slab], [self.arena.mv[o : o + self.nbytes]], row * self.sb)
        return len(self.batches) * self.nbytes

    def verified_qd1(self, rotating: bool) -> int:
        """raw_qd1 plus the per-slot CRC pass a verifying reader needs: the floor of any checked read."""
        for i, b in enumerate(self.batches):
            slab, row = divmod(b[0], self.ssd.slab_slots)
            o = self._at(i, rotating)
            os.preadv(self.fds[slab], [self.arena.mv[o : o + self.nbytes]], row * self.sb)
            slot_crcs(self.arena.mv, o, self.n, self.sb)
        return len(self.batches) * self.nbytes

    def raw_pieces(self, rotating: bool) -> int:
        for i, b in enumerate(self.batches):
            slab, row = divmod(b[0], self.ssd.slab_slots)
            o = self._at(i, rotating)

            def piece(pc: Piece, slab: int = slab, row: int = row, o: int = o) -> int:
                assert isinstance(pc.pos, range)
                start, stop = o + pc.pos.start * self.sb, o + pc.pos.stop * self.sb
                return os.preadv(self.fds[slab], [self.arena.mv[start:stop]], (row + pc.pos.start) * self.sb)

            for r in self.runner.run(piece, self.pieces):
                assert not isinstance(r, OSError), r
        return len(self.batches) * self.nbytes

    def measure(self, rotating: bool, rounds: int) -> dict[str, Any]:
        runs: dict[str, list[float]] = {"tier": [], "raw_qd1": [], "raw_pieces": [], "verified_qd1": []}
        fns = {"tier": self.tier, "raw_qd1": self.raw_qd1, "raw_pieces": self.raw_pieces,
               "verified_qd1": self.verified_qd1}
        if len(self.pieces) == 1:  # one piece: the tier's plan is the qd1 read
            del fns["raw_pieces"], runs["raw_pieces"]
        for r in range(rounds):  # interleaved, alternating order: drift and neighbours hit all alike
            for name in (list(fns) if r % 2 == 0 else list(reversed(fns))):
                runs[name].append(_rate(lambda f=fns[name]: f(rotating)) / 1e9)
        raw = [max(v) for v in zip(*(runs[k] for k in runs if k.startswith("raw_")), strict=True)]
        out: dict[str, Any] = {k: {"median_GBps": statistics.median(v), "best_GBps": max(v)} for k, v in runs.items()}
        out["ratio_median"] = statistics.median(t / r for t, r in zip(runs["tier"], raw, strict=True))
        out["ratio_of_bests"] = max(runs["tier"]) / max(raw)
        out["ratio_vs_verified_median"] = statistics.median(
            t / r for t, r in zip(runs["tier"], runs["verified_qd1"], strict=True))
        out["rounds"] = runs
        return out

    def close(self) -> None:
        self.runner.shutdown()
        for fd in self.fds:
            os.close(fd)


def run_tier_bench(ssd_dir: str, out_json: str | None = None, out_png: str | None = None,
                   batch_bytes: Sequence[int] = BATCHES, region_bytes: int = 256 << 20, repeats: int = 3,
                   layout: KVLayout = DEMO_LAYOUT, dram_rss_bytes: int = 128 << 20, rounds: int = 7,
                   pass_bytes: int = 64 << 20, ssd_kwargs: dict[str, Any] | None = None,
                   ssd_factory: Callable[..., SsdTier] = SsdTier) -> dict[str, Any]:
    """Measure every tier; returns (and writes, when paths are given) the JSON result.

    SSD reads: ``rounds`` interleaved rounds of tier / raw passes of about ``pass_bytes`` each, for both
    destination policies (see ``_SsdReads``); medians, bests and the median of the per-round ratios.
    """
    load0 = os.getloadavg()
    bb = layout.block_bytes
    region_slots = region_bytes // bb
    kw = {"io_threads": 4, **(ssd_kwargs or {})}
    ssd = ssd_factory(os.path.join(ssd_dir, "bench-ssd"), bb, region_slots * bb + (16 << 20), **kw)
    assert ssd.allocator.capacity >= region_slots, "budget too small for the region"
    for _ in range(region_slots):
        ssd.allocator.alloc()
    raw_buf = AlignedBuffer(max(batch_bytes) + (1 << 20))
    results: list[dict[str, Any]] = []
    for nominal in batch_bytes:
        n = max(1, nominal // bb)
        nbytes = n * bb
        blocks = torch.randint(0, 256, (n, bb), dtype=torch.uint8)
        batches = [list(range(s, s + n)) for s in range(0, region_slots - n + 1, n)]
        usable = [b for b in batches if b[-1] // ssd.slab_slots == b[0] // ssd.slab_slots]

        def ssd_write(batches: list[list[int]] = usable, blocks: torch.Tensor = blocks) -> int:
            for b in batches:
                ssd.write(b, blocks, [], [False] * len(b))
            return len(batches) * blocks.numel()

        def raw_write(batches: list[list[int]] = usable, nbytes: int = nbytes) -> int:
            for b in batches:
                slab, row = divmod(b[0], ssd.slab_slots)
                os.pwritev(ssd.slabs.fds[slab], [raw_buf.mv[:nbytes]], row * ssd.slot_bytes)
            return len(batches) * nbytes

        row: dict[str, Any] = {"batch_bytes": nbytes, "pages": n}
        row["gpu"] = _memory_tier(DeviceTier(bb, n), n, blocks, repeats)
        row["dram"] = _memory_tier(DramTier(bb, n), n, blocks, repeats)
        row["raw_odirect"] = {"write_GBps": _best(raw_write, repeats) / 1e9}
        row["ssd"] = {"write_GBps": _best(ssd_write, repeats) / 1e9}  # leaves every slot written
        step = max(1, len(usable) * nbytes // pass_bytes)
        reads = _SsdReads(ssd, n, usable[::step], kw["io_threads"])
        try:
            row["ssd_read"] = {d: reads.measure(d == "rotating", rounds) for d in ("fixed", "rotating")}
        finally:
            reads.close()
        rot = row["ssd_read"]["rotating"]
        row["ssd"]["read_GBps"] = rot["tier"]["median_GBps"]
        row["raw_odirect"]["read_GBps"] = max(v["median_GBps"] for k, v in rot.items() if k.startswith("raw_"))
        row["ssd_read_vs_raw"] = rot["ratio_median"]
        row["ssd_read_vs_raw_fixed_dest"] = row["ssd_read"]["fixed"]["ratio_median"]
        row["ssd_read_vs_verified_raw"] = rot["ratio_vs_verified_median"]
        log.info("batch %d bytes: %s", nbytes, {k: v for k, v in row.items() if k != "ssd_read"})
        results.append(row)
    ssd_desc = {"backing": ssd.backing, "checksum": CRC32_IMPL, "io_threads": kw["io_threads"],
                "max_io_bytes": ssd.max_io_slots * ssd.slot_bytes, "slot_bytes": ssd.slot_bytes}
    ssd.close()

    before = rss_bytes()
    dram = DramTier(bb, dram_rss_bytes // bb)
    chunk = 256  # slots written per call
    fill = torch.randint(0, 256, (chunk, bb), dtype=torch.uint8)
    slots = [dram.allocator.alloc() for _ in range(dram.allocator.capacity)]
    for i in range(0, len(slots), chunk):
        part = slots[i : i + chunk]
        dram.write(part, fill[: len(part)], [], [])  # type: ignore[arg-type]
    after = rss_bytes()
    growth = None if before is None or after is None else after - before
    rss = {"dram_budget_bytes": dram_rss_bytes, "rss_growth_bytes": growth,
           "overhead_bytes": None if growth is None else growth - dram_rss_bytes, "backing": dram.backing}
    dram.close()
    report = {"layout": {"block_bytes": bb, "page_size": layout.page_size}, "ssd_backing": ssd_desc["backing"],
              "ssd": ssd_desc, "ssd_dir": ssd_dir, "region_bytes": region_slots * bb, "repeats": repeats,
              "rounds": rounds, "cpus": os.cpu_count(), "loadavg_start": load0, "loadavg_end": os.getloadavg(),
              "method": METHOD, "results": results, "dram_rss": rss}
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
