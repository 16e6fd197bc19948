"""Pure rendering of ``spec.tiers.shared`` into what the runtime pods get: the ``kvdrive serve --shared-tier*``
flags (and the same settings for the ConfigMap), and the Secrets' keys mounted as files for the password and
the CA bundle.

Owns the store's URL as the runtime reads it (``valkey://HOST:PORT[,HOST:PORT...]``, ``valkeys://`` with TLS;
a Service as ``NAME.NAMESPACE.svc:PORT``) and where the files are. The password never enters the pod's
arguments, environment or ConfigMap: only its file's path does. No Kubernetes API here.
"""

from __future__ import annotations

from typing import Any

from kvdrive.operator.api.sharedtierspec import SharedTier
from kvdrive.operator.api.spec import KVDriveSpec

# beside the admin token's folder, not under /etc/kvdrive: a mount inside the read-only ConfigMap mount
# would need its mount point created in a read-only volume
SHARED_TIER_DIR = "/var/run/kvdrive/shared-tier"
AUTH_VOLUME = "shared-tier-auth"  # podsettings.RESERVED_VOLUMES
CA_VOLUME = "shared-tier-ca"
AUTH_FILE = f"{SHARED_TIER_DIR}/auth/password"
CA_FILE = f"{SHARED_TIER_DIR}/ca/ca.crt"


def servers(shared: SharedTier, namespace: str) -> list[str]:
    """HOST:PORT of each server the pods are given (``namespace``: the CR's, for a Service in it)."""
    if shared.endpoints is not None:
        return list(shared.endpoints)
    assert shared.service is not None  # the model requires one of them
    service = shared.service
    return [f"{service.name}.{service.namespace or namespace}.svc:{service.port}"]


def url(shared: SharedTier, namespace: str) -> str:
    """``--shared-tier``: the servers, plain (``valkey://``) or TLS (``valkeys://``)."""
    scheme = "valkeys" if shared.tls.enabled else "valkey"
    return f"{scheme}://{','.join(servers(shared, namespace))}"


def settings(spec: KVDriveSpec, namespace: str) -> dict[str, Any]:
    """The runtime's shared-tier settings (flags and ConfigMap agree); empty without a shared tier."""
    shared = spec.tiers.shared
    if shared is None:
        return {}
    found: dict[str, Any] = {"shared_tier": url(shared, namespace), "shared_tier_namespace": shared.namespace}
    if shared.user is not None:
        found["shared_tier_user"] = shared.user
    if shared.auth_secret_ref is not None:
        found["shared_tier_auth_file"] = AUTH_FILE
    if shared.tls.ca_secret_ref is not None:
        found["shared_tier_ca_file"] = CA_FILE
    found["shared_tier_timeout_ms"] = shared.timeout_ms
    return found


def args(spec: KVDriveSpec, namespace: str) -> list[str]:
    """The ``kvdrive serve`` flags of ``settings``, in its order."""
    out: list[str] = []
    for key, value in settings(spec, namespace).items():
        out += [f"--{key.replace('_', '-')}", str(value)]
    return out


def volumes(spec: KVDriveSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The Secrets' keys as files, read-only and readable by the pod's group only (as the admin token):
    ``(volumes, mounts)``, none without a shared tier or its Secrets."""
    shared = spec.tiers.shared
    if shared is None:
        return [], []
    found: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    for volume, ref, path in ((AUTH_VOLUME, shared.auth_secret_ref, AUTH_FILE),
                              (CA_VOLUME, shared.tls.ca_secret_ref, CA_FILE)):
        if ref is None:
            continue
        folder, file = path.rsplit("/", 1)
        found.append({"name": volume, "secret": {"secretName": ref.name, "items": [{"key": ref.key, "path": file}],
                                                 "defaultMode": 0o440}})
        mounts.append({"name": volume, "mountPath": folder, "readOnly": True})
    return found, mounts
