"""Building and running a server: model + engine thread + FastAPI app under uvicorn."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import uvicorn

from kvdrive.runtime.engine import AsyncEngine, EngineConfig, Generator, LLMEngine, SchedulerConfig
from kvdrive.runtime.model import load_model
from kvdrive.runtime.model.loader import DEMO_ALIAS
from kvdrive.runtime.server.app import ServerConfig, ServerState, create_app
from kvdrive.runtime.server.metrics import ServerMetrics, TierCounters
from kvdrive.runtime.server.schemas import TierUsage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    model: str = DEMO_ALIAS
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "cpu"
    dtype: object = None  # torch.dtype | None
    engine: EngineConfig = field(default_factory=EngineConfig)
    served_model_name: str | None = None
    api_key: str | None = None
    admin_token: str | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    progress: bool = True


def build_state(opts: ServeOptions) -> ServerState:
    loaded = load_model(opts.model, device=opts.device, dtype=opts.dtype, progress=opts.progress,  # type: ignore[arg-type]
                        model_id=opts.served_model_name)
    gen = Generator(loaded, opts.engine)
    engine = LLMEngine(gen, opts.scheduler)
    async_engine = AsyncEngine(engine)
    aliases = (DEMO_ALIAS,) if opts.model == DEMO_ALIAS else ()
    cache = gen.cache

    def tiers() -> list[TierUsage]:
        out = [TierUsage(tier=u.tier, budget_bytes=u.budget_bytes, capacity_bytes=u.capacity_bytes,
                         used_bytes=u.used_bytes - u.cached_bytes, cached_bytes=u.cached_bytes, pages=u.pages,
                         backing=u.backing, errors=u.errors) for u in cache.usage()]
        if "ssd" not in cache.store.tiers:  # every tier is always reported; this one is off
            out.append(TierUsage(tier="ssd", budget_bytes=0, capacity_bytes=0, used_bytes=0, backing="disabled"))
        return out

    def counters() -> TierCounters:
        found = cache.page_reads()
        reads = {t: found.get(t, 0) for t in ("gpu", "dram", "ssd")}
        return TierCounters(page_reads=reads, transfer_bytes=dict(cache.store.transfer_bytes),
                            prefetch=cache.placer.ledger.counts(), fetch_wait_seconds=cache.fetch_wait_seconds,
                            decode_steps=cache.decode_steps, prefix_hit_pages=cache.prefix_hit_pages,
                            misses=cache.store.misses, prefetch_throttled=cache.placer.throttle.throttled)

    async def set_tiers(gpu: int, dram: int, ssd: int) -> list[TierUsage]:
        await async_engine.call(lambda _e: cache.set_budgets(gpu, dram, ssd))
        return tiers()

    metrics = ServerMetrics(engine.stats, tiers, counters)
    config = ServerConfig(model_id=loaded.model_id, aliases=aliases, api_key=opts.api_key,
                          admin_token=opts.admin_token)
    return ServerState(config=config, engine=async_engine, tokenizer=loaded.tokenizer, max_context=gen.max_context,
                       metrics=metrics, tiers=tiers, set_tiers=set_tiers, ready=lambda: async_engine.alive,
                       started=int(time.time()))


def serve(opts: ServeOptions) -> None:
    state = build_state(opts)
    app = create_app(state)
    state.engine.start()
    import torch

    log.info("serving %s on http://%s:%d (KV: %d pages of %d tokens over the tiers; %d compute threads)",
             state.config.model_id, opts.host, opts.port, state.engine.engine.gen.cache.num_pages,
             opts.engine.page_size, torch.get_num_threads())
    server = uvicorn.Server(uvicorn.Config(app, host=opts.host, port=opts.port, log_level="warning",
                                           timeout_graceful_shutdown=30))
    try:
        server.run()
    finally:
        state.engine.shutdown()
        state.engine.engine.gen.cache.close()  # finish write-backs, flush the SSD index
        log.info("stopped")


