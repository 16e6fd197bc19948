"""HTTP to the runtime pods themselves (not the Kubernetes API): read ``/metrics``, set ``/admin/tiers``.

Owns the transport, timeouts and how failures are reported: a scrape never raises, it returns a
``Scrape`` whose ``metrics`` is None with the reason (missing data, never zeros); a change of a pod's
concurrency limit (``max_running``, the split of its device envelope) returns an ``Applied`` saying
whether the pod took it and, if not, what it said.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import aiohttp

from kvdrive.operator.api.podmetrics import MetricsFormatError, Scrape, parse_metrics


@dataclass(frozen=True)
class Applied:
    ok: bool
    status: int  # HTTP status, 0 when the pod could not be reached
    detail: str  # the pod's answer: its split after the change, or why it refused


class PodClient:
    """One aiohttp session for all pods of all CRs; ``timeout`` bounds each request."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def scrape(self, base_url: str, timeout: float) -> Scrape:
        """GET ``/metrics``; any failure (refused, timeout, non-200, not our format) is a missing scrape."""
        try:
            async with self._open().get(f"{base_url}/metrics", timeout=aiohttp.ClientTimeout(total=timeout)) as rsp:
                text = await rsp.text()
                if rsp.status != 200:
                    return Scrape(time.monotonic(), None, f"GET /metrics: HTTP {rsp.status}")
            return Scrape(time.monotonic(), parse_metrics(text))
        except TimeoutError:
            return Scrape(time.monotonic(), None, f"GET /metrics: no answer within {timeout:g}s")
        except aiohttp.ClientError as exc:
            return Scrape(time.monotonic(), None, f"GET /metrics: {type(exc).__name__}: {exc}"[:300])
        except MetricsFormatError as exc:
            return Scrape(time.monotonic(), None, f"GET /metrics: {exc}"[:300])

    async def set_running(self, base_url: str, token: str, max_running: int, timeout: float) -> Applied:
        """PUT ``/admin/tiers`` with ``{"max_running": N}`` (the envelope's split) and the admin token."""
        body = {"max_running": int(max_running)}
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        try:
            async with self._open().put(f"{base_url}/admin/tiers", data=json.dumps(body), headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=timeout)) as rsp:
                text = await rsp.text()
                return Applied(ok=rsp.status == 200, status=rsp.status, detail=_reason(text))
        except TimeoutError:
            return Applied(False, 0, f"PUT /admin/tiers: no answer within {timeout:g}s")
        except aiohttp.ClientError as exc:
            return Applied(False, 0, f"PUT /admin/tiers: {type(exc).__name__}: {exc}"[:300])


def _reason(text: str) -> str:
    """The pod's own words: an OpenAI-style error message, FastAPI's detail, or the body."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:300]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:300]
        if body.get("detail"):
            return str(body["detail"])[:300]
    return text[:300]
