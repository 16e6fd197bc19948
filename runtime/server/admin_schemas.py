"""The admin and health bodies (pydantic): readiness, the tiers' usage, a live budget change."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from kvdrive.runtime.protocol.fields import REQUEST, Int


class Readiness(BaseModel):
    status: Literal["ready", "degraded"] = Field(description="degraded: serving, with a tier failing (see degraded)")
    degraded: dict[str, str] = Field(default_factory=dict, description="tier -> why it is degraded")


class TierUsageBody(BaseModel):
    tier: Literal["gpu", "dram", "ssd"]
    budget_bytes: int = Field(description="the configured budget (gpu: the envelope, the running sequences' "
                              "reserve included)")
    capacity_bytes: int = Field(description="bytes of pages the tier can hold now (<= budget)")
    used_bytes: int = Field(description="bytes held for running sequences")
    cached_bytes: int = Field(0, description="bytes of reusable pages no running sequence needs (evictable)")
    pages: int = Field(0, description="blocks (one layer's page) stored")
    backing: str
    errors: int = 0


class TiersUpdate(BaseModel):
    """PUT /admin/tiers: new budgets and/or the envelope's split, applied live (a field left out is unchanged)."""

    model_config = REQUEST
    gpu_bytes: Int | None = Field(None, ge=0, description="the device envelope: hot tier + running sequences' reserve")
    dram_bytes: Int | None = Field(None, ge=0)
    ssd_bytes: Int | None = Field(None, ge=0)
    max_running: Int | None = Field(None, ge=1, description="sequences that may run at once (at most --max-sequences); "
                                    "each takes its decode step buffer from the hot tier")

    @model_validator(mode="after")
    def _something(self) -> TiersUpdate:
        if all(v is None for v in (self.gpu_bytes, self.dram_bytes, self.ssd_bytes, self.max_running)):
            raise ValueError("give at least one of gpu_bytes, dram_bytes, ssd_bytes, max_running")
        return self


class EnvelopeSplitBody(BaseModel):
    """How the device envelope (the gpu budget) is split between the hot tier and running sequences."""

    envelope_bytes: int
    hot_bytes: int = Field(description="the hot KV tier")
    reserve_bytes: int = Field(description="kept for running sequences: fixed_reserve_bytes + "
                               "max_running x per_sequence_bytes")
    fixed_reserve_bytes: int = Field(description="every row's open pages (and sliding windows)")
    per_sequence_bytes: int = Field(description="one running sequence's decode step buffer")
    max_running: int
    max_sequences: int
    pending_max_running: int | None = Field(None, description="a smaller limit applied once that few sequences run")


class TiersResponse(BaseModel):
    tiers: list[TierUsageBody]
    split: EnvelopeSplitBody
