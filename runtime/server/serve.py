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
    page_size: int = 16
    gpu_budget: int | None = None
    served_model_name: str | None = None
    api_key: str | None = None
    admin_token: str | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    progress: bool = True


def build_state(opts: ServeOptions) -> ServerState:
    loaded = load_model(opts.model, device=opts.device, dtype=opts.dtype, progress=opts.progress,  # type: ignore[arg-type]
                        model_id=opts.served_model_name)
    gen = Generator(loaded, EngineConfig(page_size=opts.page_size, kv_budget_bytes=opts.gpu_budget))
    engine = LLMEngine(gen, opts.scheduler)
    async_engine = AsyncEngine(engine)
    aliases = (DEMO_ALIAS,) if opts.model == DEMO_ALIAS else ()
    backing = "cuda" if gen.cache.device.type == "cuda" else "cpu-device"

    def tiers() -> list[TierUsage]:
        cache = gen.cache
        return [TierUsage(tier="gpu", capacity_bytes=cache.capacity_bytes, used_bytes=cache.used_bytes,
                          backing=backing),
                TierUsage(tier="dram", capacity_bytes=0, used_bytes=0, backing="disabled"),
                TierUsage(tier="ssd", capacity_bytes=0, used_bytes=0, backing="disabled")]

    def counters() -> TierCounters:
        return TierCounters(page_reads={"gpu": gen.page_reads, "dram": 0, "ssd": 0},
                            transfer_bytes={}, prefetch={"hit": 0, "late": 0, "wasted": 0})

    metrics = ServerMetrics(engine.stats, tiers, counters)
    config = ServerConfig(model_id=loaded.model_id, aliases=aliases, api_key=opts.api_key,
                          admin_token=opts.admin_token)
    return ServerState(config=config, engine=async_engine, tokenizer=loaded.tokenizer, max_context=gen.max_context,
                       metrics=metrics, tiers=tiers, ready=lambda: async_engine.alive, started=int(time.time()))


def serve(opts: ServeOptions) -> None:
    state = build_state(opts)
    app = create_app(state)
    state.engine.start()
    log.info("serving %s on http://%s:%d (KV: %d pages of %d tokens)", state.config.model_id, opts.host, opts.port,
             state.engine.engine.gen.cache.num_pages, opts.page_size)
    server = uvicorn.Server(uvicorn.Config(app, host=opts.host, port=opts.port, log_level="warning",
                                           timeout_graceful_shutdown=30))
    try:
        server.run()
    finally:
        state.engine.shutdown()
        log.info("stopped")


