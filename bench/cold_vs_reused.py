"""Is a RULER sample's sparse answer different because of page selection, or because its prompt was reused?

The RULER bench's full-attention leg prefills each prompt cold; the sparse legs reuse its stored pages and
compute only the prompt's last partial page, whose few rows take the float32 block kernels instead of the bf16
prompt GEMMs (docs/weights.md). This replays one sample in process: full attention cold, full attention on
its own reused pages, then sparse at 2,048 and 1,024 on those pages, and prints each first token's top three
log-probabilities and the greedy answer. Session 13, ruler_fwe at 16K, sample 4 (the one sample of ten whose
sparse answer differed): full attention on its reused pages answers what the sparse legs answer.

    cd bench && ../.venv/bin/python cold_vs_reused.py [task] [context] [sample]   # ~5 min at 16K on 2 cores
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Sequence

import torch

from kvdrive.runtime.bench.ruler_bench import in_fresh_process, ruler_prompts
from kvdrive.runtime.engine import EngineConfig, ModelRunner, TierConfig
from kvdrive.runtime.model import LoadedModel
from kvdrive.runtime.model.loader import load_model

MODEL = "qwen2.5-coder-0.5b"


def answer(gen: ModelRunner, loaded: LoadedModel, ids: Sequence[int], name: str, n: int = 16) -> None:
    """Prefill ``ids`` (reusing what the tiers hold), decode ``n`` greedy tokens, print what came out."""
    seq, reused = gen.open_sequence(ids)
    logits = gen.prefill(seq, ids[reused:])  # [V]
    top = torch.topk(torch.log_softmax(logits.float(), -1), 3)
    tokens = [int(logits.argmax())]
    for _ in range(n - 1):
        tokens.append(int(gen.decode([(seq, tokens[-1])])[0].argmax()))
    gen.release(seq)
    firsts = [(loaded.tokenizer.decode([int(i)]), round(float(v), 4)) for v, i in zip(top.values, top.indices, strict=True)]
    print(f"{name}: {reused} prompt tokens reused; first token top 3 {firsts}; "
          f"answer {loaded.tokenizer.decode(tokens)!r}", flush=True)


def main(task: str = "ruler_fwe", context: str = "16384", sample: str = "4") -> None:
    torch.set_num_threads(2)
    label, ids = in_fresh_process(ruler_prompts, MODEL, task, int(context), int(sample) + 1)[int(sample)]
    print(f"{label}: {len(ids)} prompt tokens", flush=True)
    loaded = load_model(MODEL, progress=False, gemm="auto")
    ssd = tempfile.mkdtemp(prefix="cold-vs-reused-")
    tiers = TierConfig(envelope_bytes=256 << 20, dram_bytes=128 << 20, ssd_dir=ssd, ssd_bytes=2 << 30)
    try:
        full = ModelRunner(loaded, EngineConfig(page_size=16, max_sequences=1, full_attention=True, tiers=tiers))
        answer(full, loaded, ids, "full attention, cold")
        answer(full, loaded, ids, "full attention, reused")
        full.close()
        for budget in (2048, 1024):
            sparse = ModelRunner(loaded, EngineConfig(page_size=16, max_sequences=1, token_budget=budget, tiers=tiers))
            answer(sparse, loaded, ids, f"sparse {budget}, reused")
            sparse.close()
    finally:
        shutil.rmtree(ssd, ignore_errors=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
