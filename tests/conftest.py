"""Session-wide fixtures: one real control plane (etcd + kube-apiserver) for the whole test session,
shared by the operator and chart tests (each test gets its own namespace)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "operator"))

from controlplane import control_plane

__all__ = ["control_plane"]
