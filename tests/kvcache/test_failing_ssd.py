"""While the SSD tier fails (EIO), requests run as the memory tiers allow, and none fails for it.

Found by `bench/fault_scenarios.py`: with the SSD tier's device returning EIO, the scheduler still counted
the SSD's capacity, admitted requests whose pages only the SSD could have taken, and every one of them
ended with "no room for this request's pages" (33 of 33 answers were 503). Now a tier with a recent I/O
fault is left out of what the scheduler may promise: a request that fits the memory tiers runs, the
others wait for it, and every answer is the one a healthy server gives.
"""

from __future__ import annotations

import errno
from pathlib import Path

import torch
from enginekit import run_dry, small_engine, submit, tokens

from kvdrive.runtime.engine import Request, SamplingParams
from kvdrive.runtime.kvcache.store.tiers import PosixIO
from kvdrive.runtime.model import LoadedModel, load_model


class DeadDisk(PosixIO):
    def preadv(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        raise OSError(errno.EIO, "Input/output error (injected)")

    def pwritev(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        raise OSError(errno.EIO, "Input/output error (injected)")


def _engine(loaded: LoadedModel, ssd: Path):  # type: ignore[no-untyped-def]
    return small_engine(loaded, ssd, gpu_pages=30, dram_pages=8, token_budget_pages=64)


def _submit(engine, prompts: list[tuple[int, ...]]) -> None:  # type: ignore[no-untyped-def]
    submit(engine, prompts, max_tokens=20)


def test_requests_that_fit_the_memory_tiers_are_served_while_the_ssd_fails(hf_model_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path, _ = hf_model_factory(arch="llama", max_position_embeddings=4096)
    loaded = load_model(str(path), progress=False)
    g = torch.Generator().manual_seed(4)
    # each needs ~29 pages, the memory tiers hold 38: one at a time fits, both at once only with the SSD
    prompts = [tuple(torch.randint(3, 250, (96,), generator=g).tolist()) for _ in range(2)]
    clean = _engine(loaded, tmp_path / "clean")
    _submit(clean, prompts)
    want = {rid: tokens(outs) for rid, outs in run_dry(clean).items()}

    engine = _engine(loaded, tmp_path / "ssd")
    ssd = engine.runner.cache.store.tiers["ssd"]
    ssd.io = DeadDisk()  # type: ignore[attr-defined]  # the disk dies before any request
    engine.add_request(Request("warm", prompts[0][:12], SamplingParams(max_tokens=2, ignore_eos=True), -1.0))
    run_dry(engine)
    engine.runner.cache.transfers.drain()  # its write-through (a background job) has run, and failed
    assert ssd.faults.get("EIO", 0) > 0 and ssd.failing()
    _submit(engine, prompts)
    got = run_dry(engine)
    assert {rid: outs[-1].finish_reason for rid, outs in got.items()} == {"r0": "length", "r1": "length"}
    assert {rid: tokens(outs) for rid, outs in got.items()} == want


def test_pages_stored_only_on_a_dead_ssd_are_recomputed_once_and_served(hf_model_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A restarted server finds a prompt's pages in its SSD index, but the disk now fails every read. The
    prefix load stops at the first unreadable page and the prompt is recomputed; the recomputed pages
    replace the unreadable copies (before: a stored key was 'only touched', the next chunk read the dead
    copy, lost the page and recomputed again, and after 3 times the request failed: 13 of 22 answers
    were 503 in bench/fault_scenarios.py's EIO scenario)."""
    path, _ = hf_model_factory(arch="llama", max_position_embeddings=4096)
    loaded = load_model(str(path), progress=False)
    g = torch.Generator().manual_seed(5)
    prompt = tuple(torch.randint(3, 250, (96,), generator=g).tolist())
    first = _engine(loaded, tmp_path / "ssd")
    _submit(first, [prompt])
    want = tokens(run_dry(first)["r0"])
    first.runner.close()  # write-backs finish, the SSD index is flushed

    engine = _engine(loaded, tmp_path / "ssd")  # a restart on the same directory
    ssd = engine.runner.cache.store.tiers["ssd"]
    assert ssd.allocator.used > 0  # the prompt's pages are indexed there
    ssd.io = DeadDisk()  # type: ignore[attr-defined]
    _submit(engine, [prompt])
    got = run_dry(engine)["r0"]
    assert got[-1].finish_reason == "length" and tokens(got) == want
    assert engine.stats().preemptions_total <= 1  # at most one recomputation, never three
