"""The engine: continuous-batching serving engine, generation loop, sampling, detokenization."""

from kvdrive.runtime.engine.async_engine import AsyncEngine
from kvdrive.runtime.engine.detokenize import TextStream
from kvdrive.runtime.engine.llm_engine import EngineStats, LLMEngine, QueueFullError
from kvdrive.runtime.engine.model_runner import ModelRunner, PromptTooLongError, kv_layout
from kvdrive.runtime.engine.request import Request, RequestOutput
from kvdrive.runtime.engine.sampling import SamplingParams
from kvdrive.runtime.engine.scheduler import SchedulerConfig
from kvdrive.runtime.kvcache.config import EngineConfig, TierConfig

__all__ = [
    "AsyncEngine", "EngineConfig", "EngineStats", "ModelRunner", "LLMEngine", "PromptTooLongError", "QueueFullError",
    "Request", "RequestOutput", "SamplingParams", "SchedulerConfig", "TextStream", "TierConfig", "kv_layout",
]
