"""The RULER benchmark's report (``kvdrive bench ruler``): each sparse leg paired with full attention on the
same samples (the mean difference, a bootstrap 95% interval, the share of identical responses), the averages
over tasks, the Markdown table, the PNG and the result file."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvdrive.runtime.bench.ruler_bench import RulerResult

BOOTSTRAP = 10_000
SEED = 0


@dataclass(frozen=True)
class Paired:
    """One sparse leg against full attention on one (context, task): points, paired over samples."""

    context: int
    task: str
    leg: str
    n: int
    full: float
    sparse: float
    diff: float
    low: float  # bootstrap 95% interval of the mean paired difference
    high: float
    identical: float  # share of samples whose greedy response equals full attention's



def _bootstrap(diffs: np.ndarray, rng: np.random.Generator) -> tuple[float, float]:
    """95% percentile interval of the mean of ``diffs`` [N] (resampled with replacement)."""
    if len(diffs) == 0:
        return float("nan"), float("nan")
    means = diffs[rng.integers(0, len(diffs), size=(BOOTSTRAP, len(diffs)))].mean(axis=1)  # [B]
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def _pairs(res: RulerResult) -> dict[tuple[int, str, str], tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(context, task, sparse leg) -> full's and the leg's scores in points [N] and whether each response
    equals full attention's [N], on the samples both cells have."""
    full = {(c.context, c.task): c for c in res.cells if c.leg == "full"}
    out = {}
    for c in res.cells:
        ref = full.get((c.context, c.task))
        if c.leg == "full" or ref is None:
            continue
        by_id = {s.doc_id: s for s in ref.samples}
        both = [(by_id[s.doc_id], s) for s in c.samples if s.doc_id in by_id]
        out[(c.context, c.task, c.leg)] = (np.array([100.0 * a.score for a, _ in both]),
                                           np.array([100.0 * b.score for _, b in both]),
                                           np.array([a.response == b.response for a, b in both]))
    return out


def paired(res: RulerResult) -> list[Paired]:
    """Each sparse cell against the full cell of the same (context, task)."""
    rng = np.random.default_rng(SEED)
    out = []
    for (context, task, leg), (f, s, same) in _pairs(res).items():
        if len(f) == 0:
            continue
        low, high = _bootstrap(s - f, rng)
        out.append(Paired(context, task, leg, len(f), float(f.mean()), float(s.mean()), float((s - f).mean()),
                          low, high, float(same.mean())))
    return out


def averages(res: RulerResult) -> list[Paired]:
    """Per (context, leg): the mean over tasks (each task weighs the same); its 95% interval from resampling
    every task's samples at once."""
    rng = np.random.default_rng(SEED + 1)
    pairs = {k: v for k, v in _pairs(res).items() if len(v[0])}
    out = []
    for context, leg in dict.fromkeys((k[0], k[2]) for k in pairs):
        group = [v for k, v in pairs.items() if (k[0], k[2]) == (context, leg)]
        draws = np.mean([(s - f)[rng.integers(0, len(f), size=(BOOTSTRAP, len(f)))].mean(axis=1)
                         for f, s, _ in group], axis=0)  # [B]
        out.append(Paired(context, "average", leg, sum(len(f) for f, _, _ in group),
                          float(np.mean([f.mean() for f, _, _ in group])), float(np.mean([s.mean() for _, s, _ in group])),
                          float(np.mean([(s - f).mean() for f, s, _ in group])), float(np.percentile(draws, 2.5)),
                          float(np.percentile(draws, 97.5)), float(np.mean([same.mean() for _, _, same in group]))))
    return out


def markdown(res: RulerResult, command: str) -> str:
    s = res.setup
    pairs = paired(res)
    means = averages(res)
    lines = [f"# RULER: {s.model}, sparse against full attention on the same samples", "",
             f"`{command}`", "",
             f"- versions: {', '.join(f'{k} {v}' for k, v in res.versions.items())}",
             f"- {s.limit} samples per task and context; budgets {', '.join(map(str, s.budgets))}; tiers: device "
             f"{s.gpu_budget}, DRAM {s.dram_budget}, SSD {s.ssd_budget}; page {s.page_size} tokens; weights "
             f"{s.weights}; {s.threads} threads; lm-eval local-completions, chat template, greedy; RULER's own "
             f"sample seeds; bootstrap {BOOTSTRAP} resamples (seed {SEED})", ""]
    for context in s.contexts:
        lines += [f"## {context} tokens", "",
                  "| task | leg | n | full | sparse | paired diff | 95% CI | identical outputs |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for p in [p for p in pairs if p.context == context] + [a for a in means if a.context == context]:
            ci = "" if np.isnan(p.low) else f"[{p.low:+.1f}, {p.high:+.1f}]"
            lines.append(f"| {p.task} | {p.leg} | {p.n} | {p.full:.1f} | {p.sparse:.1f} | {p.diff:+.1f} | {ci} | "
                         f"{100 * p.identical:.0f}% |")
        lines.append("")
        cells = [c for c in res.cells if c.context == context]
        lines += ["| task | leg | seconds | prompt tokens | from stored pages |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {c.task} | {c.leg} | {c.seconds:.0f} | {c.prompt_tokens} | {c.cached_tokens} |" for c in cells]
        lines.append("")
    total = sum(c.seconds for c in res.cells)
    lines.append(f"Total: {total / 60:.0f} minutes over {len(res.cells)} cells.")
    return "\n".join(lines) + "\n"


def plot(res: RulerResult, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = paired(res)
    contexts = list(res.setup.contexts)
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4), squeeze=False)
    for ax, context in zip(axes[0], contexts, strict=True):
        tasks = list(res.setup.tasks)
        legs = list(res.setup.legs)
        width = 0.8 / len(legs)
        for i, leg in enumerate(legs):
            scores = []
            for task in tasks:
                cell = next((c for c in res.cells if (c.context, c.task, c.leg) == (context, task, leg)), None)
                scores.append(cell.score if cell else float("nan"))
            ax.bar(np.arange(len(tasks)) + i * width, scores, width, label=leg)
        for p in pairs:
            if p.context == context and p.task in tasks and p.diff < -5:
                ax.annotate(f"{p.diff:+.0f}", (tasks.index(p.task), p.sparse), color="red", fontsize=7)
        ax.set_xticks(np.arange(len(tasks)) + 0.4 - width / 2, tasks, rotation=30, ha="right", fontsize=8)
        ax.set_ylim(0, 105)
        ax.set_ylabel("score (points)")
        ax.set_title(f"{res.setup.model}, {context} tokens")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def as_dict(res: RulerResult) -> dict[str, Any]:
    return {"setup": asdict(res.setup), "versions": res.versions, "cells": [asdict(c) for c in res.cells],
            "paired": [asdict(p) for p in paired(res)], "averages": [asdict(p) for p in averages(res)]}
