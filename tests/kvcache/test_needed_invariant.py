"""Every block marked ``needed`` belongs to a page that a live sequence references, after every step.

``needed`` blocks are demoted, never dropped: a flag that outlives its sequence pins the tiers' room for
good. The soak found the tiers full of needed blocks (about 108 pages more than the running sequences
referenced) and the engine undoing a step every ~13 s. This drives one engine through what the soak does
to it: mixed prompt lengths sharing prefixes, aborts at random moments, preemptions, and live budget
changes, and checks the invariant after each step.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from enginekit import PAGE, page_bytes, tiered_engine

from kvdrive.runtime.engine import LLMEngine, Request, SamplingParams
from kvdrive.runtime.kvcache import BudgetError, CacheFullError
from kvdrive.runtime.model import load_model


def _leaked(engine: LLMEngine) -> list[str]:
    cache = engine.runner.cache
    store = cache.store
    with store.table.lock:
        needed = {b.key.digest for b in store.table.blocks.values() if b.needed}
    referenced = set(cache.prefix._refs)
    return [d.hex()[:12] for d in needed - referenced]


def test_no_block_stays_needed_after_its_sequences_are_gone(hf_model_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path, _ = hf_model_factory(arch="llama", max_position_embeddings=4096)
    loaded = load_model(str(path), progress=False)
    page = page_bytes(loaded)
    engine = tiered_engine(loaded, step_tokens=32, rows=4, hot_pages=24, dram_pages=16, ssd=tmp_path / "ssd",
                           ssd_bytes=80 * page, token_budget=8 * PAGE)
    gen = engine.runner
    reserve = gen.config.tiers.envelope_bytes - 24 * page  # the rows' open pages and step buffers, beside the hot tier
    budgets = [(24 * page + reserve, 16 * page, 80 * page), (40 * page + reserve, 8 * page, 50 * page)]
    rng = random.Random(7)
    mover, ssd = gen.cache.mover, gen.cache.store.tiers["ssd"]
    real_put, real_read = mover.put, ssd.read

    def sometimes_full(*args, **kwargs):  # type: ignore[no-untyped-def]  # a tier with no slot for a moment
        if rng.random() < 0.01:
            raise CacheFullError("gpu tier: no slot (injected)")
        return real_put(*args, **kwargs)

    def sometimes_corrupt(slots: list[int], out: torch.Tensor) -> list[bool]:  # a block failing its CRC
        ok = real_read(slots, out)
        return [o and rng.random() > 0.02 for o in ok]

    mover.put = sometimes_full  # type: ignore[method-assign]
    ssd.read = sometimes_corrupt  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(7)
    docs = [tuple(torch.randint(3, 250, (n,), generator=g).tolist()) for n in (150, 120, 90)]
    live: list[str] = []
    n = 0
    for step in range(800):
        if len(live) < 6 and rng.random() < 0.3:
            doc = docs[rng.randrange(3)]
            prompt = doc[: rng.randrange(20, len(doc))] + tuple(rng.randrange(3, 250) for _ in range(rng.randrange(1, 9)))
            rid = f"r{n}"
            n += 1
            engine.add_request(Request(rid, prompt, SamplingParams(max_tokens=rng.randrange(4, 30), ignore_eos=True),
                                       float(step)))
            live.append(rid)
        if live and rng.random() < 0.04:  # a client goes away
            engine.abort(live.pop(rng.randrange(len(live))))
        if rng.random() < 0.02:
            gpu, dram, ssd = budgets[rng.randrange(2)]
            try:
                gen.cache.set_budgets(gpu, dram, ssd)
            except BudgetError:
                pass
        for out in engine.step():
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
        assert not _leaked(engine), f"step {step}: needed blocks of unreferenced pages {_leaked(engine)[:5]}"
    assert n > 50 and engine.stats().preemptions_total > 0  # the run did exercise preemption
    engine.runner.cache.mover.put = real_put  # type: ignore[method-assign]
