"""Gemma 3 270M through the tiers: parity with transformers, and what hybrid KV holds at length.

  cd /tmp && /work/main/.venv/bin/python /work/main/bench/gemma_long.py --out /work/main/bench/results/gemma3.json

1. parity: 20 plain-text completion prompts (the base model), greedy, 24 tokens each: ``kvdrive``'s
   engine with full attention (the path of ``kvdrive generate --model gemma3-270m --full-attention``)
   against transformers in fp32 on the same GGUF. Counted: identical outputs, the first differing token.
2. logits at a 4K-token prompt: the last position's logits, max |ours - transformers|.
3. memory and prefill at length: one prompt of --long tokens (default 32,768 - 32) through the engine,
   chunked; the KV bytes it holds by layer kind against a model that kept every layer's full KV, the
   prefill's tokens/s and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kvdrive.runtime.bench.texts import filler_tokens
from kvdrive.runtime.engine import EngineConfig, LLMEngine, ModelRunner, SamplingParams, TierConfig
from kvdrive.runtime.model import load_model
from kvdrive.runtime.model.registry import gemma3_270m_path

PROMPTS = (
    "The capital of France is", "Once upon a time, in a small village at the edge of the forest,",
    "The three primary colors are", "Water boils at a temperature of", "def fibonacci(n):\n    ",
    "The first president of the United States was", "In 1969, astronauts landed on",
    "A recipe for pancakes: first, mix", "The largest planet in our solar system is",
    "Photosynthesis is the process by which", "The French word for cat is", "Dear hiring manager, I am writing to",
    "The theory of relativity was proposed by", "import numpy as np\n\ndef mean(xs):", "The Great Wall of China was built",
    "My favourite season is autumn because", "The human heart has four chambers:", "To be or not to be,",
    "The chemical symbol for gold is", "Machine learning is a field of computer science that",
)
MiB = 1 << 20


def _hf_model():  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    path = gemma3_270m_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def parity(loaded, hf, new_tokens: int) -> dict[str, object]:  # type: ignore[no-untyped-def]
    gen = ModelRunner(loaded, EngineConfig(full_attention=True, max_sequences=1))
    cases = []
    for prompt in tqdm(PROMPTS, desc="parity (ours, transformers)"):
        ids = loaded.tokenizer.encode(prompt)
        ours = list(LLMEngine(gen).generate_tokens(ids, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)))
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                              min_new_tokens=new_tokens)
        ref = out[0, len(ids):].tolist()
        first = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), None)
        cases.append({"prompt": prompt, "identical": ours == ref, "first_difference": first,
                      "ours": loaded.tokenizer.decode(ours), "transformers": loaded.tokenizer.decode(ref)})
    gen.close()
    return {"identical": sum(c["identical"] for c in cases), "of": len(cases), "new_tokens": new_tokens,
            "cases": cases}


def logits_at(loaded, hf, tokens: int) -> dict[str, object]:  # type: ignore[no-untyped-def]
    ids = filler_tokens(loaded.tokenizer, tokens, seed=3)
    gen = ModelRunner(loaded, EngineConfig(full_attention=True, max_sequences=1))
    seq = gen.new_sequence()
    ours = gen.prefill(seq, ids)  # [V] the last position
    gen.close()
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float()
    return {"tokens": len(ids), "max_abs_diff": float((ours - ref).abs().max()),
            "argmax_equal": int(ours.argmax()) == int(ref.argmax()), "logit_range": float(ref.abs().max())}


def at_length(loaded, tokens: int, ssd_dir: str) -> dict[str, object]:  # type: ignore[no-untyped-def]
    cfg = loaded.config
    ids = filler_tokens(loaded.tokenizer, tokens, seed=5)
    gen = ModelRunner(loaded, EngineConfig(full_attention=True, max_sequences=1, tiers=TierConfig(
        envelope_bytes=None, dram_bytes=0, ssd_dir=ssd_dir, ssd_bytes=1 << 30)))
    seq = gen.new_sequence()
    chunk = gen.config.prefill_chunk
    t0 = time.perf_counter()
    for i in tqdm(range(0, len(ids), chunk), desc=f"prefill {len(ids)} tokens", unit="chunk"):
        gen.forward_tokens([(seq, ids[i : i + chunk])])
    seconds = time.perf_counter() - t0
    kinds = gen.cache.bytes_by_layer_kind()
    itemsize = gen.cache.layout.itemsize
    full = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize * len(ids)
    gen.close()
    return {"tokens": len(ids), "prefill_seconds": round(seconds, 1), "prefill_tokens_per_s": round(len(ids) / seconds, 1),
            "kv_bytes": kinds, "kv_mib": {k: round(v / MiB, 1) for k, v in kinds.items()},
            "all_layers_full_kv_mib": round(full / MiB, 1),
            "held_vs_full": round(sum(kinds.values()) / full, 3),
            "sliding_tokens_held": gen.cache.windows.capacity if gen.cache.windows else 0,
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--logits-at", type=int, default=4096)
    ap.add_argument("--long", type=int, default=32768 - 32)
    ap.add_argument("--skip", nargs="*", default=[], choices=["parity", "logits", "long"])
    ap.add_argument("--ssd-dir", default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    loaded = load_model("gemma3-270m")
    result: dict[str, object] = {"model": loaded.model_id, "threads": torch.get_num_threads()}
    if "parity" not in args.skip or "logits" not in args.skip:
        hf = _hf_model()
        if "parity" not in args.skip:
            result["parity"] = parity(loaded, hf, args.new_tokens)
        if "logits" not in args.skip:
            result["logits"] = logits_at(loaded, hf, args.logits_at)
        del hf
    if "long" not in args.skip:
        with tempfile.TemporaryDirectory(dir=args.ssd_dir) as d:
            result["long"] = at_length(loaded, args.long, d)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
