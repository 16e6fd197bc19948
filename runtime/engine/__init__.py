"""The engine: continuous-batching serving engine, generation loop, sampling, detokenization."""

from kvdrive.runtime.engine.async_engine import AsyncEngine
from kvdrive.runtime.engine.detokenize import TextStream
from kvdrive.runtime.engine.kv_state import EngineConfig, TierConfig
from kvdrive.runtime.engine.llm_engine import EngineStats, LLMEngine, QueueFullError
from kvdrive.runtime.engine.model_runner import ModelRunner, PromptTooLongError
from kvdrive.runtime.engine.request import Request, RequestOutput
from kvdrive.runtime.engine.sampling import SamplingParams
from kvdrive.runtime.engine.scheduler import SchedulerConfig

__all__ = [
    "AsyncEngine", "EngineConfig", "EngineStats", "ModelRunner", "LLMEngine", "PromptTooLongError", "QueueFullError",
    "Request", "RequestOutput", "SamplingParams", "SchedulerConfig", "TextStream", "TierConfig",
]
