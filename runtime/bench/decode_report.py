"""The decode benchmark's report: the table of every row, kvdrive's ratios (to the floor, llama.cpp and the
other policies, and across contexts) with its per-step breakdown, and a PNG of tokens/s per case."""

from __future__ import annotations

from kvdrive.runtime.bench.decode_bench import PHASES, DecodeBenchResult, ModeResult, PrefillResult

SPARSE_ROWS = ("sparse-gpu", "sparse-gpu-k0", "sparse-gpu-k8", "sparse-gpu-k4", "kvdrive", "kvdrive-k0", "kvdrive-k8",
               "kvdrive-k4", "sparse-gpu-means", "kvdrive-means", "sparse-gpu-sketch",
               "kvdrive-sketch")  # the rows that select pages (-kN, -means, -sketch: a named rule, decode_bench.split_mode)
ORDER = ("floor", "llama.cpp", "full-gpu", *SPARSE_ROWS, "lru", "ondemand", "fullfetch")


def _by(result: DecodeBenchResult) -> dict[tuple[int, int, str], ModeResult]:
    return {(r.context, r.batch, r.mode): r for r in result.results}


def _cases(result: DecodeBenchResult) -> list[tuple[int, int]]:
    return sorted({(r.context, r.batch) for r in result.results})


def header(result: DecodeBenchResult) -> str:
    return (f"{result.model}, {result.threads} threads, token budget {result.token_budget}, median of {result.steps} "
            f"decode steps after {result.warmup} warm-up steps; KV cache {result.kv_dtype or 'the model dtype'} "
            f"({result.kv_bytes_per_token} bytes a token); budgets: device 10%, DRAM 25% of the case's KV, "
            f"SSD all; llama.cpp: {result.llama_cpp}; host {result.host}, device {result.device}\n\n"
            f"Weights {result.weights}: {result.weight_bytes_per_step / 1e6:.0f} MB read per decode step; the "
            f"device's copy bandwidth {result.bandwidth_gb_s:.1f} GB/s (STREAM-like, 1 GiB arrays), so no step takes less "
            f"than {result.weight_bound_ms:.3g} ms (the weights' bound, beside the 'model' column below)")


def table(result: DecodeBenchResult) -> str:
    rows = ["| context | batch | mode | tokens/s | step ms (median / p90) | read MB/token (gpu/dram/ssd) "
            "| prefetch hit/late/wasted | prefilled at open |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    by = _by(result)
    for ctx, b in _cases(result):
        for mode in ORDER:
            r = by.get((ctx, b, mode))
            if r is None:
                continue
            rd = "/".join(f"{r.read_bytes_per_token.get(t, 0) / 1e6:.2f}" for t in ("gpu", "dram", "ssd")) \
                if r.read_bytes_per_token else "-"
            pf = "/".join(str(r.prefetch.get(k, 0)) for k in ("hit", "late", "wasted")) if r.prefetch else "-"
            rows.append(f"| {ctx} | {b} | {mode} | {r.tokens_per_s:.2f} | {r.step_ms:.1f} / {r.step_ms_p90:.1f} "
                        f"| {rd} | {pf} | {r.prefilled_tokens if r.mode not in ('floor', 'llama.cpp') else '-'} |")
    return "\n".join(rows)


def ratios(result: DecodeBenchResult) -> str:
    """kvdrive per case: step / floor, and tokens/s against llama.cpp and each policy."""
    by = _by(result)
    rows = ["| context | batch | kvdrive step / floor step | sparse-gpu / floor | vs llama.cpp | vs ondemand | vs lru "
            "| vs fullfetch | vs full-gpu |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for ctx, b in _cases(result):
        kv = by.get((ctx, b, "kvdrive"))
        if kv is None:
            continue

        def vs(mode: str, ctx: int = ctx, b: int = b, kv: ModeResult = kv) -> str:
            other = by.get((ctx, b, mode))
            return f"{kv.tokens_per_s / other.tokens_per_s:.2f}x" if other else "-"

        floor, gpu = by.get((ctx, b, "floor")), by.get((ctx, b, "sparse-gpu"))
        f = f"{kv.step_ms / floor.step_ms:.2f}" if floor else "-"
        g = f"{gpu.step_ms / floor.step_ms:.2f}" if floor and gpu else "-"
        rows.append(f"| {ctx} | {b} | {f} | {g} | {vs('llama.cpp')} | {vs('ondemand')} | {vs('lru')} | {vs('fullfetch')} "
                    f"| {vs('full-gpu')} |")
    return "\n".join(rows)


def context_independence(result: DecodeBenchResult) -> str:
    by = _by(result)
    ctxs = sorted({r.context for r in result.results})
    rows = ["| batch | " + " | ".join(f"kvdrive tok/s at {c}" for c in ctxs) + " | longest / shortest |",
            "| --- | " + " | ".join("---" for _ in ctxs) + " | --- |"]
    for b in sorted({r.batch for r in result.results}):
        vals = [by.get((c, b, "kvdrive")) for c in ctxs]
        if any(v is None for v in vals):
            continue
        cells = " | ".join(f"{v.tokens_per_s:.2f}" for v in vals if v)
        rows.append(f"| {b} | {cells} | {vals[-1].tokens_per_s / vals[0].tokens_per_s:.2f} |")  # type: ignore[union-attr]
    return "\n".join(rows)


def breakdown(result: DecodeBenchResult) -> str:
    rows = ["| context | batch | mode | step ms | " + " | ".join(PHASES) + " | model | floor step |",
            "| --- | --- | --- | --- | " + " | ".join("---" for _ in PHASES) + " | --- | --- |"]
    by = _by(result)
    for ctx, b in _cases(result):
        floor = by.get((ctx, b, "floor"))
        for mode in SPARSE_ROWS:
            r = by.get((ctx, b, mode))
            if r is None or not r.breakdown_ms:
                continue
            cells = " | ".join(f"{r.breakdown_ms.get(p, 0.0):.1f}" for p in (*PHASES, "model"))
            rows.append(f"| {ctx} | {b} | {mode} | {r.step_ms:.1f} | {cells} | {floor.step_ms:.1f} |" if floor
                        else f"| {ctx} | {b} | {mode} | {r.step_ms:.1f} | {cells} | - |")
    return "\n".join(rows)


def time_to_first_token(result: DecodeBenchResult) -> str:
    """kvdrive's and llama.cpp's time to first token per prompt length, and their ratio in prompt tokens/s."""
    by: dict[tuple[int, str], PrefillResult] = {(p.context, p.engine): p for p in result.prefill}
    rows = ["| prompt tokens | kvdrive s (prompt tok/s) | llama.cpp s (prompt tok/s) | kvdrive vs llama.cpp |",
            "| --- | --- | --- | --- |"]
    for ctx in sorted({p.context for p in result.prefill}):
        kv, lc = by.get((ctx, "kvdrive")), by.get((ctx, "llama.cpp"))
        cell = [f"{p.seconds:.1f} ({p.tokens_per_s:.0f})" if p else "-" for p in (kv, lc)]
        ratio = f"{kv.tokens_per_s / lc.tokens_per_s:.2f}x" if kv and lc else "-"
        rows.append(f"| {ctx} | {cell[0]} | {cell[1]} | {ratio} |")
    return "\n".join(rows)


def markdown(result: DecodeBenchResult) -> str:
    return "\n\n".join([
        "# Decode benchmark", header(result),
        "## kvdrive against the floor, llama.cpp and the other policies", ratios(result),
        "## Context independence", context_independence(result),
        "## Per-step breakdown (ms per decode step; phases are mean, step is median)", breakdown(result),
        *(["## Time to first token (a fresh prompt, nothing of it stored)", time_to_first_token(result)]
          if result.prefill else []),
        "## Every row", table(result)]) + "\n"


def plot(result: DecodeBenchResult, path: str) -> bool:
    """Grouped bars of decode tokens/s per mode for each (context, batch); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cases = _cases(result)
    modes = [m for m in ORDER if any(r.mode == m for r in result.results)]
    by = _by(result)
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / len(modes)
    for i, m in enumerate(modes):
        ys = [by[(c, b, m)].tokens_per_s if (c, b, m) in by else 0.0 for c, b in cases]
        ax.bar([j + i * width for j in range(len(cases))], ys, width, label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], [f"{c // 1024}K · b{b}" for c, b in cases])
    ax.set_ylabel("decode tokens/s (all sequences)")
    ax.set_title(f"{result.model}: decode throughput ({result.threads} threads, token budget {result.token_budget}; "
                 "device 10% / DRAM 25% of KV)", fontsize=10)
    ax.legend(ncol=len(modes), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
