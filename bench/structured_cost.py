"""What structured outputs cost a decode step: the same chat requests with no constraint and with a JSON schema
(grammar-masked by llguidance), at batch 1 and 8, legs alternated, in one process.

  .venv/bin/python bench/structured_cost.py --out bench/results/structured-cost.json      (about 3 minutes)

The demo model, `make serve`'s device budget, 64 tokens a request (the schema's document, an array of 40 to 200
short strings, cannot end before that, so both legs generate the same tokens). Reported per leg: tokens/s over the batch, and the grammar masks'
time per step (computing the batch's bitmasks and applying them to the logits), measured around the engine's
``GrammarMasks.apply``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from kvdrive.runtime.engine.grammar import GrammarMasks
from kvdrive.runtime.kvcache.config import EngineConfig, TierConfig
from kvdrive.runtime.server.app import create_app
from kvdrive.runtime.server.serve import ServeOptions, build_state

SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 40, "maxItems": 200,
                                                      "items": {"type": "string", "maxLength": 12}}},
          "required": ["items"], "additionalProperties": False}
TOKENS = 64


async def _leg(client: httpx.AsyncClient, batch: int, constrained: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "demo", "messages": [{"role": "user", "content": "List some fruits."}],
                            "max_tokens": TOKENS, "temperature": 0.7, "ignore_eos": True}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "L", "schema": SCHEMA}}
    t0 = time.perf_counter()
    rs = await asyncio.gather(*(client.post("/v1/chat/completions", json={**body, "seed": i}) for i in range(batch)))
    wall = time.perf_counter() - t0
    tokens = sum(r.json()["usage"]["completion_tokens"] for r in rs)
    return {"batch": batch, "json_schema": constrained, "tokens": tokens, "tok_s": round(tokens / wall, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results/structured-cost.json"))
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    mask_s: list[float] = []
    original = GrammarMasks.apply

    def timed(self: GrammarMasks, *a: Any) -> Any:
        t = time.perf_counter()
        out = original(self, *a)
        if a[1]:
            mask_s.append(time.perf_counter() - t)
        return out

    GrammarMasks.apply = timed  # type: ignore[method-assign]
    state = build_state(ServeOptions(model="demo", progress=False, engine=EngineConfig(
        tiers=TierConfig(envelope_bytes=64 << 20, dram_bytes=128 << 20))))
    state.engine.start()
    rows = []

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://t",
                                     timeout=600) as client:
            await _leg(client, 1, True)  # warm-up: the tokenizer's llguidance form, first masks
            for _ in range(args.repeats):
                for batch in (1, 8):
                    for constrained in (False, True):
                        mask_s.clear()
                        row = await _leg(client, batch, constrained)
                        if constrained:
                            row["mask_ms_per_step_median"] = round(1e3 * statistics.median(mask_s), 3)
                            row["mask_ms_per_step_p99"] = round(1e3 * sorted(mask_s)[int(0.99 * (len(mask_s) - 1))], 3)
                        rows.append(row)
                        print(row, flush=True)

    try:
        asyncio.run(run())
    finally:
        state.engine.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"tokens_per_request": TOKENS, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
