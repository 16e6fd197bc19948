"""The engine gives freed prompt-step memory back to the OS, at most once per interval."""

from __future__ import annotations

import platform

import pytest

from kvdrive.runtime.engine.heap import HeapTrimmer


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is a glibc function")
def test_trims_after_a_prompt_step_and_then_waits_for_the_interval() -> None:
    heap = HeapTrimmer(min_interval_s=60.0)
    assert heap.available
    assert heap.after_prompt_step()  # first prompt step: trims
    assert not heap.after_prompt_step()  # within the interval: skipped
    assert heap.trims == 1


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is a glibc function")
def test_a_zero_interval_trims_every_prompt_step() -> None:
    heap = HeapTrimmer(min_interval_s=0.0)
    assert all(heap.after_prompt_step() for _ in range(3))
    assert heap.trims == 3
