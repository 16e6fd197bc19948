"""The operator's own metrics: a reconcile is counted and timed by its result (an exception counts as
``error`` and still propagates), and every Event the live loop posts counts as a decision by its reason."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvdrive.operator.clients.opmetrics import OperatorMetrics


def _samples(metrics: OperatorMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}


async def test_reconciles_are_counted_and_timed_by_result() -> None:
    metrics = OperatorMetrics()
    async with metrics.reconcile() as result:
        result.append("InvalidSpec")
    async with metrics.reconcile():
        pass
    with pytest.raises(RuntimeError):
        async with metrics.reconcile() as result:
            raise RuntimeError("the API server went away")
    samples = _samples(metrics)
    for outcome in ("InvalidSpec", "ok", "error"):
        assert samples[("kvdrive_operator_reconciles_total", (("result", outcome),))] == 1
        assert samples[("kvdrive_operator_reconcile_seconds_count", (("result", outcome),))] == 1


def test_posted_events_count_as_decisions() -> None:
    metrics, posted = OperatorMetrics(), []

    def post(cr: dict[str, Any], kind: str, reason: str, message: str) -> None:
        posted.append(reason)

    counting = metrics.counting(post)
    for reason in ("ConcurrencyChanged", "ConcurrencyChanged", "ScaleConflict"):
        counting({}, "Normal", reason, "m")
    assert posted == ["ConcurrencyChanged", "ConcurrencyChanged", "ScaleConflict"]  # still posted
    samples = _samples(metrics)
    assert samples[("kvdrive_operator_decisions_total", (("reason", "ConcurrencyChanged"),))] == 2
    assert samples[("kvdrive_operator_decisions_total", (("reason", "ScaleConflict"),))] == 1
