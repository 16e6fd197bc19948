"""The model: Llama-family and Gemma 3 (text) decoders in torch, their weight loaders (GGUF, HF safetensors)
and the linear layers' weight formats (the tokenizer and chat template are ``kvdrive.runtime.prompt``'s)."""

from kvdrive.runtime.model.config import ModelConfig, RopeScaling
from kvdrive.runtime.model.errors import ModelLoadError
from kvdrive.runtime.model.gemma3 import Gemma3Model
from kvdrive.runtime.model.interfaces import AttentionBackend, CausalLM
from kvdrive.runtime.model.llama import LlamaModel
from kvdrive.runtime.model.loader import LoadedModel, load_model, resolve_model_path

__all__ = [
    "AttentionBackend",
    "CausalLM",
    "Gemma3Model",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "ModelLoadError",
    "RopeScaling",
    "load_model",
    "resolve_model_path",
]
