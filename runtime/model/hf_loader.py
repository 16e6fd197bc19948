"""Reading a Hugging Face-style model directory: config.json, *.safetensors and tokenizer.json.

Llama-family checkpoints, Gemma 3 text checkpoints (``gemma3_text``) and the text part of multimodal
Gemma 3 ones (``gemma3`` with a ``text_config``: the vision tower's weights are skipped)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from kvdrive.runtime.model.config import ModelConfig, RopeScaling
from kvdrive.runtime.model.errors import ModelLoadError
from kvdrive.runtime.model.gemma3 import (
    DEFAULT_LOCAL_ROPE_THETA,
    DEFAULT_ROPE_THETA,
    DEFAULT_SLIDING_PATTERN,
    sliding_layers_for,
)
from kvdrive.runtime.prompt.tokenizer import Tokenizer, end_of_turn_ids

_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
}
_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "gemma3_text": "gemma3", "gemma3": "gemma3"}
# transformers' Gemma3TextConfig defaults, for what a checkpoint's (text) config leaves out
_GEMMA3_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
    rms_norm_eps=1e-6, tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
    final_logit_softcapping=None, attn_logit_softcapping=None, attention_bias=False,
)


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


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    arch = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None)
    if arch is None:
        arch = _MODEL_TYPES.get(str(raw.get("model_type")))
    if arch is None:
        raise ModelLoadError(f"unsupported architecture {archs or raw.get('model_type')!r} "
                             f"(supported: {', '.join(_ARCHITECTURES)})")
    return arch


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    arch = _architecture(raw)
    if arch == "gemma3":
        return _gemma3_config(raw)
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


def _gemma3_config(raw: dict[str, Any]) -> ModelConfig:
    """Gemma 3 text settings from a ``gemma3_text`` config or a multimodal config's ``text_config``."""
    nested = raw.get("text_config")
    src = nested if isinstance(nested, dict) else raw
    text = dict(_GEMMA3_DEFAULTS)
    if src is not raw and raw.get("tie_word_embeddings") is not None:  # a multimodal config ties at the top
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    text.update({k: v for k, v in src.items() if v is not None})
    if text.get("use_bidirectional_attention"):
        raise ModelLoadError("Gemma 3 with bidirectional attention (an embedding model) is not supported")
    if text.get("attn_logit_softcapping") is not None:
        raise ModelLoadError("attention logit soft-capping (Gemma 2) is not supported")
    act = str(src.get("hidden_activation") or src.get("hidden_act") or text["hidden_activation"])
    if act not in ("gelu_pytorch_tanh", "gelu"):
        raise ModelLoadError(f"unsupported Gemma 3 hidden_activation {act!r}")
    layers = int(text["num_hidden_layers"])
    if text.get("layer_types"):
        types = list(text["layer_types"])
        if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ModelLoadError(f"unsupported layer_types {types!r}")
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    else:
        pattern = text.get("sliding_window_pattern") or text.get("_sliding_window_pattern") or DEFAULT_SLIDING_PATTERN
        sliding = sliding_layers_for(layers, int(pattern))
    window = int(text["sliding_window"] if src.get("sliding_window", 0) is not None else 0)
    if not window:
        sliding = ()
    params = text.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers v5: per layer type
        theta, scaling = _rope_scaling({"rope_parameters": params.get("full_attention") or {}})
        local = params.get("sliding_attention") or {}
        if (local.get("rope_type") or "default") != "default":
            raise ModelLoadError(f"unsupported rope scaling {local.get('rope_type')!r} on sliding layers")
        local_theta = local.get("rope_theta")
    else:  # v4: rope_theta and rope_scaling are the global layers', rope_local_base_freq the sliding ones'
        theta, scaling = _rope_scaling(text)
        local_theta = text.get("rope_local_base_freq")
    return ModelConfig(
        architecture="gemma3",
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        intermediate_size=int(text["intermediate_size"]),
        num_layers=layers,
        num_heads=int(text["num_attention_heads"]),
        num_kv_heads=int(text["num_key_value_heads"]),
        head_dim=int(text["head_dim"]),
        rms_norm_eps=float(text["rms_norm_eps"]),
        rope_theta=float(theta if theta is not None else DEFAULT_ROPE_THETA),
        rope_scaling=scaling,
        max_position_embeddings=int(text["max_position_embeddings"]),
        tie_word_embeddings=bool(text["tie_word_embeddings"]),
        attention_bias=bool(text["attention_bias"]),
        name=str(raw.get("_name_or_path") or "model"),
        sliding_window=window,
        sliding_layers=sliding,
        rope_local_theta=float(local_theta if local_theta is not None else DEFAULT_LOCAL_ROPE_THETA),
        query_pre_attn_scalar=float(text["query_pre_attn_scalar"]),
        final_logit_softcapping=(float(text["final_logit_softcapping"])
                                 if text.get("final_logit_softcapping") else None),
        hidden_activation=act,
    )


def weight_renamer(raw: dict[str, Any]) -> Callable[[str], str | None] | None:
    """For a multimodal Gemma 3 checkpoint: its text weights under the text model's names, None for the
    vision tower and projector. None when the checkpoint's names need no change."""
    if _architecture(raw) != "gemma3" or not isinstance(raw.get("text_config"), dict):
        return None

    def rename(name: str) -> str | None:
        for prefix in ("model.language_model.", "language_model.model."):  # transformers >= 4.52, older
            if name.startswith(prefix):
                return "model." + name.removeprefix(prefix)
        if name in ("lm_head.weight", "language_model.lm_head.weight"):
            return "lm_head.weight"
        return None

    return rename


def iter_safetensors(
    directory: Path,
    progress: Callable[[Iterator[Any]], Iterator[Any]] | None = None,
    rename: Callable[[str], str | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each weight; ``rename`` maps a stored name to the model's, or None to skip it."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory}: no *.safetensors files")
    items = [(f, name) for f in files for name in safe_open(str(f), framework="pt").keys()]
    if rename is not None:
        items = [(f, name) for f, name in items if rename(name) is not None]
    handles = {f: safe_open(str(f), framework="pt") for f in files}
    for f, name in items if progress is None else progress(iter(items)):
        yield (name if rename is None else rename(name) or name), handles[f].get_tensor(name)


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
    eos_ids.extend(end_of_turn_ids(backend, template))
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
