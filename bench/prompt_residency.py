"""Prompt chunks re-reading their own pages from the SSD tier, at engine level (no HTTP, no other load).

  .venv/bin/python bench/prompt_residency.py [--docs 4] [--step-seconds 0]      (about a minute)

The soak's tiers (device 32 MiB, DRAM 64 MiB, SSD 256 MiB; demo model), 8 running sequences, 256 tokens a
step: 4 distinct ~1.6K-token documents and 8 short questions arrive together. Reported: engine steps, wall
time, SSD block reads split by who read them (prompt chunks re-reading their document, or decodes), the
slowest steps with their shape, and steps over 1 s and 2 s. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from kvdrive.runtime.bench.texts import haystack_words
from kvdrive.runtime.engine import (
    EngineConfig,
    LLMEngine,
    ModelRunner,
    Request,
    SamplingParams,
    SchedulerConfig,
    TierConfig,
)
from kvdrive.runtime.model import load_model

MiB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--step-seconds", type=float, default=0.0, help="the engine's step latency target (0: off)")
    ap.add_argument("--workdir", type=Path, default=None, help="where the SSD tier's files go (a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = ap.parse_args()
    loaded = load_model("demo")
    tok = loaded.tokenizer
    ssd = tempfile.mkdtemp(dir=args.workdir)
    gen = ModelRunner(loaded, EngineConfig(tiers=TierConfig(envelope_bytes=32 * MiB, dram_bytes=64 * MiB, ssd_dir=ssd,
                                                          ssd_bytes=256 * MiB, io_threads=2), max_sequences=8))
    engine = LLMEngine(gen, SchedulerConfig(max_running=8, step_token_budget=256, step_seconds=args.step_seconds))
    for i in range(args.docs):
        doc = tok.encode(f"Report {i}. " + haystack_words(random.Random(i * 7919), 125) + "\nPlaces named:")
        engine.add_request(Request(f"doc{i}", tuple(doc), SamplingParams(max_tokens=16, ignore_eos=True), float(i)))
    for i in range(8):
        q = tok.encode(f"Question {i}: why is the sky blue? Explain briefly.")
        engine.add_request(Request(f"q{i}", tuple(q), SamplingParams(max_tokens=32, ignore_eos=True), 100.0 + i))
    cache = gen.cache
    steps = []
    t0 = time.perf_counter()
    with tqdm(desc="engine steps", unit="step") as bar:
        while engine.has_work():
            s0, r0 = time.perf_counter(), cache.page_reads().get("ssd", 0)
            engine.step()
            shape = engine.last_step
            steps.append({"seconds": round(time.perf_counter() - s0, 3), "ssd_reads": cache.page_reads()["ssd"] - r0,
                          "prompt_tokens": shape.prompt_tokens, "decodes": shape.decodes})
            bar.update()
    total = time.perf_counter() - t0
    ssd_reads = sum(s["ssd_reads"] for s in steps)
    rereads = cache.counters().prompt_rereads
    result = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "steps": len(steps), "seconds": round(total, 1), "ssd_block_reads": ssd_reads,
        "prompt_rereads": rereads, "decode_ssd_reads": ssd_reads - rereads,
        "steps_over_1s": sum(s["seconds"] > 1 for s in steps), "steps_over_2s": sum(s["seconds"] > 2 for s in steps),
        "slowest": sorted(steps, key=lambda s: -s["seconds"])[:6],
    }
    gen.close()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
