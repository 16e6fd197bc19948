"""Building and running a server: model + engine thread + FastAPI app under uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace

import uvicorn

from kvdrive.runtime.engine import AsyncEngine, EngineConfig, LLMEngine, ModelRunner, SchedulerConfig
from kvdrive.runtime.kvcache import BudgetError, KVCache, PageEvents
from kvdrive.runtime.model import load_model
from kvdrive.runtime.model.registry import DEMO_ALIAS, MODEL_ALIASES
from kvdrive.runtime.protocol.secret_files import ApiKey
from kvdrive.runtime.server.admin_schemas import EnvelopeSplitBody, TiersUpdate, TierUsageBody
from kvdrive.runtime.server.app import create_app
from kvdrive.runtime.server.kv_event_publisher import KVEventPublisher, KVEventsConfig, binds
from kvdrive.runtime.server.metrics import ServerMetrics
from kvdrive.runtime.server.routing_api import KVEventsInfo, RoutingSource
from kvdrive.runtime.server.state import ServerConfig, ServerState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    model: str = DEMO_ALIAS
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "cpu"
    dtype: object = None  # torch.dtype | None
    weights: str = "auto"  # the projections' format (--weights)
    gemm: str = "fp32"  # their many-row GEMMs' dtype (--gemm; the CLI's default is auto)
    engine: EngineConfig = field(default_factory=EngineConfig)
    served_model_name: str | None = None
    api_keys: tuple[ApiKey, ...] = ()
    isolate_tenants: bool = False
    admin_token: str | None = None
    protect_metadata: bool = False
    max_body_bytes: int = 8 << 20
    drain_seconds: float = 30.0
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    progress: bool = True
    kv_events: KVEventsConfig | None = None  # publish KV events (--kv-events-endpoint)


def _tcp_port(endpoint: str | None) -> int | None:
    """The port of a bound ``tcp://*:PORT`` address (what a subscriber connects to on this pod)."""
    if endpoint is None or not endpoint.startswith("tcp://") or not binds(endpoint):
        return None
    try:
        return int(endpoint.rsplit(":", 1)[1])
    except ValueError:
        return None


def kv_events_of(cache: KVCache, config: KVEventsConfig | None, model_id: str) -> tuple[
        KVEventPublisher | None, KVEventsInfo | None]:
    """The publisher of KV events (not started) and what a router is told of it; (None, None) when off.
    ``{model}`` in the topic (e.g. llm-d's kv@POD@{model}) becomes the model as served."""
    if config is None:
        return None, None
    config = replace(config, topic=config.topic.replace("{model}", model_id))
    events = PageEvents()
    cache.watch_pages(events)
    port = _tcp_port(config.endpoint)
    info = KVEventsInfo(port=port, replay_port=_tcp_port(config.replay_endpoint), topic=config.topic) \
        if port is not None else None
    return KVEventPublisher(events, config, cache.layout.page_size), info


def build_state(opts: ServeOptions) -> ServerState:
    loaded = load_model(opts.model, device=opts.device, dtype=opts.dtype, progress=opts.progress,  # type: ignore[arg-type]
                        model_id=opts.served_model_name, weights=opts.weights,
                        gemm=opts.gemm)
    gen = ModelRunner(loaded, opts.engine)
    engine = LLMEngine(gen, opts.scheduler)
    aliases = (opts.model,) if opts.model in MODEL_ALIASES else ()
    cache = gen.cache

    def tiers() -> list[TierUsageBody]:
        out = [TierUsageBody(tier=u.tier, budget_bytes=u.budget_bytes, capacity_bytes=u.capacity_bytes,
                         used_bytes=u.used_bytes - u.cached_bytes, cached_bytes=u.cached_bytes, pages=u.pages,
                         backing=u.backing, errors=u.errors) for u in cache.usage()]
        if not cache.has_tier("ssd"):  # every tier is always reported; this one is off
            out.append(TierUsageBody(tier="ssd", budget_bytes=0, capacity_bytes=0, used_bytes=0, backing="disabled"))
        return out

    admin = asyncio.Lock()  # one budget change at a time

    def split() -> EnvelopeSplitBody:
        now = cache.split()
        return EnvelopeSplitBody(**asdict(now), reserve_bytes=now.reserve_bytes)

    async def set_tiers(update: TiersUpdate) -> None:
        """Budgets, then the split: the memory tiers and the split between two engine steps, an SSD shrink
        (disk I/O) beside the steps."""
        async with admin:
            if update.max_running is not None:
                await async_engine.call(lambda e: e.set_max_running(update.max_running))
            if all(v is None for v in (update.gpu_bytes, update.dram_bytes, update.ssd_bytes)):
                return
            budgets = {u.tier: u.budget_bytes for u in cache.usage()}
            gpu = update.gpu_bytes if update.gpu_bytes is not None else budgets["gpu"]
            dram = update.dram_bytes if update.dram_bytes is not None else budgets.get("dram", 0)
            ssd = update.ssd_bytes if update.ssd_bytes is not None else budgets.get("ssd", 0)
            if await async_engine.call(lambda _e: cache.set_budgets(gpu, dram, ssd, defer_ssd_shrink=True)):
                try:
                    await asyncio.to_thread(cache.shrink_ssd, ssd)
                except BudgetError as exc:
                    raise BudgetError(f"{exc} (the gpu and dram budgets were applied; the ssd tier kept "
                                      "its size)") from exc

    metrics = ServerMetrics(engine.stats, tiers, cache.counters)
    publisher, events_info = kv_events_of(cache, opts.kv_events, loaded.model_id)
    async_engine = AsyncEngine(engine, metrics.engine_step.observe)
    log.info("KV: %d pages of %d tokens over the tiers", engine.kv_pages, opts.engine.page_size)
    config = ServerConfig(model_id=loaded.model_id, aliases=aliases, api_keys=opts.api_keys,
                          isolate_tenants=opts.isolate_tenants,
                          admin_token=opts.admin_token, protect_metadata=opts.protect_metadata,
                          max_body_bytes=opts.max_body_bytes)
    return ServerState(config=config, engine=async_engine, tokenizer=loaded.tokenizer, max_context=gen.max_context,
                       request_limit=gen.request_limit,
                       metrics=metrics, tiers=tiers, split=split, set_tiers=set_tiers, ready=lambda: async_engine.alive,
                       started=int(time.time()), health=cache.health,
                       routing=RoutingSource(loaded.model_id, cache.root, cache.layout.page_size, loaded.tokenizer,
                                             lambda: asyncio.to_thread(cache.page_digests), events_info),
                       kv_events=publisher)


class _Server(uvicorn.Server):
    """uvicorn, minus one habit: after its graceful shutdown it re-raises the SIGTERM/SIGINT it caught,
    which kills the process before ``serve()`` can finish write-backs and flush the SSD index
    (Kubernetes stops pods with SIGTERM). Here a signal only asks for the graceful exit (a second one
    forces it, as in uvicorn)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(opts: ServeOptions) -> None:
    """Serve until SIGTERM/SIGINT; then stop admitting (the listener closes), give in-flight requests
    ``drain_seconds`` to finish (then they are aborted), stop the engine, finish write-backs and flush
    the SSD index, and return (exit status 0)."""
    state = build_state(opts)
    app = create_app(state)
    if state.kv_events is not None:
        state.kv_events.start()  # raises if its address cannot be bound: before the engine starts
    state.engine.start()
    import torch

    log.info("serving %s on http://%s:%d (%d compute threads)", state.config.model_id, opts.host, opts.port,
             torch.get_num_threads())
    server = _Server(uvicorn.Config(app, host=opts.host, port=opts.port, log_level="warning",
                                    timeout_graceful_shutdown=max(1, round(opts.drain_seconds))))
    try:
        server.run()
        log.info("shutting down: in-flight requests drained or aborted")
    finally:
        state.engine.shutdown()
        state.engine.close()  # finish write-backs, flush the SSD index
        if state.kv_events is not None:
            state.kv_events.close()
        log.info("stopped")
