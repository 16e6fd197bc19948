"""Fixtures of the operator tests (defined in kopfenv.py, importable without name clashes)."""

from kopfenv import cluster, operator

__all__ = ["cluster", "operator"]
