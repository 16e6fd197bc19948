"""Fixtures of the operator tests (defined in kopfenv.py and giecrd.py, importable without name clashes)."""

from giecrd import gie_crd, no_gie_crd
from kopfenv import cluster, operator

__all__ = ["cluster", "gie_crd", "no_gie_crd", "operator"]
