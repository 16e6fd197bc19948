"""The routing benchmark's report: one row per run, the two goals (prefill computed at most half of
round-robin's, TTFT p50 at least 2x better), the fault run's timeline, and a PNG of the comparison."""

from __future__ import annotations

from kvdrive.runtime.bench.routing_bench import RoutingBenchResult, RunResult
from kvdrive.runtime.bench.routing_fleet import DRAM_BUDGET, GPU_BUDGET


def _p(d: dict[str, float], k: str) -> str:
    return f"{d[k] / 1000:.2f}" if k in d else "-"


def _label(r: RunResult) -> str:
    return r.policy + (" + faults" if r.faults else "")


def table(result: RoutingBenchResult) -> str:
    rows = ["| run | requests | errors | tokens/s | TTFT p50 / p99 s | shared-doc TTFT p50 / p99 s "
            "| unique TTFT p50 / p99 s | prompt tokens | prefill computed | pages reused | per-replica prompt "
            "tokens | decisions |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result.runs:
        sh, un = r.ttft_ms_by_kind.get("shared", {}), r.ttft_ms_by_kind.get("unique", {})
        dec = ", ".join(f"{k} {int(v)}" for k, v in sorted(r.decisions.items()) if v)
        rows.append(f"| {_label(r)} | {r.requests} | {r.errors} | {r.tokens_per_s:.2f} "
                    f"| {_p(r.ttft_ms, 'p50')} / {_p(r.ttft_ms, 'p99')} | {_p(sh, 'p50')} / {_p(sh, 'p99')} "
                    f"| {_p(un, 'p50')} / {_p(un, 'p99')} | {r.prompt_tokens} | {r.prefill_tokens_computed} "
                    f"| {r.prefix_pages_reused} | {' / '.join(map(str, r.per_replica_prompt_tokens))} | {dec} |")
    return "\n".join(rows)


def goals(result: RoutingBenchResult) -> str:
    by = {r.policy: r for r in result.runs if not r.faults}
    rr, px = by.get("round-robin"), by.get("prefix")
    if rr is None or px is None:
        return "(both policies are needed for the comparison)"
    prefill = px.prefill_tokens_computed / max(1, rr.prefill_tokens_computed)
    ttft = rr.ttft_ms.get("p50", 0) / max(1e-9, px.ttft_ms.get("p50", 0))
    tput = px.tokens_per_s / max(1e-9, rr.tokens_per_s)
    same = sorted(set(px.computed_by_request) & set(rr.computed_by_request))
    lines = []
    if same:
        a, b = sum(px.computed_by_request[k] for k in same), sum(rr.computed_by_request[k] for k in same)
        ratio = a / max(1, b)
        lines.append(f"- Prefill computed on the same requests (the {len(same)} prompts both runs answered, "
                     f"from each answer's `usage.prompt_tokens_details.cached_tokens`), prefix / round-robin: "
                     f"**{ratio:.2f}** ({a} vs {b} tokens; goal <= 0.5: {'met' if ratio <= 0.5 else 'NOT met'}).")
    return "\n".join([
        *lines,
        f"- Prefill computed over each whole run (the replicas' counters; the prefix run answered "
        f"{px.requests - px.errors} requests, round-robin {rr.requests - rr.errors}), prefix / round-robin: "
        f"**{prefill:.2f}**; per request "
        f"{px.prefill_tokens_computed / max(1, px.requests - px.errors):.0f} vs "
        f"{rr.prefill_tokens_computed / max(1, rr.requests - rr.errors):.0f} tokens.",
        f"- TTFT p50, round-robin / prefix: **{ttft:.2f}x** (goal >= 2: {'met' if ttft >= 2 else 'NOT met'}).",
        f"- Aggregate completion tokens/s, prefix / round-robin: {tput:.2f}x; requests completed "
        f"{px.requests - px.errors} vs {rr.requests - rr.errors}."])


def events(result: RoutingBenchResult) -> str:
    """The prefix run whose router followed KV events against the one that polled page lists."""
    by = {r.policy: r for r in result.runs if not r.faults}
    poll, ev = by.get("prefix"), by.get("prefix + kv events")
    if poll is None or ev is None:
        return ""
    lines = ["## KV events against polling (prefix runs)"]
    same = sorted(set(poll.computed_by_request) & set(ev.computed_by_request))
    if same:
        a, b = sum(ev.computed_by_request[k] for k in same), sum(poll.computed_by_request[k] for k in same)
        lines.append(f"- Prefill computed on the same requests ({len(same)} prompts both runs answered), events / "
                     f"polling: **{a / max(1, b):.2f}** ({a} vs {b} tokens; not worse: "
                     f"{'yes' if a <= b * 1.05 else 'NO'}, within 5%).")
    for name, r in (("polling", poll), ("events", ev)):
        done = max(1, r.requests - r.errors)
        lines.append(f"- {name}: {r.prefix_pages_reused} pages reused, {r.prefill_tokens_computed} prefill tokens "
                     f"computed ({r.prefill_tokens_computed / done:.0f} per answered request), "
                     f"TTFT p50 {_p(r.ttft_ms, 'p50')} s.")
    return "\n".join(lines)


def faults(result: RoutingBenchResult) -> str:
    runs = [r for r in result.runs if r.faults]
    if not runs:
        return "(no fault run)"
    f = runs[0].faults
    return "\n".join(f"- {k.replace('_', ' ')}: {v}" for k, v in f.items())


def markdown(result: RoutingBenchResult, command: str) -> str:
    return "\n\n".join([
        "# Routing benchmark: prefix-aware vs round-robin",
        f"{result.replicas} replicas of the demo model (`kvdrive serve`, 1 compute thread each, GPU envelope "
        f"{GPU_BUDGET}, DRAM {DRAM_BUDGET}, SSD {result.replica_ssd}, fresh directories per run) behind "
        f"`kvdrive route` (prefix runs: affinity share {result.affinity_share:g}"
        f"{', above 1: by cost alone' if result.affinity_share > 1 else ''}); {result.clients} "
        f"streaming clients starting requests for {result.seconds:.0f} s per comparison run (the fault run: its own "
        f"length; every run then waits for its answers in flight); "
        f"{int(100 * float(result.workload['shared_share']))}% of requests ask about one of "
        f"{result.workload['documents']} shared documents (1.5-3K tokens), the rest are unique prompts; "
        f"{result.workload['max_tokens']} tokens per answer; host {result.host}. Command: `{command}`.",
        table(result), "## Goals", goals(result), *([events(result)] if events(result) else []),
        "## Faults (prefix run with a replica killed and the router restarted)", faults(result)]) + "\n"


def plot(result: RoutingBenchResult, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = result.runs
    labels = [_label(r) for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    xs = range(len(runs))
    axes[0].bar([x - 0.2 for x in xs], [r.ttft_ms.get("p50", 0) / 1000 for r in runs], 0.4, label="p50")
    axes[0].bar([x + 0.2 for x in xs], [r.ttft_ms.get("p99", 0) / 1000 for r in runs], 0.4, label="p99")
    axes[0].set_title("time to first token (s)")
    axes[0].legend()
    axes[1].bar(xs, [r.prefill_tokens_computed / 1000 for r in runs], color="tab:red")
    axes[1].set_title("prefill tokens computed (thousands)")
    axes[2].bar(xs, [r.tokens_per_s for r in runs], color="tab:green")
    axes[2].set_title("completion tokens/s (all clients)")
    for ax in axes:
        ax.set_xticks(list(xs), labels, fontsize=8)
    fig.suptitle(f"{result.replicas} replicas, {result.clients} clients, {result.seconds:.0f} s per run", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
