"""Fixtures of the chart tests: the operator test harness (tests/operator) made importable."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from kopfenv import cluster

__all__ = ["cluster"]
