"""The tuning benchmark's report: per-phase table, the tuner against the best static split, and the plot.

Owns the judgement, from a saved report (``render``): for each phase the best static split's decode
tokens/s, the tuned run's share of it, the intervals the tuner took to make its last change in the phase
and to first run at 90% of the best static split; overall tokens/s of every run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _reach(rows: list[dict[str, Any]], target: float) -> int | None:
    """1-based interval of a phase from which the tuned run runs at ``target`` tokens/s (that interval and
    the phase's rest on average), or None."""
    values = [r["tokens_per_s"] for r in rows if r["tokens_per_s"] is not None]
    for k in range(len(values)):
        if values[k] >= target and sum(values[k:]) / len(values[k:]) >= target:
            return k + 1
    return None


def analyse(report: dict[str, Any]) -> dict[str, Any]:
    runs = report["runs"]
    static = [r for r in runs if not r["tuned"]]
    tuned = next(r for r in runs if r["tuned"])
    out: dict[str, Any] = {"phases": [], "overall": {r["name"]: r["overall_tokens_per_s"] for r in runs}}
    for i, phase in enumerate(tuned["phases"]):
        best = max(static, key=lambda r: r["phases"][i]["decode_tokens_per_s"])
        best_tps = best["phases"][i]["decode_tokens_per_s"]
        key = f"{i}:{phase['phase']}"
        rows = [r for r in tuned["timeline"] if r["phase"] == key]
        first = rows[0]["interval"] if rows else 0
        moved = [c["interval"] for c in tuned["changes"] if c["applied"] and c["phase"] == key]
        out["phases"].append({
            "phase": key, "best_static": best["name"], "best_static_tokens_per_s": best_tps,
            "tuned_tokens_per_s": phase["decode_tokens_per_s"],
            "tuned_share_of_best": round(phase["decode_tokens_per_s"] / best_tps, 3) if best_tps else None,
            "intervals_to_last_change": (max(moved) - first + 1) if moved else 0,
            "intervals_to_90pct_of_best": _reach(rows, 0.9 * best_tps),
            "tuned_max_running_end": phase["max_running_end"],
        })
    best_static = max(static, key=lambda r: r["overall_tokens_per_s"])
    out["best_static_overall"] = best_static["name"]
    out["tuned_vs_best_static_overall"] = round(tuned["overall_tokens_per_s"] / best_static["overall_tokens_per_s"], 3)
    return out


def markdown(report: dict[str, Any], verdict: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = [
        "# Tier tuning: one device envelope, split live (issue 18)", "",
        f"Demo model on this host's CPU; envelope (--gpu-budget) {cfg['envelope_mib']} MiB, DRAM "
        f"{cfg['dram_mib']} MiB, SSD {cfg['ssd_mib']} MiB, --max-sequences {cfg['max_sequences']}, phases "
        f"{' / '.join(cfg['phases'])}, {cfg['phase_seconds']:.0f} s each; tuning interval {cfg['interval']} s, "
        f"window {cfg['window']}. Regenerate: `.venv/bin/python bench/tuning_bench.py`.", "",
        "| run | phase | decode tok/s | TTFT p50 (s) | TTFT p99 (s) | requests | hit gpu / dram / ssd / miss "
        "| mean queue | fetch wait | max_running at end |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["runs"]:
        for i, ph in enumerate(r["phases"]):
            h = ph["hit_rate"]
            lines.append(f"| {r['name']} | {i}:{ph['phase']} | {ph['decode_tokens_per_s']} | {ph['ttft_p50_s']} | "
                         f"{ph['ttft_p99_s']} | {ph['requests']} | {h['gpu']:.0%} / {h['dram']:.0%} / {h['ssd']:.0%} "
                         f"/ {h['miss']:.0%} | {ph['mean_queue']} | {ph['fetch_wait_share']} | "
                         f"{ph['max_running_end']} |")
    lines += ["", "| run | overall decode tok/s |", "| --- | --- |"]
    lines += [f"| {name} | {tps} |" for name, tps in verdict["overall"].items()]
    lines += ["", "| phase | best static | its tok/s | tuned tok/s | tuned / best | intervals to last change "
              "| intervals to 90% of best | tuned max_running |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for v in verdict["phases"]:
        lines.append(f"| {v['phase']} | {v['best_static']} | {v['best_static_tokens_per_s']} | {v['tuned_tokens_per_s']} "
                     f"| {v['tuned_share_of_best']} | {v['intervals_to_last_change']} | "
                     f"{v['intervals_to_90pct_of_best'] or 'never'} | {v['tuned_max_running_end']} |")
    lines += ["", f"Tuned overall / best static overall ({verdict['best_static_overall']}): "
              f"**{verdict['tuned_vs_best_static_overall']}x**.", ""]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
    for r in report["runs"]:
        rows = [x for x in r["timeline"] if x["tokens_per_s"] is not None]
        xs = [x["interval"] for x in rows]
        style = "-" if r["tuned"] else ":"
        top.plot(xs, [x["tokens_per_s"] for x in rows], style, label=f"{r['name']} ({r['overall_tokens_per_s']} tok/s)")
        if r["tuned"]:
            bottom.step(xs, [x["max_running"] for x in rows], where="post", label="tuned max_running")
            bottom.plot(xs, [x["hot_mib"] for x in rows], "--", label="tuned hot tier (MiB)")
    top.set_ylabel("decode tokens/s (per interval)")
    top.set_title("static splits vs the tuner, phases " + " / ".join(report["config"]["phases"]))
    top.legend(fontsize=8)
    bottom.set_xlabel(f"interval ({report['config']['interval']} s)")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def render(report: dict[str, Any], out: Path) -> str:
    verdict = analyse(report)
    report["verdict"] = verdict
    out.write_text(json.dumps(report, indent=2))
    text = markdown(report, verdict)
    out.with_suffix(".md").write_text(text)
    plot(report, out.with_suffix(".png"))
    return text


if __name__ == "__main__":
    path = Path(sys.argv[1])
    print(render(json.loads(path.read_text()), path))
