"""Lint: every name a module lists in ``__all__`` exists in it, once (``make lint``).

A name in ``__all__`` that the module does not define breaks ``from package import *`` and misleads a reader
about what the package offers; ruff cannot see it across the package's imports. Every module of the three
import packages that declares ``__all__`` is imported and checked. Exit status 1 lists each problem.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (("runtime", "kvdrive.runtime"), ("operator", "kvdrive.operator"), ("router", "kvdrive.router"))


def modules_with_all() -> list[str]:
    out = []
    for folder, package in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__all__" not in path.read_text():
                continue
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out.append(".".join([package, *parts]))
    return out


def problems(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    names = list(getattr(module, "__all__", []))
    found = [f"{module_name}.__all__ lists {n!r}, which it does not define" for n in names if not hasattr(module, n)]
    found += [f"{module_name}.__all__ lists {n!r} twice" for n in sorted({n for n in names if names.count(n) > 1})]
    return found


def main() -> int:
    modules = modules_with_all()
    found = [p for m in modules for p in problems(m)]
    for p in found:
        print(p, file=sys.stderr)
    print(f"__all__: {len(modules)} modules checked, {len(found)} problems")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
