"""The serving benchmark's report (``serving_bench``): per (workload, concurrency) each leg's figures over the
rounds (median, and the spread of output tokens/s), each leg's same-round ratio against every other leg's, a
Markdown table and a PNG."""

from __future__ import annotations

import statistics
from typing import Any

from kvdrive.runtime.bench.serving_bench import WORKLOADS, Cell, ServingResult

FIGURES = ("output_tps", "prompt_tps", "request_ps", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99",
           "peak_rss_mib", "preemptions")


def _groups(res: ServingResult) -> dict[tuple[str, int], dict[str, list[Cell]]]:
    out: dict[tuple[str, int], dict[str, list[Cell]]] = {}
    for c in res.cells:
        out.setdefault((c.workload, c.concurrency), {}).setdefault(c.leg, []).append(c)
    return out


def summary(res: ServingResult) -> list[dict[str, Any]]:
    """Per (workload, concurrency, leg): the median of each figure over the rounds, the output tokens/s range,
    and the ratio of output tokens/s to each other leg's in the same rounds (median over rounds)."""
    rows = []
    for (w, conc), legs in _groups(res).items():
        for leg, cells in legs.items():
            row: dict[str, Any] = {"workload": w, "concurrency": conc, "leg": leg, "rounds": len(cells),
                                   "errors": sum(c.errors for c in cells)}
            for f in FIGURES:
                row[f] = statistics.median(getattr(c, f) for c in cells)
            tps = [c.output_tps for c in cells]
            row["output_tps_range"] = (min(tps), max(tps))
            by_round = {c.round: c.output_tps for c in cells}
            for other, ocells in legs.items():
                if other == leg:
                    continue
                pairs = [by_round[o.round] / o.output_tps for o in ocells if o.round in by_round and o.output_tps > 0]
                if pairs:
                    row[f"vs_{other}"] = statistics.median(pairs)
            rows.append(row)
    return rows


def markdown(res: ServingResult, command: str) -> str:
    s = res.setup
    lines = [f"# Serving benchmark: {s.model}", "", f"`{command}`", "",
             f"guidellm {res.versions.get('guidellm', '?')} drives each server (streamed text completions, synthetic "
             f"prompts from the model's tokenizer, seed {s.seed}); a fresh server per cell; {s.rounds} rounds, legs "
             f"alternating. Equal KV memory: {s.kv_memory / (1 << 20):.0f} MiB (vLLM's KV pool = kvdrive's device "
             f"{s.gpu_share:.0%} + DRAM tiers; kvdrive's SSD tier {s.ssd_budget / (1 << 30):.1f} GiB beside); "
             f"{s.threads} threads. Versions: "
             + ", ".join(f"{k} {v}" for k, v in res.versions.items()) + ".", ""]
    for name in dict.fromkeys(c.workload for c in res.cells):
        w = WORKLOADS[name]
        lines += [f"## ({name}) {w.what}", "",
                  "| concurrency | leg | output tok/s (range) | prompt tok/s | req/s | TTFT p50 / p99 ms | "
                  "ITL p50 / p99 ms | peak RSS MiB | preemptions | errors | ratios (output tok/s, same rounds) |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in summary(res):
            if r["workload"] != name:
                continue
            lo, hi = r["output_tps_range"]
            ratios = ", ".join(f"{k[3:]} {v:.2f}x" for k, v in r.items() if k.startswith("vs_"))
            pre = "-" if r["preemptions"] < 0 else f"{r['preemptions']:.0f}"
            lines.append(f"| {r['concurrency']} | {r['leg']} | {r['output_tps']:.2f} ({lo:.2f}-{hi:.2f}) | "
                         f"{r['prompt_tps']:.0f} | {r['request_ps']:.3f} | {r['ttft_ms_p50']:.0f} / "
                         f"{r['ttft_ms_p99']:.0f} | {r['itl_ms_p50']:.0f} / {r['itl_ms_p99']:.0f} | "
                         f"{r['peak_rss_mib']:.0f} | {pre} | {r['errors']} | {ratios} |")
        lines.append("")
    return "\n".join(lines)


def plot(res: ServingResult, path: str) -> None:
    """Output tokens/s per cell (median over rounds, the range as an error bar), one bar per leg."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary(res)
    cells = list(dict.fromkeys((r["workload"], r["concurrency"]) for r in rows))
    legs = list(dict.fromkeys(r["leg"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cells)), 4))
    width = 0.8 / max(1, len(legs))
    for j, leg in enumerate(legs):
        xs, ys, errs = [], [], [[], []]
        for i, cell in enumerate(cells):
            r = next((r for r in rows if (r["workload"], r["concurrency"]) == cell and r["leg"] == leg), None)
            if r is None:
                continue
            lo, hi = r["output_tps_range"]
            xs.append(i + j * width)
            ys.append(r["output_tps"])
            errs[0].append(r["output_tps"] - lo)
            errs[1].append(hi - r["output_tps"])
        ax.bar(xs, ys, width, yerr=errs, label=leg, capsize=2)
    ax.set_xticks([i + width * (len(legs) - 1) / 2 for i in range(len(cells))])
    ax.set_xticklabels([f"({w}) c={c}" for w, c in cells])
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{res.setup.model}: serving under {res.setup.kv_memory / (1 << 20):.0f} MiB of KV memory")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
