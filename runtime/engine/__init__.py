"""The engine: generation loop over the KV cache, sampling, detokenization (scheduler to come)."""

from kvdrive.runtime.engine.detokenize import TextStream
from kvdrive.runtime.engine.generator import EngineConfig, Generator, PromptTooLongError
from kvdrive.runtime.engine.sampling import SamplingParams

__all__ = ["EngineConfig", "Generator", "PromptTooLongError", "SamplingParams", "TextStream"]
