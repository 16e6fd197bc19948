"""Reporting of the accuracy benchmark (``accuracy_bench``): per-context summary, acceptance checks,
the markdown table and the plot."""

from __future__ import annotations

import statistics
from dataclasses import asdict

from kvdrive.runtime.bench.accuracy_bench import AccuracyBenchResult, CaseResult

SETS = ("chat", "document")  # the greedy-output sets besides passkey


def _kl_mean(cases: list[CaseResult]) -> float:
    values = [x for c in cases for x in c.kl]  # token-weighted
    return statistics.fmean(values) if values else 0.0


def summary(result: AccuracyBenchResult) -> dict[str, object]:
    """Per-context retrieval accuracy, identical-output rates, mean KL and the acceptance checks."""
    pk = [c for c in result.cases if c.kind == "passkey"]
    out: dict[str, object] = {}

    def acc(cs: list[CaseResult], attr: str) -> float:
        return 100.0 * sum(bool(getattr(c, attr)) for c in cs) / len(cs) if cs else 0.0

    per_context = {}
    for ctx in sorted({c.context for c in pk}):
        cs = [c for c in pk if c.context == ctx]
        per_context[str(ctx)] = {
            "cases": len(cs), "prompt_tokens": round(statistics.fmean(c.prompt_tokens for c in cs)),
            "reference_accuracy": acc(cs, "reference_correct"), "candidate_accuracy": acc(cs, "candidate_correct"),
            "identical_rate": acc(cs, "identical") / 100, "kl_mean": _kl_mean(cs)}
    out["passkey"] = {"per_context": per_context, "cases": len(pk), "reference_accuracy": acc(pk, "reference_correct"),
                      "candidate_accuracy": acc(pk, "candidate_correct"), "identical_rate": acc(pk, "identical") / 100,
                      "kl_mean": _kl_mean(pk)}
    for s in SETS:
        cs = [c for c in result.cases if c.kind == s]
        div = [c.first_divergence for c in cs if c.first_divergence is not None]
        out[s] = {"prompts": len(cs), "prompt_tokens_mean": round(statistics.fmean(c.prompt_tokens for c in cs)) if cs
                  else 0, "identical_rate": acc(cs, "identical") / 100, "diverged": len(div),
                  "first_divergence_median": statistics.median(div) if div else None, "kl_mean": _kl_mean(cs),
                  "kl_max": max((x for c in cs for x in c.kl), default=0.0)}
    out["kl_mean_all"] = _kl_mean(list(result.cases))
    out["replay_max_diff"] = max((c.replay_diff for c in result.cases if c.replay_diff is not None), default=None)
    p = out["passkey"]
    assert isinstance(p, dict)
    chat = out["chat"]
    assert isinstance(chat, dict)
    out["acceptance"] = {
        "passkey_cases_ge_30": len(pk) >= 30,
        "retrieval_within_2_points": abs(p["candidate_accuracy"] - p["reference_accuracy"]) <= 2.0,
        "chat_prompts_ge_20": chat["prompts"] >= 20,
        "chat_identical_ge_90pct": chat["identical_rate"] >= 0.9,
    }
    return out


def as_dict(result: AccuracyBenchResult) -> dict[str, object]:
    return {**asdict(result), "summary": summary(result)}


def table(result: AccuracyBenchResult) -> str:
    s = summary(result)
    p = s["passkey"]
    assert isinstance(p, dict)
    rows = [f"Passkey retrieval (token budget {result.token_budget}, candidate: {result.candidate})", "",
            "| context | prompt tokens | cases | full attention | candidate | Δ points | identical outputs | mean KL |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for ctx, r in {**p["per_context"], "all": {**p, "prompt_tokens": "-"}}.items():
        rows.append(f"| {ctx} | {r['prompt_tokens']} | {r['cases']} | {r['reference_accuracy']:.1f}% | "
                    f"{r['candidate_accuracy']:.1f}% | {r['candidate_accuracy'] - r['reference_accuracy']:+.1f} | "
                    f"{r['identical_rate']:.0%} | {r['kl_mean']:.2e} |")
    rows += ["", "Greedy chat outputs against full attention", "",
             "| set | prompts | mean prompt tokens | identical | first divergence (median) | mean KL | max KL |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in SETS:
        c = s[name]
        assert isinstance(c, dict)
        fd = "-" if c["first_divergence_median"] is None else f"{c['first_divergence_median']:g}"
        rows.append(f"| {name} | {c['prompts']} | {c['prompt_tokens_mean']} | {c['identical_rate']:.0%} | {fd} | "
                    f"{c['kl_mean']:.2e} | {c['kl_max']:.2e} |")
    acc = s["acceptance"]
    assert isinstance(acc, dict)
    rows += ["", f"Mean KL(full || {result.candidate}) over all generated positions: {s['kl_mean_all']:.2e} nats. "
             "Acceptance: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in acc.items()) + "."]
    return "\n".join(rows)


def plot(result: AccuracyBenchResult, path: str) -> bool:
    """Retrieval accuracy per context, identical-output rates and mean KL; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    s = summary(result)
    p = s["passkey"]
    assert isinstance(p, dict)
    ctxs = list(p["per_context"])
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    ax = axes[0]
    for j, (key, name) in enumerate((("reference_accuracy", "full attention"), ("candidate_accuracy", result.candidate))):
        bars = ax.bar([i + 0.4 * j for i in range(len(ctxs))], [p["per_context"][c][key] for c in ctxs], 0.4,
                      label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks([i + 0.2 for i in range(len(ctxs))], [f"ctx {c}" for c in ctxs])
    ax.set_ylim(0, 105)
    ax.set_ylabel("passkey retrieval accuracy (%)")
    ax.legend(fontsize=8)
    groups = [f"passkey {c}" for c in ctxs] + list(SETS)
    stats = [p["per_context"][c] for c in ctxs] + [s[n] for n in SETS]
    same = axes[1].bar(groups, [100 * st["identical_rate"] for st in stats], color="tab:green")  # type: ignore[index]
    axes[1].bar_label(same, fmt="%.0f", fontsize=8)
    axes[1].set_ylim(0, 105)
    axes[1].set_ylabel("greedy outputs identical to full (%)")
    kls = [st["kl_mean"] for st in stats]  # type: ignore[index]
    bars = axes[2].bar(groups, [max(k, 1e-9) for k in kls], color="tab:red")
    axes[2].bar_label(bars, ["exact" if k == 0 else f"{k:.1e}" for k in kls], fontsize=7)
    axes[2].set_yscale("log")
    axes[2].set_ylabel(f"mean KL(full || {result.candidate}) per token (nats)")
    for ax in axes[1:]:
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.suptitle(f"{result.model}: sparse decoding vs full attention (token budget {result.token_budget}, "
                 f"page {result.page_size})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
