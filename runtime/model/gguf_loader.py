"""Reading a GGUF file (Llama family, Gemma 3): metadata -> ModelConfig, tensors -> dequantized torch weights.

Dequantization (Q4_0, Q4_1, Q5_x, Q8_0, K-quants, F16, BF16, F32) is done by the ``gguf`` package
with numpy; llama.cpp's interleaved q/k row order is undone so the model uses the Hugging Face
rotate-half RoPE layout (Gemma files are not interleaved), and the ``1 + w`` that llama.cpp's converter
bakes into Gemma's norm weights is taken out again, so every weight arrives as transformers names and
stores it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvdrive.runtime.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from kvdrive.runtime.model.errors import ModelLoadError
from kvdrive.runtime.model.gemma3 import (
    DEFAULT_LOCAL_ROPE_THETA,
    DEFAULT_ROPE_THETA,
    DEFAULT_SLIDING_PATTERN,
    NORM_OFFSET,
    sliding_layers_for,
)
from kvdrive.runtime.model.gguf_blocks import BLOCK_EXACT_TYPES, Blocks, TensorSource, read_blocks
from kvdrive.runtime.prompt.tokenizer import (
    Tokenizer,
    TokenizerError,
    bpe_from_gguf,
    end_of_turn_ids,
    gemma_spm_from_gguf,
)

_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
_QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K")

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3 has four norms per layer; its ffn_norm is the pre-feed-forward one
_GEMMA3_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if k != "ffn_norm.weight"},
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _reader(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the gguf package raises ValueError/struct errors on a bad file
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from exc


def _fields(reader: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception:  # unusual field types we do not need
            continue
    return out


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", get("rope.dimension_count", hidden // heads)))
    vocab = int(get("vocab_size", len(meta.get("tokenizer.ggml.tokens", []))))
    scaling_type = get("rope.scaling.type", "none")
    rope = RopeScaling()
    if scaling_type in ("linear", "yarn"):
        orig = get("rope.scaling.original_context_length")
        rope = RopeScaling(
            kind=scaling_type,
            factor=float(get("rope.scaling.factor", 1.0)),
            original_max_position_embeddings=int(orig) if orig else None,
        )
    elif scaling_type not in ("none", None):
        raise ModelLoadError(f"unsupported rope scaling {scaling_type!r} in GGUF metadata")
    extra = _gemma3_fields(get, hidden, heads, head_dim) if arch == "gemma3" else {}
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", DEFAULT_ROPE_THETA if arch == "gemma3" else 10000.0)),
        rope_scaling=rope,
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        name=str(meta.get("general.name", "model")),
        **extra,
    )


def _gemma3_fields(get: Callable[..., Any], hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    """Gemma 3's settings, as llama.cpp reads them (it hard-codes what older files leave out)."""
    layers = int(get("block_count"))
    window = int(get("attention.sliding_window", 0) or 0)
    pattern = get("attention.sliding_window_pattern", DEFAULT_SLIDING_PATTERN)
    if not window:
        sliding: tuple[int, ...] = ()
    elif isinstance(pattern, list):  # one flag per layer, true = sliding
        sliding = tuple(i for i, flag in enumerate(pattern) if flag)
    else:
        sliding = sliding_layers_for(layers, int(pattern))
    # llama.cpp: the 27B (62 layers) scales queries by hidden / heads, the others by head_dim
    scalar = hidden / heads if layers == 62 else head_dim
    cap = get("final_logit_softcapping")
    return dict(
        sliding_window=window,
        sliding_layers=sliding,
        rope_local_theta=float(get("rope.freq_base_swa", DEFAULT_LOCAL_ROPE_THETA)),
        query_pre_attn_scalar=float(scalar),
        final_logit_softcapping=float(cap) if cap else None,
        hidden_activation="gelu_pytorch_tanh",
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row interleave (GGUF 'llama' arch) -> rotate-half layout."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _dequantize(tensor: Any) -> np.ndarray:
    import gguf

    kind = tensor.tensor_type.name
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost-first
    if kind in _FLOAT_TYPES:
        arr = np.asarray(tensor.data)
        if kind == "BF16":
            arr = gguf.quants.dequantize(arr, tensor.tensor_type)
        return arr.astype(np.float32).reshape(shape)
    if kind in _QUANT_TYPES:
        return gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    raise ModelLoadError(
        f"tensor {tensor.name}: unsupported quantization {kind} (supported: {', '.join(_FLOAT_TYPES + _QUANT_TYPES)})"
    )


def iter_gguf_weights(
    reader: Any, cfg: ModelConfig, progress: Callable[[Iterator[Any]], Iterator[Any]] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, float32 tensor) for each weight of the file."""
    tensors = reader.tensors if progress is None else progress(reader.tensors)
    gemma = cfg.architecture == "gemma3"
    layer_names = _GEMMA3_LAYER_NAMES if gemma else _LAYER_NAMES
    for t in tensors:
        name = t.name
        if name == "rope_freqs.weight":
            yield name, torch.from_numpy(_dequantize(t).copy())
            continue
        hf_name = _hf_name(name, cfg, layer_names)
        arr = _dequantize(t)
        if gemma and name.endswith("norm.weight"):  # llama.cpp stored 1 + w (transformers subtracts it too)
            arr = arr - NORM_OFFSET
        if cfg.architecture in ("llama", "mistral"):
            if rest_is(name, "attn_q"):
                arr = _unpermute(arr, cfg.num_heads)
            elif rest_is(name, "attn_k"):
                arr = _unpermute(arr, cfg.num_kv_heads)
        yield hf_name, torch.from_numpy(np.ascontiguousarray(arr))


def _hf_name(name: str, cfg: ModelConfig, layer_names: dict[str, str]) -> str:
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        if rest not in layer_names:
            raise ModelLoadError(f"unexpected tensor {name} for a {cfg.architecture} model")
        return f"model.layers.{idx}.{layer_names[rest]}"
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    raise ModelLoadError(f"unexpected tensor {name} for a {cfg.architecture} model")


def gguf_sources(reader: Any, cfg: ModelConfig) -> dict[str, TensorSource]:
    """Hugging Face name -> how the file stores the tensor: its GGUF type and, for a block-exact type,
    a reader of its exact blocks in the loader's row order (llama q/k un-interleaved)."""
    layer_names = _GEMMA3_LAYER_NAMES if cfg.architecture == "gemma3" else _LAYER_NAMES

    def reader_of(t: Any) -> Callable[[], Blocks] | None:
        if t.tensor_type.name not in BLOCK_EXACT_TYPES or len(t.shape) != 2:
            return None
        heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
        stem = next((k for k in heads if rest_is(t.name, k)), None) if cfg.architecture in ("llama", "mistral") else None

        def read() -> Blocks:
            b = read_blocks(t)
            if stem is None:
                return b
            order = _unpermute(np.arange(b.shape[0]), heads[stem])
            return b.rows(torch.from_numpy(np.ascontiguousarray(order)))

        return read

    return {_hf_name(t.name, cfg, layer_names): TensorSource(t.tensor_type.name, reader_of(t))
            for t in reader.tensors if t.name != "rope_freqs.weight"}


def rest_is(name: str, stem: str) -> bool:
    return name.endswith(f".{stem}.weight") or name.endswith(f".{stem}.bias")


def tokenizer_from_gguf(meta: dict[str, Any]) -> Tokenizer:
    model = meta.get("tokenizer.ggml.model")
    arch = meta.get("general.architecture")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError("the GGUF file holds no tokenizer (tokenizer.ggml.tokens)")
    try:
        if model == "gpt2":
            backend = bpe_from_gguf(
                tokens,
                meta.get("tokenizer.ggml.merges", []),
                meta.get("tokenizer.ggml.token_type", []),
                str(meta.get("tokenizer.ggml.pre", "gpt2")),
            )
        elif model == "llama" and arch == "gemma3":
            unk = meta.get("tokenizer.ggml.unknown_token_id")
            backend = gemma_spm_from_gguf(
                tokens, meta.get("tokenizer.ggml.token_type", []), tokens[int(unk)] if unk is not None else "<unk>"
            )
        else:
            raise ModelLoadError(
                f"GGUF tokenizer model {model!r} is not supported for {arch!r} (byte-level BPE 'gpt2' is, and "
                "SentencePiece 'llama' for gemma3); load a Hugging Face directory with tokenizer.json instead"
            )
    except TokenizerError as exc:
        raise ModelLoadError(str(exc)) from exc
    template = meta.get("tokenizer.chat_template")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eot = meta.get("tokenizer.ggml.eot_token_id")
    eos_ids = [int(x) for x in (eos, eot) if x is not None]
    eos_ids.extend(end_of_turn_ids(backend, template))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise (so does transformers)
    add_bos = meta.get("tokenizer.ggml.add_bos_token", model == "llama")
    return Tokenizer(
        backend,
        eos_token_ids=eos_ids,
        bos_token_id=int(bos) if bos is not None else None,
        add_bos=bool(add_bos),
        chat_template=template,
    )


def open_gguf(path: Path) -> tuple[Any, dict[str, Any], ModelConfig, str]:
    """Open a GGUF file: (reader, metadata, config, fingerprint)."""
    reader = _reader(path)
    meta = _fields(reader)
    names = {t.name for t in reader.tensors}
    cfg = config_from_gguf(meta, names)
    h = hashlib.sha256(cfg.to_json().encode())
    for t in reader.tensors:
        h.update(f"{t.name}:{t.tensor_type.name}:{list(t.shape)}:{t.data_offset};".encode())
    h.update(str(path.stat().st_size).encode())
    return reader, meta, cfg, h.hexdigest()[:32]
