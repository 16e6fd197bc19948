"""`kvdrive bench tiers`, small: every tier's read and write bandwidth beside raw O_DIRECT on the same slab
files, and the DRAM tier's resident-set cost, written as JSON and a PNG."""

from __future__ import annotations

import json
from pathlib import Path

from kvdrive.runtime.bench.tier_bench import run_tier_bench


def test_the_tier_bench_measures_every_tier_and_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "tiers.json"
    res = run_tier_bench(str(tmp_path / "ssd"), out_json=str(out), out_png=str(tmp_path / "tiers.png"),
                         batch_bytes=(256 << 10,), region_bytes=16 << 20, repeats=1, dram_rss_bytes=8 << 20,
                         rounds=1, pass_bytes=4 << 20)
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert (tmp_path / "tiers.png").stat().st_size > 0
    [row] = res["results"]
    for tier in ("gpu", "dram", "ssd"):
        assert row[tier]["read_GBps"] > 0 and row[tier]["write_GBps"] > 0, tier
    assert row["raw_odirect"]["read_GBps"] > 0 and row["ssd_read_vs_raw"] > 0
    assert res["dram_rss"]["dram_budget_bytes"] == 8 << 20
