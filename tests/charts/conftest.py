"""Fixtures of the chart tests: the operator test harness (tests/operator, on sys.path from tests/conftest.py)."""

from giecrd import gie_crd
from kopfenv import cluster

__all__ = ["cluster", "gie_crd"]
