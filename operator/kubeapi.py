"""A small async client of the Kubernetes REST API, driven by Kopf's connection info.

Owns HTTP transport only (URLs, authentication, TLS, status codes): get, list, create,
merge-patch and delete of plain dict objects. Used only by ``handlers``; it holds no
knowledge of KVDrive. Kopf logs in once; this client reuses that ``kopf.ConnectionInfo``.
"""

from __future__ import annotations

import base64
import json
import ssl
import tempfile
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

_CORE = {"v1"}


@dataclass(frozen=True)
class Ref:
    """The address of one kind of object: apiVersion + plural."""

    api_version: str
    plural: str

    def path(self, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
        prefix = f"/api/{self.api_version}" if self.api_version in _CORE else f"/apis/{self.api_version}"
        parts = [prefix]
        if namespace:
            parts.append(f"namespaces/{namespace}")
        parts.append(self.plural)
        if name:
            parts.append(name)
        if subresource:
            parts.append(subresource)
        return "/".join(parts)


class ApiError(Exception):
    """A non-success answer of the API server."""

    def __init__(self, status: int, body: str, path: str) -> None:
        super().__init__(f"{status} from {path}: {body[:500]}")
        self.status = status


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if not info.server.startswith("https"):
        return False
    if info.insecure:
        return False
    ca_data = info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data
    context = ssl.create_default_context(cafile=info.ca_path or None, cadata=ca_data or None)  # type: ignore[arg-type]
    cert, key = info.certificate_path, info.private_key_path
    with tempfile.TemporaryDirectory() as tmp:
        if info.certificate_data:
            cert = f"{tmp}/cert.pem"
            _write(cert, info.certificate_data)
        if info.private_key_data:
            key = f"{tmp}/key.pem"
            _write(key, info.private_key_data)
        if cert:
            context.load_cert_chain(certfile=cert, keyfile=key or None)  # type: ignore[arg-type]
    return context


def _write(path: str, data: str | bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data.encode() if isinstance(data, str) else data)


def _headers(info: kopf.ConnectionInfo) -> dict[str, str]:
    headers = {"Accept": "application/json"}
    if info.token:
        headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
    elif info.username and info.password:
        basic = base64.b64encode(f"{info.username}:{info.password}".encode()).decode()
        headers["Authorization"] = f"Basic {basic}"
    return headers


class KubeApi:
    """One HTTP session to one API server (re-created when Kopf logs in again)."""

    def __init__(self, info: kopf.ConnectionInfo) -> None:
        self._server = info.server.rstrip("/")
        self._session = aiohttp.ClientSession(
            headers=_headers(info),
            connector=aiohttp.TCPConnector(ssl=_ssl_context(info)),
            timeout=aiohttp.ClientTimeout(total=30),
        )

    async def close(self) -> None:
        await self._session.close()

    async def _call(
        self, method: str, path: str, body: Any = None, params: dict[str, str] | None = None, content_type: str = "application/json"
    ) -> dict[str, Any] | None:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if data is not None else {}
        async with self._session.request(method, self._server + path, data=data, params=params, headers=headers) as rsp:
            text = await rsp.text()
            if rsp.status == 404:
                return None
            if rsp.status >= 400:
                raise ApiError(rsp.status, text, path)
            return json.loads(text) if text else {}

    async def get(self, ref: Ref, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        return await self._call("GET", ref.path(namespace, name))

    async def list(self, ref: Ref, namespace: str | None, labels: dict[str, str]) -> list[dict[str, Any]]:
        """Objects carrying all ``labels`` (filtered here too, in case the server ignores selectors)."""
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        found = await self._call("GET", ref.path(namespace), params={"labelSelector": selector}) or {}
        items = found.get("items") or []
        return [
            item
            for item in items
            if all((item.get("metadata", {}).get("labels") or {}).get(k) == v for k, v in labels.items())
        ]

    async def create(self, ref: Ref, namespace: str | None, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call("POST", ref.path(namespace), body) or {}

    async def patch(
        self, ref: Ref, namespace: str | None, name: str, body: dict[str, Any], subresource: str | None = None
    ) -> dict[str, Any] | None:
        """A JSON merge patch; None when the object is gone."""
        path = ref.path(namespace, name, subresource)
        return await self._call("PATCH", path, body, content_type="application/merge-patch+json")

    async def delete(self, ref: Ref, namespace: str | None, name: str, propagation: str = "Background") -> None:
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": propagation}
        await self._call("DELETE", ref.path(namespace, name), body)
