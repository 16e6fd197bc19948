"""Row gathers, scatters and copies of byte blocks, safe to run on any thread.

Blocks travel as uint8 ``[n, block_bytes]`` tensors. On the CPU the rows are moved by numpy (one thread,
no OpenMP): the tier stores and the transfer workers run these on helper threads, and a torch op that
opens an OpenMP team on a second thread makes libgomp count more threads than CPUs and throttle its
spin-waiting, which slowed every parallel op of the decode loop afterwards (measured on 2 cores: the
model's linear layers 40% slower for the rest of the run). numpy moves the same rows at memcpy speed.
Device tensors use torch (PyTorch's own streams, no host threads). Where the rows allow it, they are
moved as int64 words (8x fewer elements than bytes).
"""

from __future__ import annotations

import numpy as np
import torch


def _np(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor [n, B] uint8 as a numpy view, as int64 words when the layout allows."""
    a = t.numpy()
    if a.ndim == 2 and a.shape[1] % 8 == 0 and a.strides[1] == 1 and a.strides[0] % 8 == 0 and a.ctypes.data % 8 == 0:
        return a.view(np.int64)
    return a


def _idx(idx: list[int] | torch.Tensor) -> np.ndarray:
    return idx.cpu().numpy() if isinstance(idx, torch.Tensor) else np.asarray(idx, dtype=np.int64)


def gather_rows(src: torch.Tensor, idx: list[int] | torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``src[idx]`` for src [n, B] uint8 -> [len(idx), B] uint8 (into ``out`` when given)."""
    n = len(idx)
    if out is None:
        out = torch.empty((n, src.shape[1]), dtype=src.dtype, device=src.device)
    if src.device.type != "cpu" or out.device.type != "cpu":
        i = idx.to(src.device) if isinstance(idx, torch.Tensor) else torch.tensor(idx, device=src.device)
        out.copy_(src.index_select(0, i), non_blocking=True)
        return out
    s, o = _np(src), _np(out)
    if s.dtype == o.dtype:
        np.take(s, _idx(idx), axis=0, out=o)
    else:
        np.take(src.numpy(), _idx(idx), axis=0, out=out.numpy())
    return out


def scatter_rows(dst: torch.Tensor, idx: list[int] | torch.Tensor, rows: torch.Tensor) -> None:
    """``dst[idx] = rows`` for dst [n, B] uint8 and rows [len(idx), B] uint8 (any devices)."""
    if dst.device.type != "cpu":
        i = idx.to(dst.device) if isinstance(idx, torch.Tensor) else torch.tensor(idx, device=dst.device)
        dst.index_copy_(0, i, rows.to(dst.device, non_blocking=True))
        return
    rows = rows.cpu().contiguous()
    d, r = _np(dst), _np(rows)
    if d.dtype != r.dtype:
        d, r = dst.numpy(), rows.numpy()
    d[_idx(idx)] = r


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for same-shape byte rows, by numpy on the CPU."""
    if dst.device.type != "cpu" or src.device.type != "cpu":
        dst.copy_(src, non_blocking=True)
    else:
        np.copyto(dst.numpy(), src.numpy())
