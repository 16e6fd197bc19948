"""Writes tiny but real GGUF files (llama.cpp's layout and q/k row order) for loader tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert script: interleave the two rotary halves of each head's rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    path: Path,
    model: torch.nn.Module,
    qtype: str = "F32",
    arch: str = "llama",
    tensor_override: dict[str, tuple[bytes, str, tuple[int, ...]]] | None = None,
) -> dict[str, np.ndarray]:
    """Write ``model`` (a transformers Llama) as GGUF, quantizing 2-D weights to ``qtype``.

    Returns the dequantized HF-named weights the file really holds (what a correct loader yields).
    """
    import gguf
    from gguf import quants
    from tokenizers import pre_tokenizers

    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + ["<s>", "</s>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(alphabet) + [3, 3])
    w.add_token_merges([])
    w.add_bos_token_id(len(alphabet))
    w.add_eos_token_id(len(alphabet) + 1)
    w.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}{% endfor %}")

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_names = {
        "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    held: dict[str, np.ndarray] = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if hf_name.startswith("model.layers."):
            idx, rest = hf_name.removeprefix("model.layers.").split(".", 1)
            name = f"blk.{idx}.{layer_names[rest]}"
        else:
            name = names[hf_name]
        arr = tensor.detach().float().numpy()
        stored = arr
        if name.endswith("attn_q.weight"):
            stored = llama_cpp_permute(arr, heads)
        elif name.endswith("attn_k.weight"):
            stored = llama_cpp_permute(arr, kv_heads)
        if tensor_override and name in tensor_override:
            raw, kind, shape = tensor_override[name]
            qt = gguf.GGMLQuantizationType[kind]
            block, size = gguf.GGML_QUANT_SIZES[qt]
            data = np.frombuffer(raw, dtype=np.uint8).reshape(shape[0], shape[1] // block * size)
            w.add_tensor(name, data, raw_dtype=qt)
            continue
        if arr.ndim == 2 and qtype != "F32":
            qt = gguf.GGMLQuantizationType[qtype]
            q = quants.quantize(stored, qt)
            w.add_tensor(name, q, raw_dtype=qt)
            deq = quants.dequantize(q, qt).reshape(arr.shape)
            if name.endswith("attn_q.weight") or name.endswith("attn_k.weight"):
                n = heads if name.endswith("attn_q.weight") else kv_heads
                d = arr.shape[0] // n // 2
                deq = deq.reshape(n, d, 2, arr.shape[1]).swapaxes(2, 1).reshape(arr.shape)
            held[hf_name] = deq
        else:
            w.add_tensor(name, np.ascontiguousarray(stored))
            held[hf_name] = arr
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def load_into(model: torch.nn.Module, weights: dict[str, Any]) -> None:
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if name in weights:
                p.copy_(torch.from_numpy(np.asarray(weights[name])))


def written_reference(path: Path, ref: torch.nn.Module, qtype: str) -> tuple[list[int], torch.Tensor]:
    """Write ``ref`` (a transformers Llama) to ``path`` as GGUF in ``qtype``, give ``ref`` the values the file
    holds, and return 12 token ids with ``ref``'s fp32 logits at every position ([12, V])."""
    load_into(ref, write_gguf(path, ref, qtype=qtype))
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        return ids, ref(torch.tensor([ids])).logits[0].float()


def decoded_logits(path: Path, ids: list[int], weights: str, device: str = "cpu") -> torch.Tensor:
    """The engine's logits at every position of ``ids``, one decode step a token (the decode path), on the
    CPU: [len(ids), V]."""
    from kvdrive.runtime.engine import EngineConfig, ModelRunner, TierConfig
    from kvdrive.runtime.model import load_model

    loaded = load_model(str(path), device=device, progress=False, weights=weights)
    gen = ModelRunner(loaded, EngineConfig(page_size=4, tiers=TierConfig()))
    try:
        seq = gen.new_sequence()
        out = [gen.prefill(seq, ids[:1]).reshape(-1)]
        for t in ids[1:]:
            out.append(gen.decode([(seq, t)])[0].reshape(-1))
        return torch.stack(out).float().cpu()
    finally:
        gen.close()
