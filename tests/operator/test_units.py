"""Pure parts: quantities, conditions and the drift check of the handlers; module boundaries."""

from __future__ import annotations

import ast
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from crdcheck import load_example
from test_manifests import _cr

from kvdrive.operator.conditions import Observed, Problem, build_status, degraded_changed, merge_conditions
from kvdrive.operator.handlers import last_written_by_us, statefulset_replicas
from kvdrive.operator.objects import AUTOSCALER, RECONCILER
from kvdrive.operator.quantity import QuantityError, parse_quantity, to_bytes

OPERATOR_DIR = Path(__file__).resolve().parents[2] / "operator"


@pytest.mark.parametrize(
    ("text", "value"),
    [("64Gi", 64 << 30), ("2Mi", 2 << 20), ("1Ti", 1 << 40), ("1.5Gi", 3 << 29), ("8", 8), (8, 8), ("1G", 10**9),
     ("500m", Decimal("0.5")), ("0", 0)],
)
def test_quantities(text: str | int, value: int | Decimal) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "Gi", "-1Gi", "1 Gi", "1gi", "1.Gi", "1e3", True])
def test_bad_quantities(text: object) -> None:
    with pytest.raises(QuantityError):
        parse_quantity(text)  # type: ignore[arg-type]


def test_to_bytes_rounds_up() -> None:
    assert to_bytes("1500m") == 2 and to_bytes("3Mi") == 3 << 20


def test_last_transition_time_moves_only_when_the_status_flips() -> None:
    starting = build_status(name="c", namespace="n", port=8000, observed=Observed(1, 2, 0), problem=None,
                            previous={}, now="t1")
    ready = {c["type"]: c for c in starting["conditions"]}["Ready"]
    assert (ready["status"], ready["lastTransitionTime"]) == ("False", "t1")
    one = build_status(name="c", namespace="n", port=8000, observed=Observed(1, 2, 1), problem=None,
                       previous=starting, now="t2")
    ready = {c["type"]: c for c in one["conditions"]}["Ready"]
    assert (ready["status"], ready["lastTransitionTime"], ready["message"]) == ("False", "t1", "1/2 pods ready")
    two = build_status(name="c", namespace="n", port=8000, observed=Observed(2, 2, 2), problem=None,
                       previous=one, now="t3")
    conditions = {c["type"]: c for c in two["conditions"]}
    assert (conditions["Ready"]["status"], conditions["Ready"]["lastTransitionTime"]) == ("True", "t3")
    assert conditions["Ready"]["observedGeneration"] == 2
    assert conditions["Degraded"]["lastTransitionTime"] == "t1"


def test_degraded_blocks_ready_and_asks_for_one_event() -> None:
    problem = Problem("StorageClassNotFound", "no class")
    status = build_status(name="c", namespace="n", port=8000, observed=Observed(1, 1, 1), problem=problem,
                          previous={}, now="t")
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Degraded"]["status"] == "True" and conditions["Ready"]["status"] == "False"
    assert degraded_changed({}, problem)
    assert not degraded_changed(status, problem)  # same problem again: no second event
    assert degraded_changed(status, Problem("ModelClaimNotFound", "no claim"))
    assert not degraded_changed(status, None)


def test_merge_conditions_without_previous() -> None:
    assert merge_conditions([], [], None, "t") == []


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_only_handlers_and_its_transport_talk_to_kopf() -> None:
    talkers = {p.name for p in OPERATOR_DIR.glob("*.py") if {"kopf", "aiohttp", "kubernetes"} & _imports(p)}
    # cli only calls kopf.run(); podclient talks HTTP to the pods, not to the API server; login only
    # says where the API server is and with which credentials (a kopf.ConnectionInfo); opmetrics serves
    # the operator's own /metrics over HTTP (aiohttp), to no API server
    assert talkers == {"handlers.py", "kubeclient.py", "podclient.py", "cli.py", "login.py", "opmetrics.py"}
    users_of_transport = {p.name for p in OPERATOR_DIR.glob("*.py") if "kvdrive.operator.kubeclient" in _imports(p)}
    # objects: only the Ref addresses; pruning: the handlers' deletions, on the handlers' session
    assert users_of_transport == {"handlers.py", "live.py", "objects.py", "pruning.py"}


def test_the_pure_modules_stay_pure() -> None:
    for name in ("tuning.py", "autoscale.py", "podmetrics.py", "livestatus.py"):
        imports = _imports(OPERATOR_DIR / name)
        assert not {"kopf", "aiohttp", "asyncio", "kvdrive.operator.kubeclient", "kvdrive.operator.live"} & imports, name


def test_modules_stay_small() -> None:
    for path in OPERATOR_DIR.glob("*.py"):
        assert len(path.read_text().splitlines()) <= 400, path.name


def _managed(manager: str) -> dict[str, Any]:
    return {"metadata": {"managedFields": [{"manager": manager, "operation": "Apply",
                                            "fieldsV1": {"f:spec": {"f:replicas": {}}}}]},
            "spec": {"replicas": 4}}


def test_one_writer_of_statefulset_replicas_per_mode() -> None:
    """Modes none/external: the reconciler applies spec.replicas. Mode operator: it applies minReplicas at
    creation, keeps applying the current count while it still owns the field (so that SSA does not delete
    it), and leaves it out once the autoscaler's manager has taken it."""
    minimal = load_example("minimal.yaml")
    assert statefulset_replicas(_cr(minimal, replicas=3), _managed(AUTOSCALER)) == 3
    assert statefulset_replicas(_cr(minimal, replicas=3, autoscaling={"mode": "external"}), None) == 3
    operator = _cr(minimal, autoscaling={"mode": "operator", "minReplicas": 2, "maxReplicas": 5})
    assert statefulset_replicas(operator, None) == 2
    assert statefulset_replicas(operator, _managed(RECONCILER)) == 4
    assert statefulset_replicas(operator, _managed(AUTOSCALER)) is None


def test_only_changes_by_others_call_for_a_reconcile() -> None:
    """A child's MODIFIED event whose newest change is the operator's own apply needs no reconcile; one
    by anybody else (or at the same second as ours: managedFields times are to the second) does."""
    ours = {"manager": RECONCILER, "operation": "Apply", "time": "2026-12-01T10:00:05Z"}
    kubectl = {"manager": "kubectl-edit", "operation": "Update", "time": "2026-12-01T10:00:01Z"}
    status = {"manager": "kube-controller-manager", "operation": "Update", "time": "2026-12-01T10:00:09Z",
              "subresource": "status"}
    assert last_written_by_us({"metadata": {"managedFields": [kubectl, ours, status]}})
    assert not last_written_by_us({"metadata": {"managedFields": [ours, {**kubectl, "time": "2026-12-01T10:00:07Z"}]}})
    assert not last_written_by_us({"metadata": {"managedFields": [ours, {**kubectl, "time": ours["time"]}]}})
    assert not last_written_by_us({"metadata": {}})
