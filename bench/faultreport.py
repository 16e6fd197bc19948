"""The fault bench's table: one row per scenario (its answers, the faults /metrics counted, /readyz, the
server log's fault lines) and the distinct errors clients saw, from the JSON the scenarios wrote.
"""

from __future__ import annotations

from typing import Any

MiB = 1 << 20


def faults_cell(p: dict[str, Any]) -> str:
    f = ", ".join(f"{k} {int(v)}" for k, v in p["faults"].items()) or "none"
    d = ", ".join(k for k, v in p["degraded"].items() if v) or "none"
    return f"{f}; degraded: {d}"


def readyz_cell(p: dict[str, Any]) -> str:
    b = p["readyz"]["body"]
    if isinstance(b, dict):
        why = "; ".join(f"{k}: {v}" for k, v in b.get("degraded", {}).items())
        return f"{p['readyz']['status']} {b.get('status')}" + (f" ({why})" if why else "")
    return f"{p['readyz']['status']} {str(b)[:80]}"


def logs_cell(lg: dict[str, Any]) -> str:
    parts = [f"{k}: {v['lines']} lines, {v['per_10s_window']}/10 s, max {v['max_in_any_10s']} in 10 s"
             for k, v in lg["fault_lines"].items()]
    return ("; ".join(parts) or "no fault lines") + f" ({lg['duration_s']} s; {lg['warning_error_lines']} warn/error)"


def served_cell(s: dict[str, Any]) -> str:
    status = ", ".join(f"{k}: {v}" for k, v in sorted(s["status"].items()))
    return f"{s['identical']}/{s['requests']} identical; status {status}; 5xx {s['http_5xx']}"


def scenario_row(title: str, s: dict[str, Any], served: str, extra: str) -> tuple[str, ...]:
    """One scenario's table row: its answers (``s[served]``), then what /metrics, /readyz and the log said."""
    return (title, served_cell(s[served]), faults_cell(s["probe_end"]), readyz_cell(s["probe_end"]),
            logs_cell(s["log"]), extra)


def markdown(res: dict[str, Any]) -> str:
    rows = []
    s1 = res.get("deleted_slabs")
    if isinstance(s1, dict) and "after_restart" in s1:
        extra = (f"index blocks {s1['index_blocks_before_stop']} -> {s1['index_blocks_after_restart']}; ready "
                 f"{s1['ready_s']['first_start']} s / restart {s1['ready_s']['restart']} s; latency after restart "
                 f"p50 {s1['after_restart']['latency_s'].get('p50')} s, max {s1['after_restart']['latency_s'].get('max')} s "
                 f"(first run max {s1['first_run']['latency_s'].get('max')} s)")
        rows.append(scenario_row("1 deleted slabs + restart", s1, "after_restart", extra))
    s2 = res.get("disk_full")
    if isinstance(s2, dict) and "load" in s2:
        extra = (f"{s2['disk']['free_at_server_start'] // MiB} MiB free at start; ssd capacity "
                 f"{(s2['probe_start']['ssd_capacity_bytes'] or 0) // MiB} MiB; latency p50 "
                 f"{s2['load']['latency_s'].get('p50')} s max {s2['load']['latency_s'].get('max')} s")
        rows.append(scenario_row("2 disk full", s2, "load", extra))
    s3 = res.get("eio")
    if isinstance(s3, dict) and "load" in s3:
        extra = (f"{s3['device']['fraction_past_cut']} of slab bytes past the cut; latency p50 "
                 f"{s3['load']['latency_s'].get('p50')} s max {s3['load']['latency_s'].get('max')} s; "
                 f"stop exit {s3['stop'].get('exit')} in {s3['stop'].get('seconds')} s")
        rows.append(scenario_row("3 EIO (loop device shrunk)", s3, "load", extra))
    head = "| scenario | served | faults in /metrics | /readyz | fault log lines | other |\n| --- | --- | --- | --- | --- | --- |\n"
    body = "".join("| " + " | ".join(c.replace("|", "/") for c in r) + " |\n" for r in rows)
    errors = [f"- {name}: {n} x `{msg}`\n" for name in ("deleted_slabs", "disk_full", "eio")
              for part in ("after_restart", "load") if isinstance(res.get(name), dict) and part in res[name]
              for msg, n in res[name][part]["errors"].items()]
    if errors:
        body += "\nNon-200 answers:\n" + "".join(errors)
    failed = {k: v for k, v in res.items() if isinstance(v, dict) and "error" in v}
    tail = "".join(f"\n**{k} failed**: {v['error']}\n" for k, v in failed.items())
    return f"# Fault scenarios\n\n`{res['command']}`\n\n{head}{body}{tail}"
