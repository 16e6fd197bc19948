"""Reproduces the tiered full-attention bug found at 16K (docs/attention.md, RULER 16K): the same RULER prompt
decoded greedily with --full-attention, once with every page in the device tier and once under the RULER
legs' tiers (device 96 MiB, DRAM 128 MiB, the rest on SSD). The answers must be equal; on 2026-12-06 they were
' 5077461.' (device, as llama.cpp answers) and ' 507.' (tight tiers): a promotion made mid-step evicted pages
a layer was about to attend to in place (fixed the same day; both legs now answer ' 5077461.').

    .venv/bin/python bench/full_attention_tiers.py [--context 16384] [--sample 0]   # ~4 min per leg, 2 cores
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from kvdrive.runtime.bench.ruler_bench import ruler_prompts
from kvdrive.runtime.engine import EngineConfig, LLMEngine, ModelRunner, SamplingParams, TierConfig
from kvdrive.runtime.model.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--sample", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    _, ids = ruler_prompts("qwen2.5-coder-0.5b", "niah_single_1", args.context, args.sample + 1)[args.sample]
    loaded = load_model("qwen2.5-coder-0.5b")
    with tempfile.TemporaryDirectory() as ssd:
        legs = {"device": TierConfig(),
                "tight": TierConfig(envelope_bytes=96 << 20, dram_bytes=128 << 20, ssd_bytes=6 << 30, ssd_dir=ssd)}
        answers = {}
        for name, tiers in legs.items():
            t0 = time.time()
            runner = ModelRunner(loaded, EngineConfig(tiers=tiers, full_attention=True, max_sequences=1))
            try:
                out = list(LLMEngine(runner).generate_tokens(ids, SamplingParams(max_tokens=10, temperature=0.0)))
            finally:
                runner.close()
            answers[name] = loaded.tokenizer.decode(out)
            print(f"{name}: {answers[name]!r} ({time.time() - t0:.0f} s)", flush=True)
    print("equal" if len(set(answers.values())) == 1 else "DIFFERENT: the tiers changed full attention's output")


if __name__ == "__main__":
    main()
