"""A decode layer's selection and attention as CPU kernels (``native/kernels/paged_decode.cpp``).

``select`` computes what ``selection.select_pages`` computes (the same bound, softmax, drawn mass, forced
pages and order) and, under ``--selection-rest``, what the left-out pages' column needs (``Selected``), and
``attend`` what ``sparse.decode_attention`` computes over a gathered buffer, with each page's attention mass
summed over the query heads. The difference is where the K/V rows are read:
``attend`` reads each selected page in place in the KV pool (or, for a page that missed every memory tier,
in a staging buffer of the blocks the store returned), so a step no longer copies its pages into a buffer
before attending. Measured on this project's 2-core host (demo model, 64 pages of 16 tokens, batch 1,
float32, kernels compiled for its 3 x 64 heads): select 20 us with the summaries in cache, 35 cold (100 us
for the torch ops); attention 36 us in cache, about 100 cold (about 400 us for the gather plus the torch
attention). Both run on a CPU with AVX-512 only (``available``); elsewhere the backend keeps the torch ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvdrive.runtime import native
from kvdrive.runtime.attention.selection import SelectionConfig, SketchWeights

MAX_GROUP = 16  # query heads per KV head (the kernel keeps their queries in registers)
MAX_HEAD_DIM = 512  # and a head dimension that is a multiple of 16 (one AVX-512 vector)
_NONE, _NONE_U8 = torch.empty(0), torch.empty(0, dtype=torch.uint8)  # an optional tensor argument left out


def _module() -> Any:
    """The built extension (callers have checked ``available``)."""
    module = native.kernels()
    assert module is not None, "paged kernels used where they are not available"
    return module


def available(device: torch.device) -> bool:
    """Whether the kernels can serve decode steps on ``device`` (a CPU whose kernels are built)."""
    return device.type == "cpu" and native.kernels() is not None


SKETCH_PAGE = 16  # the page size select() takes a key sketch at (one page's tokens are one vector's lanes)


@dataclass(frozen=True)
class Selected:
    """What ``select`` returns for one decode layer's batch."""

    pages: torch.Tensor  # [B, K] int64 ascending
    near: torch.Tensor  # [B, R'] the runners-up by score
    weights: SketchWeights | None  # the key sketch's weights, when asked for
    rest: tuple[torch.Tensor, torch.Tensor] | None  # (lse [B, Hkv, G], mean [B, Hkv, G, D]), given the value sketch


def fits(q: torch.Tensor, num_kv_heads: int) -> bool:
    """Whether queries q [B, Hq, D] are of a shape and dtype the kernels take (float32; D a multiple of 16)."""
    _, hq, d = q.shape
    return q.dtype == torch.float32 and d % 16 == 0 and d <= MAX_HEAD_DIM and hq // num_kv_heads <= MAX_GROUP


def select(q: torch.Tensor, summaries: torch.Tensor, drawn: torch.Tensor, npages: torch.Tensor,
           cfg: SelectionConfig, runners_up: int, codes: torch.Tensor | None = None, weights: bool = False,
           values: tuple[torch.Tensor, torch.Tensor] | None = None) -> Selected:
    """q [B, Hq, D] float32; summaries [B, Hkv, P, 2D]; drawn [B, P]; npages [B] int64; codes [B, Hkv, P,
    D * bits / 8, S] (the key sketch when ``cfg.sketch_bits``; 16-token pages); values (vbox [B, Hkv, P, 2D],
    vcodes [B, Hkv, P, 16, D]: the value sketch, with a key sketch) -> the selected pages [B, K] int64
    ascending, the runners-up [B, min(P, K + R) - K] by score (``select_pages``), when ``weights`` is asked
    for (with a sketch) the sketch's weights (``selection.sketch_weights``) and, given the value sketch, the
    column of the pages left out (``selection.sketched_rest``), computed in the same pass over the pages."""
    bits = cfg.sketch_bits if codes is not None else 0
    vbox, vcodes = values if values is not None and bits else (_NONE, _NONE_U8)
    out = _module().select_pages(q.contiguous(), summaries, drawn, npages, cfg.sink_pages, cfg.recent_pages,
                                 cfg.budget_pages, runners_up, cfg.radius_scale,
                                 codes if codes is not None else _NONE_U8, bits, weights and bits > 0, vbox, vcodes)
    w = SketchWeights(out[2], out[3]) if weights and bits else None
    rest = (out[-2], out[-1]) if vbox.numel() else None
    return Selected(out[0], out[1], w, rest)


def locate(slot_of: torch.Tensor, pids: torch.Tensor, valid: torch.Tensor, tails: torch.Tensor,
           dram_base: int) -> tuple[torch.Tensor, int, int, int]:
    """slot_of [Pcap + 1] int64 (a layer's arena slot per page id, < 0: in neither memory tier); pids [B, K];
    valid [B, K] bool; tails [B] (the open pages' slots) -> (slots [B, K + 1] with -1 where a valid entry
    missed, and how many valid entries hit the device tier, hit DRAM (slots from ``dram_base`` on), missed)."""
    return tuple(_module().locate_pages(slot_of, pids, valid, tails, dram_base))  # type: ignore[return-value]


def attend(q: torch.Tensor, rows: torch.Tensor, stage: torch.Tensor, slots: torch.Tensor, ntok: torch.Tensor,
           num_kv_heads: int, page_size: int,
           rest: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, D] float32; rows [R, S * D] the pool's (slot, kv, head) rows; stage [M, 2, Hkv, S, D] the
    blocks read from the store (the rows' dtype); slots [B, W] int64 (a pool slot, or -1 - j for stage block
    j); ntok [B, W] int64 (tokens attended per column, 0 for none); rest (lse [B, Hkv, G], mean [B, Hkv, G,
    D]: the pages left out, ``selection.rest_of_pages``) or None -> out [B, Hq, D] float32, mass [B, W]
    float32 (the attention each column drew, summed over the query heads)."""
    lse, mean = rest if rest is not None else (_NONE, _NONE)
    return tuple(_module().paged_decode(q.contiguous(), rows, stage, slots, ntok, num_kv_heads, page_size,
                                        lse.float().contiguous(), mean.float().contiguous()))  # type: ignore[return-value]
