"""Fast row gathers and scatters of byte blocks.

Blocks travel as uint8 ``[n, block_bytes]`` tensors. PyTorch's CPU ``index_copy_`` / index assignment
on uint8 rows moves one byte per element and is 4-8x slower than the same operation on the rows seen
as int64 words (measured: 16 rows of 48 KiB, 450 us as uint8 vs 60-115 us as int64). These helpers
take the wide view whenever the rows allow it (width a multiple of 8, 8-byte aligned storage) and
fall back to the byte view otherwise; the bytes moved are identical either way.
"""

from __future__ import annotations

import torch


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` [n, B] uint8 viewed as [n, B / 8] int64 when layout allows, else ``t`` itself."""
    if (t.dtype == torch.uint8 and t.dim() == 2 and t.shape[1] % 8 == 0 and t.stride(1) == 1
            and t.stride(0) % 8 == 0 and t.data_ptr() % 8 == 0):
        return t.view(torch.int64)
    return t


def _index(idx: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(idx, torch.Tensor):
        return idx.to(device=device, dtype=torch.long)
    return torch.tensor(idx, dtype=torch.long, device=device)


def gather_rows(src: torch.Tensor, idx: list[int] | torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``src[idx]`` for src [n, B] uint8 -> [len(idx), B] uint8 (into ``out`` when given, same device)."""
    ws = _wide(src)
    i = _index(idx, src.device)
    if out is None:
        return ws.index_select(0, i).view(torch.uint8).view(len(i), src.shape[1])
    wo = _wide(out)
    if wo.dtype == ws.dtype and out.device == src.device and out.is_contiguous():
        torch.index_select(ws, 0, i, out=wo)
    else:
        out.copy_(src.index_select(0, i), non_blocking=True)
    return out


def scatter_rows(dst: torch.Tensor, idx: list[int] | torch.Tensor, rows: torch.Tensor) -> None:
    """``dst[idx] = rows`` for dst [n, B] uint8 and rows [len(idx), B] uint8 (any device)."""
    rows = rows.to(dst.device, non_blocking=True)
    wd, wr = _wide(dst), _wide(rows.contiguous())
    i = _index(idx, dst.device)
    if wd.dtype == wr.dtype:
        wd.index_copy_(0, i, wr)
    else:
        dst.index_copy_(0, i, rows)
