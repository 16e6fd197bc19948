"""A pod whose /metrics the test scripts (aiohttp, loopback): for the live loop's edge cases.

The real end-to-end test uses real `kvdrive serve` processes; this one lets a test say exactly what a
pod reports (pressure, queue, a scrape that hangs, a budget the pod refuses) and see what it was told.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

MiB = 1 << 20


@dataclass
class ScriptedPod:
    budgets: dict[str, int] = field(default_factory=lambda: {"gpu": 8 * MiB, "dram": 16 * MiB, "ssd": 256 * MiB})
    fill: dict[str, float] = field(default_factory=lambda: {"gpu": 0.5, "dram": 0.5, "ssd": 0.1})
    running_fill: float = 0.0  # share of each tier that running sequences hold (the rest is cache)
    read_rates: dict[str, float] = field(default_factory=dict)  # pages/s per source, accumulated per scrape
    wait_per_scrape: float = 0.2  # seconds decode waited for reads, accumulated per scrape
    waited: float = 0.0
    waiting: int = 0
    running: int = 0
    hang: bool = False  # /metrics never answers (a timeout)
    refuse: str | None = None  # PUT /admin/tiers answers 422 with this reason
    token: str = ""
    puts: list[dict[str, int]] = field(default_factory=list)
    scrapes: int = 0
    reads: dict[str, float] = field(default_factory=lambda: {"gpu": 0.0, "dram": 0.0, "ssd": 0.0, "miss": 0.0})
    port: int = 0
    _runner: web.AppRunner | None = None

    def text(self) -> str:
        lines = []
        for tier, budget in self.budgets.items():
            lines.append(f'kvdrive_tier_budget_bytes{{tier="{tier}"}} {budget}')
            lines.append(f'kvdrive_tier_capacity_bytes{{tier="{tier}",backing="test"}} {budget}')
            # pages held: those of running sequences (used) and reusable ones (cached); the test sets the total
            held = int(budget * self.fill.get(tier, 0))
            used = min(held, int(budget * self.running_fill))
            lines.append(f'kvdrive_tier_used_bytes{{tier="{tier}"}} {used}')
            lines.append(f'kvdrive_tier_cached_bytes{{tier="{tier}"}} {held - used}')
        for source, count in self.reads.items():
            lines.append(f'kvdrive_page_reads_total{{tier="{source}"}} {count}')
        lines += [f"kvdrive_requests_waiting {self.waiting}", f"kvdrive_requests_running {self.running}",
                  "kvdrive_generated_tokens_total 0", f"kvdrive_fetch_wait_seconds_total {self.waited}"]
        return "\n".join(lines) + "\n"

    async def _metrics(self, _: web.Request) -> web.Response:
        while self.hang:  # until the test lets it answer (or stops it)
            await asyncio.sleep(0.05)
        self.scrapes += 1
        for source, rate in self.read_rates.items():
            self.reads[source] += rate
        self.waited += self.wait_per_scrape
        return web.Response(text=self.text(), content_type="text/plain")

    async def _put(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"error": {"message": "missing or invalid admin token"}}, status=401)
        body: dict[str, Any] = json.loads(await request.text())
        self.puts.append(body)
        if self.refuse:
            return web.json_response({"error": {"message": self.refuse}}, status=422)
        self.budgets = {tier: int(body[f"{tier}_bytes"]) for tier in self.budgets}
        return web.json_response({"tiers": []})

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_put("/admin/tiers", self._put)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        self.hang = False
        if self._runner is not None:
            await self._runner.cleanup()
