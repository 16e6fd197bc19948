"""Pure parts: quantities, conditions and the drift check of the handlers; module boundaries."""

from __future__ import annotations

import ast
from decimal import Decimal
from pathlib import Path

import pytest

from kvdrive.operator.conditions import Observed, Problem, build_status, degraded_changed, merge_conditions
from kvdrive.operator.handlers import is_subset
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


def test_is_subset_tolerates_server_defaults_but_not_changes() -> None:
    desired = {"spec": {"containers": [{"name": "a", "args": ["x"]}], "limits": {"nvidia.com/gpu": "1"}}}
    defaulted = {"spec": {"containers": [{"name": "a", "args": ["x"], "terminationMessagePath": "/dev/t"}],
                          "limits": {"nvidia.com/gpu": "1"}, "dnsPolicy": "ClusterFirst"}}
    assert is_subset(desired, defaulted)
    assert not is_subset(desired, {"spec": {"containers": [{"name": "a", "args": ["y"]}], "limits": {}}})
    assert not is_subset(desired, {"spec": {"containers": [], "limits": {"nvidia.com/gpu": "1"}}})
    assert is_subset({"replicas": 1}, {"replicas": 1}) and not is_subset({"replicas": 1}, {"replicas": 2})


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
    # cli only calls kopf.run(); podclient talks HTTP to the pods, not to the API server
    assert talkers == {"handlers.py", "kubeapi.py", "podclient.py", "cli.py"}
    users_of_transport = {p.name for p in OPERATOR_DIR.glob("*.py") if "kvdrive.operator.kubeapi" in _imports(p)}
    assert users_of_transport == {"handlers.py", "live.py", "objects.py"}  # objects: only the Ref addresses


def test_the_pure_modules_stay_pure() -> None:
    for name in ("tuning.py", "autoscale.py", "podmetrics.py", "livestatus.py"):
        imports = _imports(OPERATOR_DIR / name)
        assert not {"kopf", "aiohttp", "asyncio", "kvdrive.operator.kubeapi", "kvdrive.operator.live"} & imports, name


def test_modules_stay_small() -> None:
    for path in OPERATOR_DIR.glob("*.py"):
        assert len(path.read_text().splitlines()) <= 400, path.name
