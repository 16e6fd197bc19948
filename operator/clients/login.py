"""How the operator logs in to the API server.

In a pod: as client-go's in-cluster config does, through the ``KUBERNETES_SERVICE_HOST`` /
``KUBERNETES_SERVICE_PORT`` variables the kubelet injects, with the pod's ServiceAccount token and
CA. Kopf's own ``login_with_service_account`` dials ``https://kubernetes.default.svc`` instead,
which needs cluster DNS: on a cluster without it (the one-node e2e cluster) the operator never
connected. Outside a pod: Kopf's service-account login, then the local kubeconfig.

The token is read at every login: Kopf logs in again when the API server answers 401, which is
what picks up a rotated (projected) token.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import kopf

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def in_cluster(account_dir: Path = SERVICE_ACCOUNT_DIR) -> kopf.ConnectionInfo | None:
    """The pod's ServiceAccount at the address the kubelet gave it; None outside a pod."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "")
    token_path = account_dir / "token"
    if not host or not port or not token_path.is_file():
        return None
    if ":" in host:  # an IPv6 ClusterIP
        host = f"[{host}]"
    ca = account_dir / "ca.crt"
    namespace = account_dir / "namespace"
    return kopf.ConnectionInfo(
        server=f"https://{host}:{port}",
        ca_path=str(ca) if ca.is_file() else None,
        token=token_path.read_text().strip(),
        default_namespace=namespace.read_text().strip() if namespace.is_file() else None,
    )


def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """Production login: in-cluster, else Kopf's service-account login, else the local kubeconfig."""
    return in_cluster() or kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
