"""The router's part of the status (pure): ``status.router``, ``RouterReady``, and ``Ready`` that needs
the clients' way in; all of it gone again when routing is turned off."""

from __future__ import annotations

from typing import Any

from kvdrive.operator.api.cr import routing_of
from kvdrive.operator.api.status import KVDriveStatus
from kvdrive.operator.decide.conditions import Observed, Problem, RouterObserved, build_status, status_differs


def _status(observed: Observed, previous: dict[str, Any] | None = None, problem: Problem | None = None,
            now: str = "t1") -> dict[str, Any]:
    return build_status(name="chat", namespace="ns", port=8000, observed=observed, problem=problem,
                        previous=previous or {}, now=now)


def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_routing_off_has_no_router_status() -> None:
    status = _status(Observed(1, 2, 2))
    assert "router" not in status and set(_conditions(status)) == {"Ready", "Progressing", "Degraded"}
    assert _conditions(status)["Ready"]["status"] == "True"


def test_no_router_pod_ready_because_no_replica_is_names_the_reason() -> None:
    status = _status(Observed(1, 1, 0, RouterObserved(desired=2, ready=0)))
    assert status["router"] == {"ready": 0, "desired": 2}
    router = _conditions(status)["RouterReady"]
    assert (router["status"], router["reason"]) == ("False", "NoReplicaReady")
    assert "0/2 router pods ready" in router["message"] and "0/1 replicas are ready" in router["message"]
    assert _conditions(status)["Ready"]["status"] == "False"
    KVDriveStatus.model_validate(status)  # the shape the CRD's status schema and the model agree on


def test_ready_needs_every_router_pod() -> None:
    replicas_ready = _status(Observed(1, 2, 2, RouterObserved(desired=2, ready=1)))
    ready, router = _conditions(replicas_ready)["Ready"], _conditions(replicas_ready)["RouterReady"]
    assert (router["status"], router["reason"]) == ("False", "RouterPodsNotReady")
    assert "1/2 router pods ready" in router["message"]
    assert (ready["status"], ready["reason"]) == ("False", "RouterNotReady")
    assert "2/2 pods ready" in ready["message"] and "1/2 router pods ready" in ready["message"]
    assert _conditions(replicas_ready)["Progressing"]["reason"] == "RouterStarting"
    all_ready = _status(Observed(1, 2, 2, RouterObserved(desired=2, ready=2)), previous=replicas_ready, now="t2")
    conditions = _conditions(all_ready)
    assert conditions["Ready"]["status"] == conditions["RouterReady"]["status"] == "True"
    assert conditions["RouterReady"]["reason"] == "AllRouterPodsReady"
    assert conditions["RouterReady"]["lastTransitionTime"] == "t2"
    assert conditions["Degraded"]["lastTransitionTime"] == "t1"


def test_a_problem_blocks_the_router_too() -> None:
    status = _status(Observed(1, 1, 1, RouterObserved(2, 2)), problem=Problem("StorageClassNotFound", "no class"))
    router = _conditions(status)["RouterReady"]
    assert (router["status"], router["reason"], router["message"]) == ("False", "StorageClassNotFound", "no class")


def test_turning_routing_off_rewrites_the_status() -> None:
    """The reconciler writes only when its part changed: a key it stops writing is a change (else
    ``status.router`` and ``RouterReady`` would stay on the CR for ever)."""
    routed = _status(Observed(1, 1, 1, RouterObserved(2, 2)))
    plain = _status(Observed(1, 1, 1), previous=routed)
    assert "router" not in plain and "RouterReady" not in _conditions(plain)
    assert status_differs(routed, plain)
    assert not status_differs(plain, _status(Observed(1, 1, 1), previous=plain))


def test_routing_of_a_raw_spec() -> None:
    assert routing_of({"routing": {"mode": "prefix", "replicas": 3}}).replicas == 3
    assert routing_of({}).mode == "none" and routing_of(None).mode == "none"
    assert routing_of({"routing": {"mode": "bogus"}}).mode == "none"  # the status never fails on a bad spec
