"""The operator's one door to the Kubernetes API: the official ``kubernetes`` client, run in threads.

Owns transport only: a ``kubernetes.client.Configuration`` built from Kopf's ``ConnectionInfo`` (the
same login Kopf uses), a ``DynamicClient`` for any kind (the CRD's included), and async wrappers that
run each blocking call in a worker thread so that Kopf's event loop never waits on the network.
Writes are server-side apply with a named field manager; a 409 from an apply becomes ``Conflict``
with the fields and the managers that own them; a kind the API server does not serve (a CRD not
installed) is ``KindNotServed``. It knows nothing of KVDrive. Every call is counted
by (verb, resource) in ``calls``, which the scale benchmark reads.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kopf
import urllib3
from kubernetes import client as k8s
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import DynamicApiError, NotFoundError, ResourceNotFoundError
from kubernetes.dynamic.resource import Resource

_CONFLICT_MANAGER = re.compile(r'conflict with "([^"]+)"')


@dataclass(frozen=True)
class Ref:
    """One kind of object: apiVersion + kind (+ plural, the name RBAC rules use)."""

    api_version: str
    kind: str
    plural: str

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]


class ApiError(Exception):
    """A non-success answer of the API server."""

    def __init__(self, status: int, message: str, what: str) -> None:
        super().__init__(f"{status} from {what}: {message[:500]}")
        self.status, self.message = status, message


@dataclass(frozen=True)
class FieldConflict:
    """One field an apply wanted to set that another manager owns with another value."""

    field: str
    manager: str

    def __str__(self) -> str:
        return f"{self.field} (owned by {self.manager!r})"


class KindNotServed(ApiError):
    """The API server does not serve the kind at all (its CustomResourceDefinition is not installed): no
    call on it can succeed, unlike a 404 for one object (which ``get`` answers with None)."""

    def __init__(self, ref: Ref) -> None:
        super().__init__(404, f"the API server does not serve {ref.kind} ({ref.api_version})", ref.plural)


class Conflict(ApiError):
    """A server-side apply refused (409) because other managers own some of its fields."""

    def __init__(self, message: str, what: str, fields: tuple[FieldConflict, ...]) -> None:
        super().__init__(409, message, what)
        self.fields = fields

    def managers(self) -> set[str]:
        return {f.manager for f in self.fields}


def _pem(data: str | bytes) -> bytes:
    raw = data.encode() if isinstance(data, str) else data
    return raw if raw.startswith(b"-----BEGIN ") else base64.b64decode(raw)


def configuration(info: kopf.ConnectionInfo, files: Path) -> k8s.Configuration:
    """The official client's settings from Kopf's login; inline certificates go to files under ``files``."""
    cfg = k8s.Configuration()
    cfg.host = info.server.rstrip("/")
    cfg.verify_ssl = not info.insecure

    def path_of(path: str | None, data: str | bytes | None, name: str) -> str | None:
        if path:
            return str(path)
        if data:
            target = files / name
            target.write_bytes(_pem(data))
            target.chmod(0o600)
            return str(target)
        return None

    cfg.ssl_ca_cert = path_of(info.ca_path, info.ca_data, "ca.pem")
    cfg.cert_file = path_of(info.certificate_path, info.certificate_data, "cert.pem")
    cfg.key_file = path_of(info.private_key_path, info.private_key_data, "key.pem")
    if info.token:
        cfg.api_key = {"authorization": info.token}
        cfg.api_key_prefix = {"authorization": info.scheme or "Bearer"}
    elif info.username and info.password:
        cfg.username, cfg.password = info.username, info.password
    return cfg


def _conflicts(error: DynamicApiError) -> tuple[FieldConflict, ...]:
    try:
        causes = json.loads(error.body).get("details", {}).get("causes") or []
    except (TypeError, ValueError, AttributeError):
        return ()
    found = []
    for cause in causes:
        match = _CONFLICT_MANAGER.search(cause.get("message", ""))
        found.append(FieldConflict(cause.get("field", "?"), match.group(1) if match else "?"))
    return tuple(found)


def _message(error: DynamicApiError) -> str:
    try:
        return str(json.loads(error.body).get("message") or error.body)
    except (TypeError, ValueError, AttributeError):
        return str(error.body or error.reason)


class KubeApi:
    """One API client for one login (re-created when Kopf logs in again)."""

    def __init__(self, info: kopf.ConnectionInfo) -> None:
        self._files = Path(tempfile.mkdtemp(prefix="kvdrive-operator-"))
        self._client = k8s.ApiClient(configuration(info, self._files))
        # a discovery cache of this client's own: a CRD installed after another process cached
        # discovery must not be reported missing
        self._dynamic = DynamicClient(self._client, cache_file=str(self._files / "discovery.json"))
        self._resources: dict[tuple[Ref, str | None], Resource] = {}
        self._lock = threading.Lock()
        self.calls: Counter[tuple[str, str]] = Counter()

    async def close(self) -> None:
        await asyncio.to_thread(self._client.close)
        shutil.rmtree(self._files, ignore_errors=True)

    def _resource(self, ref: Ref, subresource: str | None = None) -> Resource:
        with self._lock:
            key = (ref, subresource)
            if key not in self._resources:
                found = self._dynamic.resources.get(api_version=ref.api_version, kind=ref.kind)
                self._resources[key] = found.subresources[subresource] if subresource else found
            return self._resources[key]

    async def _run(self, verb: str, ref: Ref, what: str, call: Any, *args: Any, **kwargs: Any) -> Any:
        def blocking() -> Any:
            self.calls[(verb, ref.plural)] += 1
            return call(*args, **kwargs)

        try:
            return await asyncio.to_thread(blocking)
        except NotFoundError:
            return None
        except urllib3.exceptions.HTTPError as exc:  # the server is unreachable: no answer at all
            raise ApiError(0, str(exc), what) from exc
        except DynamicApiError as exc:
            fields = _conflicts(exc) if exc.status == 409 and verb == "apply" else ()
            if fields:
                raise Conflict(_message(exc), what, fields) from exc
            raise ApiError(int(exc.status or 0), _message(exc), what) from exc

    async def _bound(self, ref: Ref, subresource: str | None = None) -> Resource:
        """The kind's API resource; ``KindNotServed`` when discovery does not list it (discovery is read
        again on a miss, so a CRD installed since is found)."""
        try:
            return await asyncio.to_thread(self._resource, ref, subresource)
        except ResourceNotFoundError as exc:
            raise KindNotServed(ref) from exc

    async def get(self, ref: Ref, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        res = await self._bound(ref)
        found = await self._run("get", ref, f"{ref.kind} {name}", res.get, name=name, namespace=namespace)
        return None if found is None else found.to_dict()

    async def list(self, ref: Ref, namespace: str | None, labels: dict[str, str]) -> list[dict[str, Any]]:
        """Objects carrying all ``labels`` (a server-side label selector)."""
        res = await self._bound(ref)
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or None
        found = await self._run("list", ref, ref.plural, res.get, namespace=namespace, label_selector=selector)
        return [] if found is None else list(found.to_dict().get("items") or [])

    async def create(self, ref: Ref, namespace: str | None, body: dict[str, Any]) -> dict[str, Any] | None:
        res = await self._bound(ref)
        made = await self._run("create", ref, f"{ref.kind} {body['metadata'].get('name')}", res.create,
                               body=body, namespace=namespace)
        return None if made is None else made.to_dict()

    async def apply(self, ref: Ref, namespace: str | None, body: dict[str, Any], manager: str, *,
                    force: bool = False, subresource: str | None = None) -> dict[str, Any] | None:
        """Server-side apply of ``body`` (the whole intent of ``manager``); None when the object is gone
        (a subresource apply). Raises ``Conflict`` when another manager owns a field with another value
        and ``force`` is false."""
        res = await self._bound(ref, subresource)
        name = body["metadata"]["name"]
        what = f"{ref.kind} {name}" + (f"/{subresource}" if subresource else "")
        applied = await self._run("apply", ref, what, res.server_side_apply, body=body, name=name,
                                  namespace=namespace, field_manager=manager, force_conflicts=force)
        return None if applied is None else applied.to_dict()

    async def delete(self, ref: Ref, namespace: str | None, name: str, propagation: str = "Background") -> None:
        res = await self._bound(ref)
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": propagation}
        await self._run("delete", ref, f"{ref.kind} {name}", res.delete, name=name, namespace=namespace, body=body)


def owns_field(obj: dict[str, Any], manager: str, path: tuple[str, ...]) -> bool:
    """True when ``manager`` owns the field at ``path`` (e.g. ("spec", "replicas")) of ``obj``,
    from its ``metadata.managedFields``."""
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") != manager:
            continue
        node: Any = entry.get("fieldsV1") or {}
        for part in path:
            node = node.get(f"f:{part}") if isinstance(node, dict) else None
            if node is None:
                break
        else:
            return True
    return False
