"""Fixtures of the chart tests: the operator test harness (tests/operator, on sys.path from tests/conftest.py)."""

from kopfenv import cluster

__all__ = ["cluster"]
