"""The router's state and its background work: discovery, polling each replica (routing info, the pages it
holds, its queue), following the KV events of those that publish them (their page lists are then polled only
to start over, or while their events are down), the tokenizer learned from the replicas, and picking the
replica for a prompt."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvdrive.router.backends import Backend, BackendPool, EventSource, Health, RoutingInfo
from kvdrive.router.discovery import Discovery
from kvdrive.router.index import PrefixIndex
from kvdrive.router.kv_event_feed import EventFeed
from kvdrive.router.selection import Candidate, Decision, Policy, affinity_key, choose
from kvdrive.runtime.prompt import DIGEST_BYTES, Tokenizer, TokenizerError, page_digests, salted_root

log = logging.getLogger("kvdrive.router")


@dataclass(frozen=True)
class RouterConfig:
    policy: Policy = field(default_factory=Policy)
    health: Health = field(default_factory=Health)
    api_key: str | None = None  # sent on the router's own calls to the replicas (polls)
    poll_seconds: float = 1.0
    index_seconds: float = 2.0  # how often the replicas' page lists are fetched
    discover_seconds: float = 2.0
    recent_seconds: float = 10.0
    max_body_bytes: int = 8 << 20
    isolate_tenants: bool = False  # the replicas run --isolate-tenants: a prompt's pages are keyed by its caller's key
    attempts: int = 3  # replicas tried for one request while nothing has been streamed
    kv_events: bool = True  # follow the KV events of replicas that publish them (else poll their page lists)
    events_stale_seconds: float = 3.0  # events unheard this long: the stream is down, poll again


class Router:
    def __init__(self, config: RouterConfig, discovery: Discovery) -> None:
        self.config = config
        self.discovery = discovery
        self.pool = BackendPool(config.health)
        self.index = PrefixIndex(config.recent_seconds)
        self.feed = EventFeed(self.index, config.events_stale_seconds)
        self.tokenizer: Tokenizer | None = None
        self.turn = 0
        self.session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._last_index: dict[str, float] = {}
        self.polls = 0  # rounds of polling done (tests wait on it)
        self._learning = asyncio.Lock()

    # --- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=3),
                                             auto_decompress=False)
        await self._discover()
        self._tasks = [asyncio.create_task(self._loop(self._discover, self.config.discover_seconds)),
                       asyncio.create_task(self._loop(self._poll_all, self.config.poll_seconds))]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.feed.stop()
        if self.session is not None:
            await self.session.close()

    async def _loop(self, work: Callable[[], Awaitable[None]], every: float) -> None:
        while True:
            try:
                await work()
            except asyncio.CancelledError:
                raise
            except Exception:  # a failed round is logged and retried, never fatal
                log.exception("router background work failed; retrying")
            await asyncio.sleep(every)

    def ready(self) -> bool:
        return self.tokenizer is not None and bool(self.pool.usable(time.monotonic()))

    # --- discovery and polling ----------------------------------------------------------------------
    async def _discover(self) -> None:
        try:
            urls = await asyncio.to_thread(self.discovery)
        except Exception as exc:  # the API server may be briefly away: keep what we had
            log.warning("replica discovery failed (%s); keeping the %d replicas known", exc, len(self.pool.backends))
            return
        _, removed = self.pool.set_urls(urls)
        for u in removed:
            self.index.forget(u)
            self.feed.drop(u)
            self._last_index.pop(u, None)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}

    async def _get(self, b: Backend, path: str) -> aiohttp.ClientResponse:
        assert self.session is not None
        resp = await self.session.get(b.url + path, headers=self._headers(), timeout=aiohttp.ClientTimeout(total=5))
        if resp.status != 200:
            text = (await resp.text())[:200]
            resp.release()
            raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status, message=text)
        return resp

    async def _poll_all(self) -> None:
        await asyncio.gather(*(self._poll(b) for b in list(self.pool.backends.values())))
        self.index.expire(time.monotonic())
        self.polls += 1

    async def _poll(self, b: Backend) -> None:
        started = time.monotonic()
        try:
            async with await self._get(b, "/readyz"):  # starting, or its engine down: not in service
                pass
            async with await self._get(b, "/v1/kvdrive/routing") as r:
                raw = await r.json()
            info = RoutingInfo(str(raw["model"]), bytes.fromhex(raw["root"]), int(raw["page_size"]),
                               str(raw["instance"]), EventSource.of(raw.get("kv_events")) if self.config.kv_events
                               else None)
            if b.info is not None and b.info.instance != info.instance:
                log.info("replica %s restarted (new instance): its index starts over", b.url)
                self.index.forget(b.url)
                self.feed.drop(b.url)
                self._last_index.pop(b.url, None)
            if b.url in self.pool.backends:
                self.feed.follow(b.url, info.kv_events)
            async with self._learning:  # one replica's copy is enough (Gemma 3's is megabytes)
                if self.tokenizer is None:
                    async with await self._get(b, "/v1/kvdrive/tokenizer") as r:
                        spec = await r.json()
                    self.tokenizer = await asyncio.to_thread(Tokenizer.from_spec, spec)
                    log.info("tokenizer of %s learned from %s", info.model, b.url)
            due = started - self._last_index.get(b.url, -1e9) >= self.config.index_seconds
            if self.feed.wants_snapshot(b.url) or (due and not self.feed.live(b.url, started)):
                async with await self._get(b, "/v1/kvdrive/prefixes") as r:
                    body = await r.read()
                self.index.replace(b.url, (body[i : i + DIGEST_BYTES] for i in range(0, len(body), DIGEST_BYTES)),
                                   started)
                self._last_index[b.url] = started
            async with await self._get(b, "/metrics") as r:
                b.running, b.waiting = _queue(await r.text())
            if b.url not in self.pool.backends:
                return  # left while we polled
            b.info = info
            b.succeeded()
        except (TimeoutError, aiohttp.ClientError, KeyError, ValueError, TypeError, TokenizerError) as exc:
            b.failed(time.monotonic(), f"poll: {type(exc).__name__}: {exc}", self.pool.health)

    # --- routing ------------------------------------------------------------------------------------
    def digests_for(self, tokens: Sequence[int], salt: str | None = None) -> dict[tuple[bytes, int], list[bytes]]:
        """The prompt's page digests under each (root, page size) the usable replicas report; a salted prompt's
        on its salted chain (they match only pages stored under the same salt)."""
        out: dict[tuple[bytes, int], list[bytes]] = {}
        for b in self.pool.usable(time.monotonic()):
            assert b.info is not None
            key = (b.info.root, b.info.page_size)
            if key not in out:
                out[key] = page_digests(salted_root(b.info.root, salt), tokens, b.info.page_size)
        return out

    def pick(self, digests: dict[tuple[bytes, int], list[bytes]] | None, exclude: set[str],
             prompt_tokens: int = 0) -> tuple[Backend, Decision, list[bytes]]:
        """The replica for a prompt with these digests (None: the prompt could not be read), and the digests
        it will hold once it accepts it. Raises NoReplicaError when no usable replica is left."""
        usable = [b for b in self.pool.usable(time.monotonic()) if b.url not in exclude]
        cands, mine, page_size, first = [], {}, 16, None
        for b in usable:
            assert b.info is not None
            ds = (digests or {}).get((b.info.root, b.info.page_size), [])
            mine[b.url] = ds
            if ds and first is None:
                first, page_size = affinity_key(ds), b.info.page_size
            m = self.index.match(b.url, ds)
            cands.append(Candidate(b.url, m.pages, b.load, b.pending_tokens, m.shared))
        self.turn += 1
        decision = choose(cands, self.config.policy, page_size, first, self.turn, readable=digests is not None,
                          prompt_tokens=prompt_tokens)
        return self.pool.backends[decision.name], decision, mine[decision.name]


def _queue(text: str) -> tuple[int, int]:
    """(running, waiting) from a replica's /metrics."""
    found = {"kvdrive_requests_running": 0, "kvdrive_requests_waiting": 0}
    for family in text_string_to_metric_families(text):
        if family.name in found:
            found[family.name] = int(sum(s.value for s in family.samples))
    return found["kvdrive_requests_running"], found["kvdrive_requests_waiting"]
