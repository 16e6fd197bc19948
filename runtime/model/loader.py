"""Resolving ``--model`` (a name from ``registry``, a .gguf file or an HF directory) and loading model + tokenizer
with progress."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvdrive.runtime.model.config import ModelConfig
from kvdrive.runtime.model.errors import ModelLoadError
from kvdrive.runtime.model.gemma3 import Gemma3Model
from kvdrive.runtime.model.gguf_blocks import TensorSource
from kvdrive.runtime.model.gguf_loader import (
    gguf_sources,
    iter_gguf_weights,
    open_gguf,
    tokenizer_from_gguf,
)
from kvdrive.runtime.model.hf_loader import iter_safetensors, open_hf_dir, tokenizer_from_hf, weight_renamer
from kvdrive.runtime.model.interfaces import CausalLM
from kvdrive.runtime.model.llama import LlamaModel
from kvdrive.runtime.model.quantize import WeightPlan, apply_weights
from kvdrive.runtime.model.registry import MODEL_ALIASES, named_model
from kvdrive.runtime.model.weight_formats import GEMM_CHOICES, WEIGHT_CHOICES, resolve_gemm, weight_bytes
from kvdrive.runtime.prompt.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM  # LlamaModel | Gemma3Model
    tokenizer: Tokenizer
    config: ModelConfig
    model_id: str  # the id served by /v1/models
    fingerprint: str  # stable across restarts: keys content-addressed KV pages (weight format included)
    path: Path
    load_seconds: float
    device: torch.device  # where it computes
    dtype: torch.dtype  # its activations (and the KV's, unless the engine says otherwise)
    weights: WeightPlan  # the format of each projection (``--weights``)


def resolve_model_path(source: str) -> Path:
    named = named_model(source)
    if named is not None:
        return named.locate()
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model not found: {source} (pass {', '.join(repr(a) for a in MODEL_ALIASES)}, a .gguf file or a "
            "Hugging Face directory)"
        )
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} is a directory without config.json (expected a Hugging Face model directory)")
    elif path.suffix != ".gguf":
        raise ModelLoadError(f"{path}: expected a .gguf file or a Hugging Face directory")
    return path


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def _progress(total: int, desc: str, enabled: bool) -> Any:
    def wrap(items: Iterator[Any]) -> Iterator[Any]:
        return iter(tqdm(items, total=total, desc=desc, unit="tensor", disable=not enabled, leave=False))

    return wrap


def load_model(
    source: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    progress: bool = True,
    model_id: str | None = None,
    weights: str = "auto",
    gemm: str = "fp32",
) -> LoadedModel:
    """Load weights and tokenizer; ``weights`` is the projections' format (``WEIGHT_CHOICES``), ``gemm`` the
    dtype of their many-row GEMMs (``GEMM_CHOICES``). Raises ModelLoadError with a one-line reason on user
    errors."""
    started = time.perf_counter()
    if weights not in WEIGHT_CHOICES:
        raise ModelLoadError(f"--weights {weights!r}: expected one of {', '.join(WEIGHT_CHOICES)}")
    if gemm not in GEMM_CHOICES:
        raise ModelLoadError(f"--gemm {gemm!r}: expected one of {', '.join(GEMM_CHOICES)}")
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    path = resolve_model_path(source)
    freq_factors = None
    if path.is_dir():
        raw, cfg, fingerprint = open_hf_dir(path)
        tokenizer = tokenizer_from_hf(path, raw)
        n = len(list(path.glob("*.safetensors")))
        weights_iter = iter_safetensors(path, _progress(0, f"loading {path.name} ({n} files)", progress),
                                        weight_renamer(raw))
        sources: dict[str, TensorSource] = {}
    else:
        reader, meta, cfg, fingerprint = open_gguf(path)
        tokenizer = tokenizer_from_gguf(meta)
        weights_iter = iter_gguf_weights(reader, cfg, _progress(len(reader.tensors), f"loading {path.name}", progress))
        sources = gguf_sources(reader, cfg)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in weights_iter:
        if name == "rope_freqs.weight":
            freq_factors = tensor
        else:
            tensors[name] = tensor
            sources.setdefault(name, TensorSource(_DTYPE_NAMES.get(tensor.dtype, "F32")))
    with torch.device("meta"):
        if cfg.architecture == "gemma3":
            model: LlamaModel | Gemma3Model = Gemma3Model(cfg)
        else:
            model = LlamaModel(cfg, rope_freq_factors=freq_factors)
    # fp32 weights load where they compute; any other format loads in fp32 on the CPU first, then
    # each projection is converted onto the device and the rest (norms) moved there
    direct = weights == "fp32"
    model = model.to_empty(device=device if direct else "cpu").to(dtype if direct else torch.float32)
    try:
        model.load_hf_state_dict(tensors)
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    del tensors
    plan = WeightPlan("fp32", {}) if direct else \
        apply_weights(model, weights, sources, device, dtype, resolve_gemm(gemm, device))
    if not direct:
        model = model.to(device=device, dtype=dtype)
    model.eval()
    seconds = time.perf_counter() - started
    served_id = model_id or MODEL_ALIASES.get(source) or (path.stem if path.is_file() else path.name)
    held = weight_bytes(model)
    log.info("loaded %s (%s, %d layers, %s) in %.1fs; weights %s (%s%s): %d MiB", served_id, cfg.architecture,
             cfg.num_layers, dtype, seconds, weights, plan.summary(),
             f"; prompt GEMMs {plan.gemm}" if plan.blocked() else "", sum(held.values()) >> 20)
    return LoadedModel(model, tokenizer, cfg, served_id, fingerprint + plan.fingerprint(), path, seconds,
                       device, dtype, plan)


_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}
