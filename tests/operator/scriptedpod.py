"""A pod whose /metrics the test scripts (aiohttp, loopback): for the live loop's edge cases.

The real end-to-end test uses real `kvdrive serve` processes; this one lets a test say exactly what a
pod reports (tier fill, fetch waits, a queue, the split of its device envelope, a scrape that hangs, a
change the pod refuses or applies only after its client gave up) and see what it was told. Like the runtime, it splits a fixed device envelope
(the gpu budget) between the hot KV tier and ``per_sequence`` bytes per sequence it may run at once,
and moves that split on ``PUT /admin/tiers {"max_running": N}``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

MiB = 1 << 20
KiB = 1 << 10


@dataclass
class ScriptedPod:
    budgets: dict[str, int] = field(default_factory=lambda: {"gpu": 8 * MiB, "dram": 16 * MiB, "ssd": 256 * MiB})
    fill: dict[str, float] = field(default_factory=lambda: {"gpu": 0.7, "dram": 0.7, "ssd": 0.7})
    running_fill: float = 0.0  # share of each tier that running sequences hold (the rest is cache)
    read_rates: dict[str, float] = field(default_factory=dict)  # pages per scrape per source
    wait_per_scrape: float = 0.0  # seconds decode waited for lower-tier reads, accumulated per scrape
    waited: float = 0.0
    waiting: int = 0
    running: int = 0
    max_running: int | None = 4  # None: a runtime too old to report its split
    max_sequences: int = 8
    per_sequence: int = 256 * KiB  # what one more running sequence takes from the hot tier
    fixed_reserve: int = 1 * MiB  # open pages of every row
    queued_seconds: float = 0.0  # requests x seconds queued (kvdrive_queue_wait_seconds_total)
    shared_tier_degraded: bool | None = None  # kvdrive_shared_tier_degraded (None: no shared tier)
    hang: bool = False  # /metrics never answers (a timeout)
    refuse: str | None = None  # PUT /admin/tiers answers 422 with this reason
    apply_delay: float = 0.0  # a PUT applies (and answers) this late, as a runtime busy with a long step does
    token: str = ""
    puts: list[dict[str, int]] = field(default_factory=list)
    scrapes: int = 0
    reads: dict[str, float] = field(default_factory=lambda: {"gpu": 0.0, "dram": 0.0, "ssd": 0.0, "miss": 0.0})
    port: int = 0
    _tick: float = field(default_factory=time.monotonic)
    _runner: web.AppRunner | None = None

    @property
    def reserve_bytes(self) -> int:
        return self.fixed_reserve + (self.max_running or 0) * self.per_sequence

    @property
    def hot_bytes(self) -> int:
        return self.budgets["gpu"] - self.reserve_bytes

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
        if self.max_running is not None:
            lines += [f"kvdrive_max_running {self.max_running}", f"kvdrive_max_sequences {self.max_sequences}",
                      f"kvdrive_gpu_hot_bytes {self.hot_bytes}", f"kvdrive_sequence_reserve_bytes {self.reserve_bytes}",
                      f"kvdrive_sequence_reserve_per_sequence_bytes {self.per_sequence}",
                      f"kvdrive_queue_wait_seconds_total {self.queued_seconds}"]
        if self.shared_tier_degraded is not None:
            lines.append(f"kvdrive_shared_tier_degraded {int(self.shared_tier_degraded)}")
        return "\n".join(lines) + "\n"

    async def _metrics(self, _: web.Request) -> web.Response:
        while self.hang:  # until the test lets it answer (or stops it)
            await asyncio.sleep(0.05)
        self.scrapes += 1
        for source, rate in self.read_rates.items():
            self.reads[source] += rate
        self.waited += self.wait_per_scrape
        now = time.monotonic()
        self.queued_seconds += self.waiting * (now - self._tick)  # as the runtime counts it: in real time
        self._tick = now
        return web.Response(text=self.text(), content_type="text/plain")

    async def _put(self, request: web.Request) -> web.Response:
        """The runtime's admin API: any subset of the tier budgets and max_running; 422 when impossible."""
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"error": {"message": "missing or invalid admin token"}}, status=401)
        body: dict[str, Any] = json.loads(await request.text())
        self.puts.append(body)
        if self.refuse:
            return web.json_response({"error": {"message": self.refuse}}, status=422)
        running = body.get("max_running", self.max_running)
        if running is not None and not 1 <= int(running) <= self.max_sequences:
            message = f"max_running must be in [1, {self.max_sequences}] (--max-sequences), not {running}"
            return web.json_response({"error": {"message": message}}, status=422)
        await asyncio.shield(self._apply(body, running))  # applied even when the client stops waiting
        return web.json_response({"max_running": self.max_running, "gpu_hot_bytes": self.hot_bytes,
                                  "sequence_reserve_bytes": self.reserve_bytes})

    async def _apply(self, body: dict[str, Any], running: int | None) -> None:
        await asyncio.sleep(self.apply_delay)
        self.budgets = {tier: int(body.get(f"{tier}_bytes", budget)) for tier, budget in self.budgets.items()}
        self.max_running = running

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
