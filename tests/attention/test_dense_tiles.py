"""Prefill attention of a continuing chunk is computed in query tiles: same result as one pass."""

from __future__ import annotations

import math

import pytest
import torch

from kvdrive.runtime.attention import causal_attention
from kvdrive.runtime.attention.dense import bf16_prefix_available


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [T, Hq, D]
    scores = torch.einsum("nhd,thd->hnt", q, kk) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, None, :] > pos[None, :, None], float("-inf"))
    return torch.einsum("hnt,thd->nhd", torch.softmax(scores, dim=-1), vv)


def test_tiled_chunk_attention_equals_the_explicit_softmax() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(300, 6, 32), torch.randn(1000, 2, 32), torch.randn(1000, 2, 32)
    pos = torch.arange(700, 1000)  # a chunk continuing a 700-token sequence
    ref = _reference(q, k, v, pos)
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)  # head-major, as the cache holds them
    one_pass = causal_attention(q, kh, vh, pos, fused=False)
    tiled = causal_attention(q, kh, vh, pos, tile_bytes=6 * 1000 * 4 * 7, fused=False)  # 7 query rows per tile
    assert torch.allclose(one_pass, ref, atol=1e-5)
    assert torch.allclose(tiled, ref, atol=1e-5)


def test_a_single_row_tile_still_sees_exactly_its_own_prefix() -> None:
    torch.manual_seed(1)
    q, k, v = torch.randn(5, 4, 16), torch.randn(12, 4, 16), torch.randn(12, 4, 16)
    pos = torch.arange(7, 12)
    out = causal_attention(q, k.transpose(0, 1), v.transpose(0, 1), pos, tile_bytes=1, fused=False)
    assert torch.allclose(out, _reference(q, k, v, pos), atol=1e-5)


def test_the_fused_lower_right_path_equals_the_explicit_mask() -> None:
    """The path CUDA takes for a chunk continuing its sequence (forced here on the CPU) gives the same
    result; positions that do not end the sequence keep the explicit mask, and are still exact."""
    torch.manual_seed(2)
    q, k, v = torch.randn(64, 6, 32), torch.randn(400, 2, 32), torch.randn(400, 2, 32)
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)
    pos = torch.arange(336, 400)
    fused = causal_attention(q, kh, vh, pos, fused=True)
    assert torch.allclose(fused, _reference(q, k, v, pos), atol=1e-5)
    gaps = torch.arange(0, 128, 2)  # not one run ending at T-1: only the explicit mask is right
    assert torch.allclose(causal_attention(q, kh[:, :127], vh[:, :127], gaps, fused=True),
                          _reference(q, k[:127], v[:127], gaps), atol=1e-5)


@pytest.mark.parametrize("n,t", [(2, 3), (64, 400), (512, 4096), (300, 300)])
def test_on_the_cpu_a_continuing_chunk_is_prefix_plus_causal_chunk_merged(n: int, t: int) -> None:
    """The CPU's own path for a chunk ending its sequence: the earlier keys without a mask and the chunk's
    own keys causally, merged by log-sum-exp; equal to the explicit softmax (Qwen's 14 query heads over 2)."""
    torch.manual_seed(3)
    q, k, v = torch.randn(n, 14, 64), torch.randn(t, 2, 64), torch.randn(t, 2, 64)
    pos = torch.arange(t - n, t)
    out = causal_attention(q, k.transpose(0, 1), v.transpose(0, 1), pos)
    torch.testing.assert_close(out, _reference(q, k, v, pos), atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not bf16_prefix_available(), reason="needs the CPU kernels on a CPU with AVX512-BF16")
@pytest.mark.parametrize("n,t,hq,hkv,d", [(512, 4096, 14, 2, 64), (3, 5, 14, 2, 64), (37, 167, 4, 4, 32),
                                          (64, 1000, 8, 2, 128)])
def test_bf16_products_stay_within_bfloat16_rounding_of_the_exact_softmax(n: int, t: int, hq: int, hkv: int,
                                                                          d: int) -> None:
    """``products="bf16"``: the prefix's q.k and p.v through the bf16-product kernel. Key counts that are
    not a multiple of its 64-key blocks (the padded keys must weigh nothing), query rows that are not a
    multiple of its tiles, grouped and plain heads, every head size it takes: the output stays within
    bf16's rounding of the float64 softmax, while float32 products are exact (so the test can fail)."""
    torch.manual_seed(5)
    q, k, v = torch.randn(n, hq, d), 2 * torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    pos = torch.arange(t - n, t)
    want = _reference(q.double(), k.double(), v.double(), pos)
    got = causal_attention(q, k.transpose(0, 1), v.transpose(0, 1), pos, products="bf16").double()
    exact = causal_attention(q, k.transpose(0, 1), v.transpose(0, 1), pos).double()
    assert (exact - want).abs().max() < 1e-4
    err = (got - want).abs().max()
    assert 1e-4 < err < 4e-2  # bf16 has an 8-bit mantissa: the products are rounded, not wrong
    assert (got - want).abs().mean() < 4e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_cuda_a_continuing_chunk_attends_through_the_fused_kernel_exactly(dtype: torch.dtype) -> None:
    """The demo model's shapes (9 query heads over 3 KV heads, 64 dims): a 512-token chunk continuing a
    2,048-token sequence, on CUDA, against the explicit softmax on the CPU in float32."""
    torch.manual_seed(3)
    q, k, v = torch.randn(512, 9, 64), torch.randn(2048, 3, 64), torch.randn(2048, 3, 64)
    pos = torch.arange(1536, 2048)
    dev = [x.to("cuda", dtype) for x in (q, k.transpose(0, 1), v.transpose(0, 1))]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = causal_attention(dev[0], dev[1], dev[2], pos.cuda()).float().cpu()
    assert torch.allclose(out, _reference(q, k, v, pos), atol=3e-2 if dtype == torch.bfloat16 else 1e-4)
    kernels = {e.key for e in prof.key_averages() if "scaled_dot_product" in e.key or "attention_forward" in e.key}
    assert not any("math" in name for name in kernels), kernels  # a fused kernel ran, not the math fallback
