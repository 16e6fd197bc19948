"""spec.tiers.shared, the KV tier every pod of a CR shares on a Valkey/Redis cluster the user runs: what the pods
get (the ``kvdrive serve --shared-tier*`` flags, the Secrets' keys as files, never the password itself), and what
the status shows of it (where the pods reach it, which pods report it degraded, the condition
``SharedTierDegraded`` the live loop owns beside the reconciler's)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml
from crdcheck import load_example

from kvdrive.operator.api.cr import KVDriveDeployment, parse_cr
from kvdrive.operator.api.podmetrics import PodMetrics, Scrape, TierState, parse_metrics
from kvdrive.operator.api.status import KVDriveStatus
from kvdrive.operator.decide.conditions import Observed, build_status, merge_conditions, status_differs
from kvdrive.operator.decide.livestatus import (
    live_status_differs,
    pod_entry,
    shared_tier_condition,
    shared_tier_status,
)
from kvdrive.operator.decide.tuning import PodHistory
from kvdrive.operator.render.manifests import render

SERVICE = {"service": {"name": "valkey"}, "namespace": "fleet", "user": "kvdrive",
           "authSecretRef": {"name": "valkey-auth", "key": "valkey-password"},
           "tls": {"enabled": True, "caSecretRef": {"name": "valkey-crt"}}, "timeoutMs": 250}


def _cr(shared: dict[str, Any] | None, namespace: str = "inference") -> KVDriveDeployment:
    doc = load_example("minimal.yaml")
    doc["metadata"] = {**doc["metadata"], "namespace": namespace, "uid": "0b0c8e2e-1111-2222-3333-444455556666"}
    if shared is not None:
        doc["spec"] = {**doc["spec"], "tiers": {"shared": shared}}
    return parse_cr(doc)


def _children(cr: KVDriveDeployment) -> dict[str, dict[str, Any]]:
    return {c["kind"]: c for c in render(cr, "t0ken") if c["kind"] in ("StatefulSet", "ConfigMap")}


def _flags(args: list[str]) -> list[str]:
    return args[args.index("--shared-tier"):] if "--shared-tier" in args else []


def test_a_service_with_auth_and_tls_becomes_a_valkeys_url_and_files() -> None:
    kinds = _children(_cr(SERVICE))
    pod = kinds["StatefulSet"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert _flags(container["args"]) == [
        "--shared-tier", "valkeys://valkey.inference.svc:6379",  # the CR's namespace, the default port
        "--shared-tier-namespace", "fleet", "--shared-tier-user", "kvdrive",
        "--shared-tier-auth-file", "/var/run/kvdrive/shared-tier/auth/password",
        "--shared-tier-ca-file", "/var/run/kvdrive/shared-tier/ca/ca.crt", "--shared-tier-timeout-ms", "250"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["shared-tier-auth"]["secret"] == {
        "secretName": "valkey-auth", "items": [{"key": "valkey-password", "path": "password"}], "defaultMode": 0o440}
    assert volumes["shared-tier-ca"]["secret"] == {
        "secretName": "valkey-crt", "items": [{"key": "ca.crt", "path": "ca.crt"}], "defaultMode": 0o440}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    for name, flag in (("shared-tier-auth", "--shared-tier-auth-file"), ("shared-tier-ca", "--shared-tier-ca-file")):
        args = container["args"]
        assert mounts[name]["readOnly"] is True
        assert args[args.index(flag) + 1] == f"{mounts[name]['mountPath']}/{volumes[name]['secret']['items'][0]['path']}"
        # not inside another mount (the ConfigMap's at /etc/kvdrive is read-only: no mount point can be made there)
        assert not any(mounts[name]["mountPath"].startswith(m["mountPath"] + "/") for m in container["volumeMounts"])
    for version in ("1.30", "1.33"):
        kubernetes_validate.validate(kinds["StatefulSet"], version, strict=True)


def test_the_configmap_carries_the_same_settings_and_no_password_anywhere() -> None:
    kinds = _children(_cr(SERVICE))
    config = yaml.safe_load(kinds["ConfigMap"]["data"]["config.yaml"])
    flags = _flags(kinds["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]["args"])
    assert {f"--{k.replace('_', '-')}": str(v) for k, v in config.items() if k.startswith("shared_tier")} == dict(
        zip(flags[::2], flags[1::2], strict=True))
    container = kinds["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]
    assert "env" not in container and "envFrom" not in container  # the password only as a mounted file


@pytest.mark.parametrize(("shared", "url"), [
    ({"endpoints": ["valkey-0.valkey:6379", "valkey-1.valkey:6379", "10.0.0.7:7000"]},
     "valkey://valkey-0.valkey:6379,valkey-1.valkey:6379,10.0.0.7:7000"),
    ({"service": {"name": "valkey", "namespace": "valkey", "port": 7000}}, "valkey://valkey.valkey.svc:7000"),
    ({"service": {"name": "valkey"}, "tls": {"enabled": True}}, "valkeys://valkey.inference.svc:6379"),
])
def test_where_the_servers_are_and_the_defaults(shared: dict[str, Any], url: str) -> None:
    kinds = _children(_cr(shared))
    pod = kinds["StatefulSet"]["spec"]["template"]["spec"]
    assert _flags(pod["containers"][0]["args"]) == ["--shared-tier", url, "--shared-tier-namespace", "default",
                                                    "--shared-tier-timeout-ms", "500"]
    assert not {"shared-tier-auth", "shared-tier-ca"} & {v["name"] for v in pod["volumes"]}  # no Secret named


def test_without_a_shared_tier_the_pods_are_as_before_and_adding_one_rolls_them() -> None:
    plain, shared = _children(_cr(None)), _children(_cr(SERVICE))
    pod = plain["StatefulSet"]["spec"]["template"]
    assert not any(a.startswith("--shared-tier") for a in pod["spec"]["containers"][0]["args"])
    assert not any(v["name"].startswith("shared-tier") for v in pod["spec"]["volumes"])
    assert "shared_tier" not in yaml.safe_load(plain["ConfigMap"]["data"]["config.yaml"])
    after = shared["StatefulSet"]["spec"]["template"]["metadata"]["annotations"]
    assert pod["metadata"]["annotations"]["kvdrive.io/config-hash"] != after["kvdrive.io/config-hash"]


# status

GAUGE = """# TYPE kvdrive_requests_waiting gauge
kvdrive_requests_waiting 0.0
kvdrive_tier_budget_bytes{tier="gpu"} 8.388608e+06
"""


def test_a_pods_metrics_say_whether_its_shared_tier_is_degraded() -> None:
    assert parse_metrics(GAUGE).shared_tier_degraded is None  # no shared tier (or a runtime without one)
    assert parse_metrics(GAUGE + "# TYPE kvdrive_shared_tier_degraded gauge\nkvdrive_shared_tier_degraded 1.0\n"
                         ).shared_tier_degraded is True
    assert parse_metrics(GAUGE + "kvdrive_shared_tier_degraded 0\n").shared_tier_degraded is False


def _entry(name: str, degraded: bool | None) -> dict[str, Any]:
    metrics = PodMetrics(tiers={"gpu": TierState(budget=1, used=0)}, shared_tier_degraded=degraded)
    history = PodHistory().add(Scrape(1.0, metrics), keep=4)
    return pod_entry(name, history.scrapes[-1], history, "t", None)


def test_status_names_the_degraded_pods_and_the_condition_says_they_keep_serving() -> None:
    entries = [_entry("chat-0", False), _entry("chat-1", True), _entry("chat-2", True)]
    assert [e["sharedTier"] for e in entries] == ["ok", "degraded", "degraded"]
    shared = _cr(SERVICE).spec.tiers.shared
    assert shared is not None
    assert shared_tier_status(shared, "inference", entries) == {
        "url": "valkeys://valkey.inference.svc:6379", "namespace": "fleet", "tls": True,
        "degradedPods": ["chat-1", "chat-2"]}
    condition = shared_tier_condition(entries)
    assert (condition.type, condition.status, condition.reason) == ("SharedTierDegraded", "True", "CircuitOpen")
    assert condition.message.startswith("2/3 pods report the shared tier degraded")
    assert condition.message.endswith(": chat-1, chat-2") and "keep serving" in condition.message
    healthy = shared_tier_condition(entries[:1])
    assert (healthy.status, healthy.reason, healthy.message) == ("False", "Reachable", "1/1 pods reach the shared tier")
    # a pod that does not report it (an older runtime) is neither; none reporting is Unknown
    assert "sharedTier" not in _entry("chat-3", None)
    assert shared_tier_condition([_entry("chat-3", None)]).status == "Unknown"
    assert shared_tier_condition([]).status == "Unknown"


def _live(conditions: list[dict[str, Any]] | None, shared: bool = True) -> dict[str, Any]:
    status: dict[str, Any] = {"pods": [], "recommendations": [], "budgets": {"gpu": "1", "dram": "", "ssd": ""},
                              "maxRunning": "16", "autoscaling": {"mode": "none"}}
    if shared:
        status["sharedTier"] = {"url": "valkey://v:1", "namespace": "default", "tls": False, "degradedPods": []}
        status["conditions"] = conditions
    return status


def test_the_reconciler_and_the_live_loop_each_judge_only_their_own_conditions() -> None:
    """status.conditions is a map list: the reconciler owns Ready/Progressing/Degraded (and RouterReady), the
    live loop SharedTierDegraded. Neither rewrites the status for the other's items, and a status holding both
    is the shape the CRD's status schema takes."""
    reconciled = build_status(name="chat", namespace="ns", port=8000, observed=Observed(1, 1, 1), problem=None,
                              previous={}, now="t0")
    shared = merge_conditions([], [shared_tier_condition([_entry("chat-0", True)])], 1, "t0")
    both = {**reconciled, **_live(shared), "conditions": reconciled["conditions"] + shared}
    KVDriveStatus.model_validate(both)
    again = build_status(name="chat", namespace="ns", port=8000, observed=Observed(1, 1, 1), problem=None,
                         previous=both, now="t1")
    assert not status_differs(both, again)  # the live loop's item is not the reconciler's to drop
    assert not live_status_differs(both, _live(shared))  # nor the reconciler's the live loop's
    # the tier recovers: the live loop writes its condition (lastTransitionTime moves with the status)
    recovered = merge_conditions(shared, [shared_tier_condition([_entry("chat-0", False)])], 1, "t2")
    assert live_status_differs(both, _live(recovered)) and recovered[0]["lastTransitionTime"] == "t2"
    # the shared tier is removed from the spec: the live loop applies once more without its key and condition
    # (server-side apply removes what its manager stops applying), then has nothing more to write
    assert live_status_differs(both, _live(None, shared=False))
    assert not live_status_differs(reconciled | _live(None, shared=False), _live(None, shared=False))
