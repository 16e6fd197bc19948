"""Which torch device the runtime computes on and holds its device KV tier in.

``auto`` (the default of every command) is CUDA when torch sees a CUDA device, else the CPU. An
explicit ``cuda`` on a host where torch sees none is a user error with the reason, never a silent
fall back to the CPU: a pod that reserved a GPU must not compute on its CPU unnoticed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

_CUDA_INDEX = re.compile(r"cuda:(\d+)")


@dataclass(frozen=True)
class DeviceChoice:
    """The device a command runs on and why (logged at start)."""

    device: str  # a torch device string: "cpu", "cuda", "cuda:1"
    reason: str


def _cuda_state() -> str:
    built = torch.version.cuda or "none (a CPU-only build)"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = "unset" if visible is None else repr(visible)
    return f"torch {torch.__version__}, built with CUDA {built}, CUDA_VISIBLE_DEVICES {shown}"


def resolve_device(requested: str) -> DeviceChoice:
    """``requested``: auto, cpu, cuda or cuda:N. Raises ValueError when it cannot be honoured."""
    if requested == "cpu":
        return DeviceChoice("cpu", "--device cpu")
    if requested == "auto":
        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
            return DeviceChoice("cuda", f"--device auto: torch sees {torch.cuda.device_count()} CUDA device(s), "
                                        f"using cuda:0 ({name})")
        return DeviceChoice("cpu", f"--device auto: torch sees no CUDA device ({_cuda_state()})")
    index = 0
    if requested != "cuda":
        match = _CUDA_INDEX.fullmatch(requested)
        if match is None:
            raise ValueError(f"--device {requested!r}: expected one of auto, cpu, cuda or cuda:N")
        index = int(match.group(1))
    if not torch.cuda.is_available():
        raise ValueError(f"--device {requested}: torch sees no CUDA device ({_cuda_state()}); "
                         f"use --device auto or cpu to run on the CPU")
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {requested}: torch sees only {torch.cuda.device_count()} CUDA device(s)")
    return DeviceChoice(requested, f"--device {requested} ({torch.cuda.get_device_name(index)})")
