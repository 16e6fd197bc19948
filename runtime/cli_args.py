"""The argument types and flags that several of the runtime's commands share (``kvdrive serve``,
``generate``, ``bench``): sizes, seconds, dtypes, ``--threads``, ``--weights``,
``--kv-dtype``. Imports no torch until a
dtype is asked for: building the parser stays light (``kvdrive route``).
"""

from __future__ import annotations

import argparse
import os

from kvdrive.runtime.sizes import parse_size

DTYPES = ("auto", "float32", "bfloat16", "float16")
# weight_formats.WEIGHT_CHOICES and GEMM_CHOICES, spelled out: building the parser must not import torch (kvdrive route)
WEIGHT_CHOICES = ("auto", "fp32", "bf16", "int8", "int4")
GEMM_CHOICES = ("auto", "fp32", "bf16")


def dtype_of(name: str):  # type: ignore[no-untyped-def]
    import torch

    return None if name == "auto" else getattr(torch, name)


def add_kv_dtype_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-dtype", choices=DTYPES, default="auto",
                   help="the KV cache's dtype in every tier (auto: the compute dtype, --dtype). bfloat16 on a CPU "
                        "that computes in float32 halves every byte the tiers hold and move, and decodes faster, "
                        "at a measured accuracy cost (docs/weights.md#the-kv-cache-dtype); float16 is as "
                        "accurate but slow on CPUs without AVX512-FP16")


def size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def seconds_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from exc
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number of seconds >= 0")
    return value


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads (default: every CPU this process may run on)")


def default_threads() -> int:
    """CPUs this process may run on (the cgroup/affinity set, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def add_weights_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", choices=WEIGHT_CHOICES, default="auto",
                   help="how the projection, embedding and LM-head weights are kept: auto (the GGUF file's own "
                        "blocks, computed in float32: int4 for Q4 tensors, int8 for Q5/Q6/Q8; bf16 for BF16, "
                        "fp32 otherwise), fp32, bf16, int8 or int4 (docs/weights.md)")
    p.add_argument("--gemm", choices=GEMM_CHOICES, default="auto",
                   help="the dtype of the int8/int4 layers' GEMMs over more than 16 rows (prompt chunks, large "
                        "decode batches) on a CPU, and of a prompt chunk's attention products with earlier keys "
                        "(with the kernels, on AVX512-BF16): auto (bf16 where the CPU has AVX512-BF16 or AMX, "
                        "~4x float32's speed; fp32 elsewhere), fp32 (exact) or bf16 (docs/weights.md)")
