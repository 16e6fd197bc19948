"""Pure parts: quantities, conditions and the drift check of the handlers; module boundaries."""

from __future__ import annotations

import ast
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from crdcheck import load_example
from test_manifests import _cr

from kvdrive.operator.act.handlers import last_written_by_us
from kvdrive.operator.act.objects import AUTOSCALER, RECONCILER
from kvdrive.operator.act.reconciler import statefulset_replicas
from kvdrive.operator.api.quantity import QuantityError, parse_quantity, to_bytes
from kvdrive.operator.decide.conditions import (
    Observed,
    Problem,
    build_status,
    degraded_changed,
    merge_conditions,
)

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


@pytest.mark.parametrize("text", ["0", "8", "64Gi", "2Mi", "1.5Gi", "500m", "1500m", "0.001m", "1G", "1.25k", "3M",
                                  "7T", "2P", "1E", "1Ei", "3Pi", "12.345678901234567890Ti", "99999999999999.99Ei",
                                  "0.5Ki", "123456789012345678901234567890"])
def test_quantities_are_valued_as_the_kubernetes_client_values_them(text: str) -> None:
    from kubernetes.utils import parse_quantity as kubernetes_parse_quantity

    assert str(parse_quantity(text)) == str(kubernetes_parse_quantity(text))


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


def _sources() -> dict[str, Path]:
    """Every module of the operator by its path under operator/ (``act/handlers.py``)."""
    return {p.relative_to(OPERATOR_DIR).as_posix(): p for p in OPERATOR_DIR.rglob("*.py")}


def test_only_handlers_and_its_transport_talk_to_kopf() -> None:
    talkers = {name for name, p in _sources().items() if {"kopf", "aiohttp", "kubernetes"} & _imports(p)}
    # cli only calls kopf.run(); podclient talks HTTP to the pods, not to the API server; login only
    # says where the API server is and with which credentials (a kopf.ConnectionInfo); opmetrics serves
    # the operator's own /metrics over HTTP (aiohttp), to no API server; the reconciler posts its
    # Warning Events and asks Kopf to retry through kopf
    assert talkers == {"act/handlers.py", "act/reconciler.py", "clients/kubeclient.py", "clients/podclient.py",
                       "cli.py", "clients/login.py", "clients/opmetrics.py"}
    users_of_transport = {name for name, p in _sources().items()
                          if "kvdrive.operator.clients.kubeclient" in _imports(p)}
    # objects: only the Ref addresses; pruning: the reconciler's deletions, on the reconciler's session;
    # handlers: only ApiError (a failed reconcile becomes Kopf's TemporaryError)
    assert users_of_transport == {"act/handlers.py", "act/reconciler.py", "act/live.py", "act/objects.py",
                                  "act/pruning.py"}


def test_the_pure_modules_stay_pure() -> None:
    for name in ("decide/tuning.py", "decide/autoscale.py", "api/podmetrics.py", "decide/livestatus.py"):
        imports = _imports(OPERATOR_DIR / name)
        assert not {"kopf", "aiohttp", "asyncio", "kvdrive.operator.clients.kubeclient", "kvdrive.operator.act.live"} & imports, name


def test_modules_stay_small() -> None:
    for name, path in _sources().items():
        assert len(path.read_text().splitlines()) <= 400, name


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
