"""What the operator asks of the API server, as RBAC rules: from the API server's audit log.

An audit event carries the verb as the authorizer saw it (get, list, watch, create, patch, update,
delete) and the object's group, resource and subresource. Discovery (``/api``, ``/apis``,
``/version``) has no object and is allowed to every authenticated user; it is left out. A
server-side apply that creates its object (a PATCH answered 201) also needs ``create``: the API
server checks it on top of ``patch``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

Rule = tuple[str, str, str]  # (apiGroup, resource, verb)


def rules_of_audit(events: Iterable[Mapping[str, Any]]) -> set[Rule]:
    """The rules of every request in ``events`` (audit.k8s.io/v1 Event objects)."""
    found: set[Rule] = set()
    for event in events:
        ref = event.get("objectRef")
        if not ref or not ref.get("resource"):
            continue
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        group = ref.get("apiGroup", "")
        found.add((group, resource, event["verb"]))
        if event["verb"] == "patch" and event.get("responseStatus", {}).get("code") == 201:
            found.add((group, resource, "create"))
    return found


def granted(cluster_role: Mapping[str, Any]) -> set[Rule]:
    """Every (apiGroup, resource, verb) a ClusterRole grants (no wildcards allowed)."""
    found: set[Rule] = set()
    for rule in cluster_role.get("rules") or []:
        assert "nonResourceURLs" not in rule and "resourceNames" not in rule, rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert "*" not in (group, resource, verb), f"wildcard in {rule}"
                    found.add((group, resource, verb))
    return found
