"""Reading a Hugging Face-style model directory: config.json, *.safetensors and tokenizer.json."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from kvdrive.runtime.model.config import ModelConfig, RopeScaling
from kvdrive.runtime.model.errors import ModelLoadError
from kvdrive.runtime.model.tokenizer import Tokenizer

_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{path} is missing") from exc
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON ({exc})") from exc


def _rope_scaling(raw: dict[str, Any]) -> tuple[float | None, RopeScaling]:
    """Rope settings from transformers v4 (``rope_scaling``) or v5 (``rope_parameters``) configs."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = params.get("rope_theta", raw.get("rope_theta"))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return theta, RopeScaling()
    if kind not in ("linear", "dynamic", "llama3", "yarn"):
        raise ModelLoadError(f"unsupported rope scaling type {kind!r}")
    orig = params.get("original_max_position_embeddings")
    return theta, RopeScaling(
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        original_max_position_embeddings=int(orig) if orig else None,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None)
    if arch is None:
        arch = raw.get("model_type") if raw.get("model_type") in _ARCHITECTURES.values() else None
    if arch is None:
        raise ModelLoadError(f"unsupported architecture {archs or raw.get('model_type')!r} "
                             f"(supported: {', '.join(_ARCHITECTURES)})")
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    theta, scaling = _rope_scaling(raw)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta if theta is not None else 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", arch == "qwen2")),
        name=str(raw.get("_name_or_path") or "model"),
    )


def iter_safetensors(
    directory: Path, progress: Callable[[Iterator[Any]], Iterator[Any]] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory}: no *.safetensors files")
    items = [(f, name) for f in files for name in safe_open(str(f), framework="pt").keys()]
    handles = {f: safe_open(str(f), framework="pt") for f in files}
    for f, name in items if progress is None else progress(iter(items)):
        yield name, handles[f].get_tensor(name)


def tokenizer_from_hf(directory: Path, raw_config: dict[str, Any]) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    path = directory / "tokenizer.json"
    if not path.exists():
        raise ModelLoadError(f"{directory}: tokenizer.json is missing")
    backend = HFTokenizer.from_file(str(path))
    tcfg = _read_json(directory / "tokenizer_config.json") if (directory / "tokenizer_config.json").exists() else {}
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if (directory / "chat_template.jinja").exists():
        template = (directory / "chat_template.jinja").read_text()

    def token_id(value: Any) -> int | None:
        if isinstance(value, dict):
            value = value.get("content")
        return backend.token_to_id(value) if isinstance(value, str) else None

    eos_ids: list[int] = []
    gen = directory / "generation_config.json"
    for source in (raw_config, _read_json(gen) if gen.exists() else {}):
        eos = source.get("eos_token_id")
        eos_ids.extend(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    tok_eos = token_id(tcfg.get("eos_token"))
    if tok_eos is not None:
        eos_ids.append(tok_eos)
    bos = token_id(tcfg.get("bos_token"))
    if bos is None:
        bos = raw_config.get("bos_token_id")
    return Tokenizer(
        backend,
        eos_token_ids=[int(e) for e in eos_ids],
        bos_token_id=bos,
        add_bos=bool(tcfg.get("add_bos_token", False)),
        chat_template=template,
    )


def open_hf_dir(directory: Path) -> tuple[dict[str, Any], ModelConfig, str]:
    raw = _read_json(directory / "config.json")
    cfg = config_from_hf(raw)
    h = hashlib.sha256(cfg.to_json().encode())
    for f in sorted(directory.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size};".encode())
    return raw, cfg, h.hexdigest()[:32]
