"""spec.tiers.shared, the KV tier every pod of a CR shares on a Valkey/Redis cluster the user runs: what the pods
get (the ``kvdrive serve --shared-tier*`` flags, the Secrets' keys as files, never the password itself)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml
from crdcheck import load_example

from kvdrive.operator.api.cr import KVDriveDeployment, parse_cr
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
