"""The fault bench's reading of a server log: fault lines per kind, and how many fell in any 10 s window.

The requirement it checks: at most one log line per fault kind per 10 s (``FaultLog``'s rate limit), and
every WARNING/ERROR line grouped by its template, so that a flood of any kind stands out.
"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path
from typing import Any

LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\w+) ([\w.]+): (.*)$")
FAULT_LINE = re.compile(r"failed: .* \(([A-Z][A-Z0-9]*)\)(?: \(\+\d+ more \S+ faults in the last \d+ s\))?$")


def parse_log(path: Path) -> list[tuple[float, str, str]]:
    """(unix time, level, message) of each log line (continuation lines are skipped)."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        m = LOG_LINE.match(line)
        if m:
            when = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((when, m.group(2), m.group(4)))
    return out


def fault_kind(message: str) -> str | None:
    if "failed its CRC" in message:
        return "crc"
    m = FAULT_LINE.search(message)
    return m.group(1) if m else None


def max_in_window(times: list[float], window: float = 10.0) -> int:
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while t - times[lo] >= window:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def template(message: str) -> str:
    return re.sub(r"\d+(\.\d+)?", "N", message)[:160]


def log_report(path: Path, since: float, until: float) -> dict[str, Any]:
    """Fault lines per kind (and every WARNING/ERROR template) logged in [since, until]."""
    lines = [entry for entry in parse_log(path) if since - 1 <= entry[0] <= until + 1]
    duration = max(until - since, 1e-9)
    windows = duration / 10.0
    kinds: dict[str, list[float]] = {}
    templates: dict[str, list[float]] = {}
    for when, level, message in lines:
        if (kind := fault_kind(message)) is not None:
            kinds.setdefault(kind, []).append(when)
        if level in ("WARNING", "ERROR", "CRITICAL"):
            templates.setdefault(f"{level} {template(message)}", []).append(when)
    per_kind = {k: {"lines": len(v), "per_10s_window": round(len(v) / windows, 2), "max_in_any_10s": max_in_window(v),
                    "ok": max_in_window(v) <= 1} for k, v in sorted(kinds.items())}
    top = sorted(templates.items(), key=lambda kv: -len(kv[1]))[:12]
    return {
        "duration_s": round(duration, 1), "windows_10s": round(windows, 2), "fault_lines": per_kind,
        "warning_error_lines": sum(len(v) for v in templates.values()),
        "by_template": [{"line": k, "count": len(v), "max_in_any_10s": max_in_window(v)} for k, v in top],
        "fault_excerpt": [m for _, _, m in lines if fault_kind(m)][:6],
        "tracebacks": path.read_text(errors="replace").count("Traceback"), "total_lines": len(lines),
    }
