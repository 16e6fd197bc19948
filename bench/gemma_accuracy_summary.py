"""One table and one plot of Gemma 3 270M's pass-key runs across lengths (bench/results/gemma3*-budget*/).

  .venv/bin/python bench/gemma_accuracy_summary.py      (reads the runs' accuracy.json, writes
  bench/results/gemma3-accuracy.{md,png})
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = {1024: ("gemma3-budget1024", "gemma3-32k-budget1024"),  # 4K-16K in one run, 32K in another
        2048: ("gemma3-budget2048", "gemma3-32k-budget2048")}
BEFORE = {1024: ("gemma3-32k-bounds-only-budget1024",),  # the same 32K pages, selection by the bounds alone
          2048: ("gemma3-32k-bounds-only-budget2048",)}


def per_context(run: str) -> dict[int, dict[str, float]]:
    path = RESULTS / run / "accuracy.json"
    if not path.exists():
        return {}
    out: dict[int, dict[str, list[float]]] = {}
    for c in json.loads(path.read_text())["cases"]:
        if c["kind"] == "passkey":
            o = out.setdefault(c["context"], {"full": [], "sparse": [], "same": [], "kl": []})
            o["full"].append(c["reference_correct"])
            o["sparse"].append(c["candidate_correct"])
            o["same"].append(c["identical"])
            o["kl"].extend(c["kl"])
    return {ctx: {"n": len(o["full"]), **{k: statistics.fmean(v) if v else 0.0 for k, v in o.items()}}
            for ctx, o in out.items()}


def table_of(runs: dict[int, tuple[str, ...]]) -> tuple[str, dict[int, dict[int, dict[str, float]]], list[int]]:
    """The markdown table of ``runs`` (budget -> result folders), the figures by budget and context, the contexts."""
    by_budget = {b: {ctx: s for run in rs for ctx, s in per_context(run).items()} for b, rs in runs.items()}
    contexts = sorted(set(by_budget[1024]) | set(by_budget[2048]))
    rows = ["| context | cases | full attention | sparse 1024 | KL 1024 | sparse 2048 | KL 2048 | identical outputs 1024 / 2048 |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    def cells(s: dict[str, float] | None) -> tuple[str, str, str]:  # sparse retrieval, KL, identical outputs
        return ("not run", "-", "-") if s is None else (f"{100 * s['sparse']:.0f}%", f"{s['kl']:.2e}",
                                                         f"{100 * s['same']:.0f}%")

    for ctx in contexts:
        a, b = by_budget[1024].get(ctx), by_budget[2048].get(ctx)
        ref = a or b
        assert ref is not None
        (sa, ka, ia), (sb, kb, ib) = cells(a), cells(b)
        rows.append(f"| {ctx} | {int(ref['n'])} | {100 * ref['full']:.0f}% | {sa} | {ka} | {sb} | {kb} | {ia} / {ib} |")
    return "\n".join(rows), by_budget, contexts


def main() -> None:
    table, by_budget, contexts = table_of(RUNS)
    before, _, _ = table_of(BEFORE)
    (RESULTS / "gemma3-accuracy.md").write_text(
        "# Gemma 3 270M: pass-key retrieval, full attention vs sparse decoding, by context\n\n" + table + "\n\n"
        "Before the selection added the mass each page drew at the previous step (page scores from the key "
        "bounds alone), on the same stored 32K pages and prompts:\n\n" + before + "\n")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for label, key, budget in (("full attention", "full", 1024), ("sparse, budget 1024", "sparse", 1024),
                               ("sparse, budget 2048", "sparse", 2048)):
        xs = [c for c in contexts if c in by_budget[budget]]
        ax1.plot(xs, [100 * by_budget[budget][c][key] for c in xs], marker="o", label=label)
    for budget in (1024, 2048):
        xs = [c for c in contexts if c in by_budget[budget]]
        ax2.plot(xs, [by_budget[budget][c]["kl"] for c in xs], marker="o", label=f"budget {budget}")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in contexts])
        ax.set_xlabel("context (tokens)")
        ax.legend()
    ax1.set_ylabel("pass keys retrieved (%)")
    ax1.set_ylim(0, 105)
    ax2.set_ylabel("mean KL(full || sparse), nats")
    fig.suptitle("Gemma 3 270M through the tiers")
    fig.tight_layout()
    fig.savefig(RESULTS / "gemma3-accuracy.png", dpi=110)
    print(table)


if __name__ == "__main__":
    main()
