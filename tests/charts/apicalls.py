"""What the operator asks of the API server, as RBAC rules: from kmock's recorded requests.

A request becomes ``(apiGroup, resource[/subresource], verb)`` the way the API server's
authorizer sees it: GET of a name is ``get``, of a collection ``list`` (or ``watch`` with
``?watch=true``), POST ``create``, PATCH ``patch``, PUT ``update``, DELETE ``delete``.
Discovery (``/api``, ``/apis``, ``/version``) is allowed to every authenticated user and is
left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

Rule = tuple[str, str, str]  # (apiGroup, resource, verb)


def _verb(method: str, named: bool, params: Mapping[str, str]) -> str:
    if method == "GET":
        if params.get("watch") in ("true", "1"):
            return "watch"
        return "get" if named else "list"
    verbs = {"POST": "create", "PATCH": "patch", "PUT": "update"}
    if method in verbs:
        return verbs[method]
    if method == "DELETE":
        return "delete" if named else "deletecollection"
    raise ValueError(f"unexpected method {method}")


def rule_of(method: str, path: str, params: Mapping[str, str]) -> Rule | None:
    """The RBAC rule one request needs; None for discovery (non-resource URLs)."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 3:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 4:
        group, rest = parts[1], parts[3:]
    else:
        return None  # /api, /api/v1, /apis, /apis/GROUP/VERSION, /version: discovery
    if rest[:1] == ["namespaces"] and len(rest) >= 3:
        rest = rest[2:]  # namespaced: namespaces/NS/RESOURCE[/NAME[/SUB]]
    resource, name, sub = rest[0], rest[1] if len(rest) > 1 else None, rest[2] if len(rest) > 2 else None
    return group, f"{resource}/{sub}" if sub else resource, _verb(method.upper(), name is not None, params)


def rules_of(requests: Iterable[Any], token: str) -> set[Rule]:
    """The rules of every kmock request sent with ``Authorization: Bearer <token>``."""
    found: set[Rule] = set()
    for request in requests:
        if request.headers.get("Authorization") != f"Bearer {token}":
            continue
        rule = rule_of(str(request.method.value), request.url.path, request.params)
        if rule is not None:
            found.add(rule)
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
