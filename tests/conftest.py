"""Session-wide fixtures: one real control plane (etcd + kube-apiserver) for the whole test session, shared by
the operator and chart tests (each test gets its own namespace), and the models the runtime's tests run on
(``tests/kits/modelkit.py``). ``tests/kits`` holds the helpers every folder shares (one tiered engine:
``enginekit``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "operator"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "kits"))

from controlplane import control_plane
from modelkit import demo, hf_model_factory, tiny

__all__ = ["control_plane", "demo", "hf_model_factory", "tiny"]
