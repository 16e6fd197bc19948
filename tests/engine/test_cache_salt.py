"""Tenant isolation by ``cache_salt``: a salted request's pages are addressed on its own digest chain, so a
prompt stored under one salt is never reused (nor timed) by another salt or by an unsalted request, on the
memory tiers and on the SSD tier after a restart; within one salt it is reused as before."""

from __future__ import annotations

from pathlib import Path

import torch
from enginekit import PAGE, run_dry, small_engine

from kvdrive.runtime.engine import LLMEngine, Request, SamplingParams
from kvdrive.runtime.model import LoadedModel
from kvdrive.runtime.prompt import page_digests, root_digest, salted_root

DOC = tuple(torch.randint(3, 250, (40 * PAGE,), generator=torch.Generator().manual_seed(11)).tolist())


def _cached(engine: LLMEngine, rid: str, salt: str | None) -> int:
    """Prompt tokens of ``DOC`` reused from stored pages for a request with ``salt``."""
    engine.add_request(Request(rid, DOC, SamplingParams(max_tokens=2, ignore_eos=True), 0.0, cache_salt=salt))
    return run_dry(engine)[rid][-1].cached_tokens


def test_salts_never_share_pages_on_any_tier_or_across_a_restart(tiny: LoadedModel, tmp_path: Path) -> None:
    engine = small_engine(tiny, tmp_path / "ssd", 64, 64, 16)
    assert _cached(engine, "a1", "tenant-a") == 0
    assert _cached(engine, "b1", "tenant-b") == 0  # the same prompt under another salt: computed again
    assert _cached(engine, "n1", None) == 0  # and unsalted
    assert _cached(engine, "a2", "tenant-a") >= 39 * PAGE  # within the salt: reused from the memory tiers
    engine.runner.close()
    again = small_engine(tiny, tmp_path / "ssd", 64, 64, 16)  # a restart: only the SSD tier holds the pages
    assert _cached(again, "a3", "tenant-a") >= 39 * PAGE
    assert _cached(again, "c1", "tenant-c") == 0
    assert _cached(again, "n2", None) >= 39 * PAGE  # the unsalted pages were stored too, apart
    again.runner.close()


def test_a_salted_chain_shares_no_digest_with_another() -> None:
    root = root_digest("model")
    toks = list(range(64))
    plain, a, a2, b = (page_digests(salted_root(root, s), toks, 16) for s in (None, "a", "a", "b"))
    assert a == a2 and plain == page_digests(root, toks, 16)
    assert not set(a) & set(b) and not set(a) & set(plain)
