"""The engine gives freed prompt-step memory back to the OS once the prompt steps settle: never between two
prompt steps (the next one would fault it all back in), once after them, at most once per interval."""

from __future__ import annotations

import platform
import resource

import pytest
from modelkit import random_tokens

from kvdrive.runtime.engine import EngineConfig, ModelRunner, TierConfig
from kvdrive.runtime.engine.heap import HeapTrimmer
from kvdrive.runtime.model import LoadedModel

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is a glibc function")


@glibc
def test_prompt_steps_keep_their_memory_and_the_first_settled_step_trims_once() -> None:
    heap = HeapTrimmer(min_interval_s=0.0)
    assert heap.available
    assert not heap.settle()  # nothing freed yet
    for _ in range(3):
        heap.prompt_step()
    assert heap.trims == 0  # prompt after prompt: the heap keeps its chunks
    assert heap.settle()  # the prompts settled: one trim
    assert not heap.settle()  # nothing freed since
    assert heap.trims == 1


@glibc
def test_settling_again_waits_for_the_interval() -> None:
    heap = HeapTrimmer(min_interval_s=60.0)
    heap.prompt_step()
    assert heap.settle()
    heap.prompt_step()
    assert not heap.settle()  # within the interval: skipped, still pending
    heap.min_interval_s = 0.0
    assert heap.settle() and heap.trims == 2


@glibc
def test_a_prefill_in_chunks_does_not_fault_its_memory_back_in_every_chunk(demo: LoadedModel) -> None:
    """The demo model's 128-token chunks: after the first two the heap's chunks are reused (under a trim per
    chunk each one faulted ~7,000 pages back in); the decode step after them trims, once."""
    gen = ModelRunner(demo, EngineConfig(page_size=16, max_sequences=1, tiers=TierConfig()))
    seq, _ = gen.open_sequence([])
    tokens = random_tokens(8 * 128)
    faults = []
    for i in range(0, len(tokens), 128):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        gen.forward_tokens([(seq, tokens[i : i + 128])])
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    assert gen.heap.trims == 0
    assert max(faults[2:]) < 1000, faults  # pages, 4 KiB each
    gen.forward_tokens([(seq, [5])], {seq})  # a decode-only step: the prompt settled
    assert gen.heap.trims == 1
    gen.release(seq)
