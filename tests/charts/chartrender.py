"""The chart rendered with the real Helm library (helm-python-sdk), as Python objects."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "kvdrive-operator"
RELEASE, NAMESPACE = "kvd", "kvdrive-system"


def render_chart(values: dict[str, Any], name: str = RELEASE, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    """Every object the chart's templates render (NOTES.txt left out), in template order."""
    import helm_python

    with helm_python.Chart.load(CHART) as chart:
        manifests = chart.render(values=values, name=name, namespace=namespace, is_install=True)
    objects: list[dict[str, Any]] = []
    for template, text in sorted(manifests.items()):
        if template.endswith("NOTES.txt"):
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def render_notes(values: dict[str, Any]) -> str:
    import helm_python

    with helm_python.Chart.load(CHART) as chart:
        manifests = chart.render(values=values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return next(text for template, text in manifests.items() if template.endswith("NOTES.txt"))
