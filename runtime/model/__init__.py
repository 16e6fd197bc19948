"""The model: a Llama-family decoder in torch, its weight loaders (GGUF, HF safetensors) and tokenizer."""

from kvdrive.runtime.model.config import ModelConfig, RopeScaling
from kvdrive.runtime.model.errors import ModelLoadError
from kvdrive.runtime.model.interfaces import AttentionBackend
from kvdrive.runtime.model.llama import LlamaModel
from kvdrive.runtime.model.loader import LoadedModel, load_model, resolve_model_path
from kvdrive.runtime.model.tokenizer import ChatMessage, Tokenizer

__all__ = [
    "AttentionBackend",
    "ChatMessage",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "ModelLoadError",
    "RopeScaling",
    "Tokenizer",
    "load_model",
    "resolve_model_path",
]
