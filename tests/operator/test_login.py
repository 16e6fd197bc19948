"""In a pod the operator reaches the API server as client-go does: through the address the kubelet
injects (KUBERNETES_SERVICE_HOST/PORT), with the pod's ServiceAccount, never through cluster DNS."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdrive.operator.clients.login import in_cluster


def _account(tmp_path: Path, token: str = "t0ken\n") -> Path:
    (tmp_path / "token").write_text(token)
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "namespace").write_text("kvdrive-system")
    return tmp_path


def test_the_kubelet_injected_address_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    info = in_cluster(_account(tmp_path))
    assert info is not None
    assert info.server == "https://10.0.0.1:443"  # not https://kubernetes.default.svc
    assert info.token == "t0ken" and info.ca_path == str(tmp_path / "ca.crt")
    assert info.default_namespace == "kvdrive-system"


def test_an_ipv6_service_address_is_bracketed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    info = in_cluster(_account(tmp_path))
    assert info is not None and info.server == "https://[fd00::1]:6443"


def test_a_rotated_token_is_read_at_the_next_login(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    account = _account(tmp_path)
    assert in_cluster(account).token == "t0ken"  # type: ignore[union-attr]
    (account / "token").write_text("rotated")
    assert in_cluster(account).token == "rotated"  # type: ignore[union-attr]


def test_outside_a_pod_there_is_no_in_cluster_login(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    assert in_cluster(_account(tmp_path)) is None
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    assert in_cluster(tmp_path / "missing") is None  # no token mounted
