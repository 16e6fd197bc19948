"""The selection probe's report (``selection_probe``): per prompt group and rule the cover figures, per layer
the same, the budget shared out across layers, the attention output's error; a Markdown table and a PNG."""

from __future__ import annotations

import statistics
from typing import Any

from kvdrive.runtime.attention import SelectionConfig
from kvdrive.runtime.bench.selection_probe import OutputError, ProbeResult, StepLayer


def _label_of(res: ProbeResult, prompt: int) -> str:
    """A prompt's group: its label up to the first '#' (``niah_multikey_3#4`` -> ``niah_multikey_3``)."""
    return str(res.prompts[prompt]["label"]).split("#")[0]


def summary(res: ProbeResult) -> list[dict[str, Any]]:
    """Per (group, rule): mean cover, the 5th percentile of the worst head's cover, the share of heads whose
    heaviest page was kept, and the layer with the lowest mean cover."""
    groups: dict[tuple[str, str], list[StepLayer]] = {}
    for r in res.rows:
        groups.setdefault((_label_of(res, r.prompt), r.rule), []).append(r)
    out = []
    for (group, rule), rows in groups.items():
        by_layer: dict[int, list[float]] = {}
        for r in rows:
            by_layer.setdefault(r.layer, []).append(r.cover_mean)
        worst = min(by_layer, key=lambda layer: statistics.fmean(by_layer[layer]))
        mins = sorted(r.cover_min for r in rows)
        out.append({"group": group, "rule": rule, "cases": len(rows),
                    "cover_mean": statistics.fmean(r.cover_mean for r in rows),
                    "cover_min_p5": mins[len(mins) // 20],
                    "top_kept": statistics.fmean(r.top_kept for r in rows),
                    "worst_layer": worst, "worst_layer_cover": statistics.fmean(by_layer[worst])})
    return out


def _share_out(curves: list[tuple[float, ...]], total: int) -> list[int]:
    """The pages each layer keeps when ``total`` are given to the largest gains in cover (every curve is
    concave: its pages come heaviest first, so taking the largest gains is optimal)."""
    gains = sorted(((c[j + 1] - c[j], i) for i, c in enumerate(curves) for j in range(len(c) - 1)), reverse=True)
    out = [0] * len(curves)
    for _, i in gains[:total]:
        out[i] += 1
    return out


def allocation(res: ProbeResult) -> list[dict[str, Any]]:
    """Per group: the oracle's mean cover over (step, layer) with an even budget, with the step's pages shared
    out among the layers by this step's exact masses and by the previous step's, and with twice the budget
    (even). Only steps where every layer needs selecting and that follow such a step count."""
    sel = SelectionConfig(token_budget=res.token_budget, page_size=res.page_size)
    wide = SelectionConfig(token_budget=2 * res.token_budget, page_size=res.page_size)
    free = sel.budget_pages - sel.sink_pages - sel.recent_pages
    free2 = wide.budget_pages - sel.sink_pages - sel.recent_pages
    steps: dict[tuple[int, int], dict[int, tuple[float, ...]]] = {}
    for c in res.curves:
        steps.setdefault((c.prompt, c.step), {})[c.layer] = c.cover
    layers = max((len(v) for v in steps.values()), default=0)
    groups: dict[str, dict[str, list[float]]] = {}
    previous: dict[int, list[int]] = {}
    for (prompt, _step), by in sorted(steps.items()):
        if len(by) < layers:
            continue
        curves = [by[i] for i in sorted(by)]
        share = _share_out(curves, free * len(curves))
        before, previous[prompt] = previous.get(prompt), share
        if before is None:
            continue  # a prompt's first probed step: no previous step to share out by
        g = groups.setdefault(_label_of(res, prompt), {k: [] for k in ("even", "shared", "shared_prev", "even_2x")})
        g["even"].append(statistics.fmean(c[min(free, len(c) - 1)] for c in curves))
        g["shared"].append(statistics.fmean(c[n] for c, n in zip(curves, share, strict=True)))
        g["shared_prev"].append(statistics.fmean(c[min(n, len(c) - 1)] for c, n in zip(curves, before, strict=True)))
        g["even_2x"].append(statistics.fmean(c[min(free2, len(c) - 1)] for c in curves))
    return [{"group": g, "cases": len(v["even"]), **{k: round(statistics.fmean(x), 4) for k, x in v.items()}}
            for g, v in groups.items()]


def output_errors(res: ProbeResult) -> list[dict[str, Any]]:
    """Per group: the mean relative output error of each estimate and the layer where renormalising errs most."""
    groups: dict[str, list[OutputError]] = {}
    for e in res.errors:
        groups.setdefault(_label_of(res, e.prompt), []).append(e)
    out = []
    for g, rows in groups.items():
        layers: dict[int, list[float]] = {}
        for e in rows:
            layers.setdefault(e.layer, []).append(e.renormalised)
        worst = max(layers, key=lambda x: statistics.fmean(layers[x]))
        out.append({"group": g, "rule": rows[0].rule, "cases": len(rows),
                    "renormalised": round(statistics.fmean(e.renormalised for e in rows), 4),
                    "completed_exact": round(statistics.fmean(e.completed_exact for e in rows), 4),
                    "completed_sketch": round(statistics.fmean(e.completed_sketch for e in rows), 4),
                    "worst_layer": worst, "worst_layer_renormalised": round(statistics.fmean(layers[worst]), 4)})
    return out


def _table(header: list[str], align: str, rows: list[list[str]]) -> list[str]:
    """A Markdown table: ``align`` a letter a column, l (left) or r (right)."""
    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    return ["| " + " | ".join(header) + " |", rule] + ["| " + " | ".join(r) + " |" for r in rows]


def markdown(res: ProbeResult, command: str) -> str:
    lines = [f"# Selection probe: {res.model}, budget {res.token_budget} tokens", "", f"`{command}`", "",
             f"{len(res.prompts)} prompts, {res.steps} greedy decode steps each under full attention; every rule "
             "scored on the same queries at every step and layer.", ""]
    lines += _table(["prompts", "rule", "cases", "cover (mean)", "worst head, 5th pct", "heaviest page kept",
                     "worst layer (cover)"], "llrrrrl",
                    [[s["group"], s["rule"], str(s["cases"]), f"{s['cover_mean']:.3f}", f"{s['cover_min_p5']:.3f}",
                      f"{s['top_kept']:.1%}", f"{s['worst_layer']} ({s['worst_layer_cover']:.3f})"]
                     for s in summary(res)])
    shares = allocation(res)
    if shares:
        lines += ["", "Budget across layers (the oracle's mean cover; each (step) shares out layers x budget pages):", ""]
        lines += _table(["prompts", "steps", "even", "shared by this step's mass", "shared by the previous step's",
                         "even, 2x budget"], "lrrrrr",
                        [[a["group"], str(a["cases"]), f"{a['even']:.3f}", f"{a['shared']:.3f}",
                          f"{a['shared_prev']:.3f}", f"{a['even_2x']:.3f}"] for a in shares])
    errors = output_errors(res)
    if errors:
        lines += ["", "Attention output against full attention's (relative L2 error, mean over heads, steps and "
                  "layers):", ""]
        lines += _table(["prompts", "kept pages of", "cases", "renormalised (sparse decode)",
                         "+ left-out pages at exact mass", "+ left-out pages at the sketch's mass",
                         "worst layer (renormalised)"], "llrrrrl",
                        [[e["group"], e["rule"], str(e["cases"]), f"{e['renormalised']:.4f}",
                          f"{e['completed_exact']:.4f}", f"{e['completed_sketch']:.4f}",
                          f"{e['worst_layer']} ({e['worst_layer_renormalised']:.4f})"] for e in errors])
    lines.append("")
    lines += _table(["prompt", "tokens", "seconds", "greedy output (full attention)"], "lrrl",
                    [[str(p["label"]), str(p["tokens"]), str(p["seconds"]), repr(p["output"])] for p in res.prompts])
    return "\n".join(lines) + "\n"


def plot(res: ProbeResult, path: str) -> None:
    """Mean cover per layer, one line per rule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for rule in dict.fromkeys(r.rule for r in res.rows):
        by_layer: dict[int, list[float]] = {}
        for r in res.rows:
            if r.rule == rule:
                by_layer.setdefault(r.layer, []).append(r.cover_mean)
        layers = sorted(by_layer)
        ax.plot(layers, [statistics.fmean(by_layer[x]) for x in layers], marker="o", ms=3, label=rule)
    ax.set_xlabel("layer")
    ax.set_ylabel("attention share on kept pages + tail")
    ax.set_title(f"{res.model}: selection at budget {res.token_budget} vs full attention")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def by_layer(res: ProbeResult) -> list[dict[str, Any]]:
    """Per (group, rule, layer): the mean cover, the worst head's lowest cover and the share of heaviest pages
    kept, over the prompts and steps."""
    cells: dict[tuple[str, str, int], list[StepLayer]] = {}
    for r in res.rows:
        cells.setdefault((_label_of(res, r.prompt), r.rule, r.layer), []).append(r)
    return [{"group": g, "rule": rule, "layer": layer, "cases": len(rows),
             "cover_mean": round(statistics.fmean(r.cover_mean for r in rows), 4),
             "cover_min": round(min(r.cover_min for r in rows), 4),
             "top_kept": round(statistics.fmean(r.top_kept for r in rows), 4)}
            for (g, rule, layer), rows in cells.items()]


def as_dict(res: ProbeResult) -> dict[str, Any]:
    """The result file: the setup, each prompt, the summary and the per-layer figures (not every row)."""
    return {"model": res.model, "token_budget": res.token_budget, "page_size": res.page_size, "steps": res.steps,
            "prompts": res.prompts, "summary": summary(res), "by_layer": by_layer(res),
            "allocation": allocation(res), "output_error": output_errors(res)}
