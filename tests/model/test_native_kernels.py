"""The CPU kernels' extension (``runtime/native``) and the decode layer's paged kernels:

- the runtime image's prebuilt folder is loaded when it matches, refused when stale;
- ``select`` picks the pages ``select_pages`` picks, and ``attend`` computes what ``decode_attention`` computes
  over a gathered buffer, reading hits in place in the pool and misses from a staging buffer, in each
  KV dtype, for short sequences and padding;
- bad indices are refused with a message, never read;
- RoPE and RMSNorm round as their torch formulas; the block GEMV gives each row the same sum however it tiles;
- a tiered engine decodes the same tokens with the kernels as with the torch ops.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvdrive.runtime import native
from kvdrive.runtime.attention import (
    SelectionConfig,
    decode_attention,
    paged_kernels,
    select_pages,
    selection_masks,
    sketch_weights,
    sketched_rest,
)
from kvdrive.runtime.attention.summaries import key_bounds, key_codes, value_codes
from kvdrive.runtime.model import block_kernels
from kvdrive.runtime.model.gguf_blocks import Blocks
from kvdrive.runtime.model.layers import RMSNorm

HKV, G, D, S = 3, 3, 64, 16


@pytest.fixture(autouse=True)
def _built() -> None:
    if native.unavailable_reason():
        pytest.skip(f"CPU kernels unavailable here: {native.unavailable_reason()}")


def test_a_prebuilt_folder_is_loaded_when_it_matches_and_refused_when_stale(tmp_path: Path) -> None:
    """The runtime image's way (no compiler in the pod): ``python -m kvdrive.runtime.native DIR`` at build
    time, ``$KVDRIVE_KERNELS=DIR`` at run time. A build of other sources, flags or torch is refused."""
    folder = tmp_path / "kernels"
    done = subprocess.run([sys.executable, "-m", "kvdrive.runtime.native", str(folder)],
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr
    assert (folder / f"{native.NAME}.so").is_file()
    module, why = native.build.prebuilt(folder)
    assert why == "" and module is not None
    levels = torch.randint(-8, 8, (40, 64), dtype=torch.int8)
    b = Blocks(levels, torch.rand(40, 2) + 0.1, None, 32)
    packed = block_kernels.pack(b, False)
    assert torch.equal(module.block_dequant(packed.q, packed.scale, packed.offset, packed.nib, False), b.dequantize())
    assert hasattr(module, "paged_decode") and hasattr(module, "select_pages")

    (folder / native.STAMP).write_text("0" * 64 + "\n")
    module, why = native.build.prebuilt(folder)
    assert module is None and "other sources, flags or torch" in why
    module, why = native.build.prebuilt(tmp_path / "empty")
    assert module is None and "holds no build" in why


def test_a_build_killed_half_way_does_not_hang_the_next_start() -> None:
    """torch's builder waits while its ``lock`` file exists, and a build killed half-way leaves it behind. The
    next start (here a fresh process over the built folder) finds it while holding the builders' flock, so it
    knows the file is stale: it removes it, says so, and loads."""
    baton = native.build.build_directory() / "lock"
    baton.touch()
    done = subprocess.run([sys.executable, "-c", "import logging; logging.basicConfig(); "
                           "from kvdrive.runtime import native; print(repr(native.unavailable_reason()))"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "''", done.stdout  # loaded
    assert "left behind by a build of the CPU kernels that was killed" in done.stderr
    assert not baton.exists()


def _case(batch: int, dtype: torch.dtype, seed: int = 0, hkv: int = HKV, group: int = G,
          d: int = D) -> dict[str, torch.Tensor]:
    """A pool of 400 slots, 32 columns a sequence (the last the open page), two of them staged misses, a
    second sequence with only 20 pages (the rest padding)."""
    g = torch.Generator().manual_seed(seed)
    w = 32
    pool = torch.randn(400, 2, hkv, S, d, generator=g).to(dtype)
    stage = torch.randn(3, 2, hkv, S, d, generator=g).to(dtype)
    slots = torch.randint(0, 400, (batch, w), generator=g)
    slots[:, 5], slots[:, 11] = -1, -3
    ntok = torch.full((batch, w), S)
    ntok[:, -1] = 7  # the open page's written tokens
    if batch > 1:
        ntok[1, 20:-1] = 0
        slots[1, 20:-1] = 10_000  # padding: never read
    q = torch.randn(batch, hkv * group, d, generator=g)
    return {"pool": pool, "stage": stage, "slots": slots, "ntok": ntok, "q": q}


def _gathered(c: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch path's buffer: K, V [B, Hkv, W * S, D] and the mask of what is not attended."""
    b, w = c["slots"].shape
    hkv, d = c["pool"].shape[2], c["pool"].shape[4]
    blocks = torch.stack([c["pool"][s] if 0 <= s < 400 else c["stage"][-1 - s] if s < 0 else c["pool"][0]
                          for s in c["slots"].view(-1).tolist()]).view(b, w, 2, hkv, S, d)
    k = blocks[:, :, 0].permute(0, 2, 1, 3, 4).reshape(b, hkv, w * S, d).float()
    v = blocks[:, :, 1].permute(0, 2, 1, 3, 4).reshape(b, hkv, w * S, d).float()
    mask = (torch.arange(S)[None, None, :] >= c["ntok"][:, :, None]).reshape(b, 1, 1, w * S)
    return k, v, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 2])
def test_attend_in_place_equals_attention_over_the_gathered_pages(dtype: torch.dtype, batch: int) -> None:
    c = _case(batch, dtype)
    k, v, mask = _gathered(c)
    ref, probs = decode_attention(c["q"], k, v, mask)  # float32 over the same (rounded) values
    out, mass = paged_kernels.attend(c["q"], c["pool"].view(-1, S * D), c["stage"], c["slots"], c["ntok"], HKV, S)
    assert out.shape == ref.shape and mass.shape == c["slots"].shape
    assert torch.allclose(out, ref, atol=2e-6, rtol=1e-5), (out - ref).abs().max()
    ref_mass = probs.view(batch, -1, c["slots"].shape[1], S).sum(dim=(1, 3))
    assert torch.allclose(mass, ref_mass, atol=2e-6, rtol=1e-5)
    assert torch.allclose(mass.sum(dim=1), torch.full((batch,), HKV * G * 1.0), atol=1e-4)  # every head's whole mass
    if batch > 1:
        assert torch.all(mass[1, 20:-1] == 0)  # padding draws nothing


# (KV heads, query heads per KV head, head dim): SmolLM2's and Gemma 3's shapes have units compiled for them;
# 2 x 5 x 32 takes the unit that reads its shape at run time
SHAPES = [(3, 3, 64), (1, 4, 256), (2, 5, 32)]


@pytest.mark.parametrize(("hkv", "group", "d"), SHAPES)
def test_every_shape_attends_and_selects_as_the_torch_ops_do(hkv: int, group: int, d: int) -> None:
    c = _case(2, torch.float32, seed=5, hkv=hkv, group=group, d=d)
    k, v, mask = _gathered(c)
    ref, probs = decode_attention(c["q"], k, v, mask)
    out, mass = paged_kernels.attend(c["q"], c["pool"].view(-1, S * d), c["stage"], c["slots"], c["ntok"], hkv, S)
    assert torch.allclose(out, ref, atol=2e-6, rtol=1e-5), (out - ref).abs().max()
    assert torch.allclose(mass, probs.view(2, -1, c["slots"].shape[1], S).sum(dim=(1, 3)), atol=2e-6, rtol=1e-5)
    g = torch.Generator().manual_seed(d)
    cfg = SelectionConfig(token_budget=512, page_size=S)
    summaries = torch.randn(2, hkv, 300, 2 * d, generator=g)
    summaries[..., d:] = summaries[..., d:].abs()
    drawn = torch.rand(2, 300, generator=g) * 0.2
    npages = torch.tensor([300, 250])
    idx, near, _ = select_pages(c["q"], summaries, selection_masks(npages, 300, cfg), cfg, 8, drawn)
    got = paged_kernels.select(c["q"], summaries, drawn, npages, cfg, 8)
    k_idx, k_near = got.pages, got.near
    assert torch.equal(k_idx, idx) and torch.equal(k_near, near)


def test_one_sequence_splits_its_pages_over_the_threads_and_merges_exactly() -> None:
    """With one sequence the kernel splits each head's pages into parts (both cores busy) and merges their
    softmax maxima: the result does not depend on the thread count."""
    c = _case(1, torch.float32, seed=3)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            outs.append(paged_kernels.attend(c["q"], c["pool"].view(-1, S * D), c["stage"], c["slots"], c["ntok"],
                                             HKV, S))
    finally:
        torch.set_num_threads(threads)
    for out, mass in outs[1:]:
        assert torch.allclose(out, outs[0][0], atol=1e-6) and torch.allclose(mass, outs[0][1], atol=1e-6)


def test_bad_indices_are_refused_with_a_message_never_read() -> None:
    c = _case(1, torch.float32)
    rows = c["pool"].view(-1, S * D)
    slots = c["slots"].clone()
    slots[0, 2] = 400  # past the pool
    with pytest.raises(RuntimeError, match="out of the pool or stage"):
        paged_kernels.attend(c["q"], rows, c["stage"], slots, c["ntok"], HKV, S)
    slots[0, 2] = -4  # past the stage's 3 blocks
    with pytest.raises(RuntimeError, match="out of the pool or stage"):
        paged_kernels.attend(c["q"], rows, c["stage"], slots, c["ntok"], HKV, S)
    ntok = c["ntok"].clone()
    ntok[0, 0] = S + 1
    with pytest.raises(RuntimeError, match="ntok out of"):
        paged_kernels.attend(c["q"], rows, c["stage"], c["slots"], ntok, HKV, S)
    with pytest.raises(RuntimeError, match="float32"):
        paged_kernels.attend(c["q"].double(), rows, c["stage"], c["slots"], c["ntok"], HKV, S)


@pytest.mark.parametrize(("batch", "radius"), [(1, 1.0), (3, 1.0), (3, 0.5), (1, 0.0)])
def test_select_picks_the_pages_select_pages_picks(batch: int, radius: float) -> None:
    """The same bound (the radius weighed alike), softmax, drawn mass, forced sinks and recent pages, and
    order, over strided views of a summary table (rows 1..B of a larger one), with a short second sequence."""
    g = torch.Generator().manual_seed(batch)
    cfg = SelectionConfig(token_budget=512, page_size=S, radius_scale=radius)
    p = 300
    table = torch.randn(batch + 2, HKV, 400, 2 * D, generator=g)
    table[..., D:] = table[..., D:].abs()
    summaries = table[1 : batch + 1, :, :p]
    drawn = (torch.rand(batch + 2, 400, generator=g) * 0.2)[1 : batch + 1, :p]
    npages = torch.full((batch,), p, dtype=torch.int64)
    if batch > 1:
        npages[1] = 20  # fewer pages than the budget (31): all of them, then padding indices
    q = torch.randn(batch, HKV * G, D, generator=g)
    idx, near, _ = select_pages(q, summaries, selection_masks(npages, p, cfg), cfg, 12, drawn)
    got = paged_kernels.select(q, summaries, drawn, npages, cfg, 12)
    k_idx, k_near = got.pages, got.near
    assert k_idx.shape == idx.shape and k_near.shape == near.shape
    assert torch.equal(k_idx[0], idx[0]) and torch.equal(k_near[0], near[0])
    if batch > 1:
        assert torch.equal(k_idx[1, :20], torch.arange(20)) and torch.all(k_idx[1, 20:] >= 20)
        assert torch.equal(idx[1, :20], torch.arange(20))
        assert torch.equal(k_idx[2], idx[2]) and torch.equal(k_near[2], near[2])
    forced = torch.tensor([0, p - 4, p - 3, p - 2, p - 1])
    assert torch.isin(forced, k_idx[0]).all()  # the sink and the recent window


@pytest.mark.parametrize(("bits", "group"), [(8, G), (4, G), (8, 7), (4, 7)])
def test_select_with_a_key_sketch_picks_the_pages_select_pages_picks(bits: int, group: int) -> None:
    """Pages scored by their sketched keys (each page's log-sum-exp of its 16 keys' scores, then the same
    softmax over pages): the kernel picks what the torch ops pick, over strided views of a table's rows, with
    a short second sequence; and the sketch ranks pages differently from the bound (it is not ignored)."""
    g = torch.Generator().manual_seed(bits + group)
    batch, p = 3, 300
    cfg = SelectionConfig(token_budget=512, page_size=S, sketch_bits=bits)
    keys = torch.randn(batch + 2, p, HKV, S, D, generator=g) * 2
    bounds = key_bounds(keys.flatten(0, 1)).view(batch + 2, p, HKV, 2 * D)
    codes = key_codes(keys.flatten(0, 1), bounds.flatten(0, 1), bits).view(batch + 2, p, HKV, D * bits // 8, S)
    summaries = bounds.transpose(1, 2)[1 : batch + 1]  # [B, Hkv, P, 2D], a strided view
    sketch = codes.transpose(1, 2)[1 : batch + 1]  # [B, Hkv, P, D * bits / 8, S]
    drawn = torch.zeros(batch, p)
    npages = torch.tensor([p, 20, p])
    q = torch.randn(batch, HKV * group, D, generator=g)
    masks = selection_masks(npages, p, cfg)
    idx, near, _ = select_pages(q, summaries, masks, cfg, 12, drawn, sketch)
    got = paged_kernels.select(q, summaries, drawn, npages, cfg, 12, sketch)
    k_idx, k_near = got.pages, got.near
    for b in (0, 2):
        assert len(set(k_idx[b].tolist()) ^ set(idx[b].tolist())) <= 2  # float sums in another order: a tie at
        assert len(set(k_near[b].tolist()) & set(near[b].tolist())) >= 10  # the cut may fall either way
    assert torch.equal(k_idx[1, :20], torch.arange(20)) and torch.all(k_idx[1, 20:] >= 20)
    bound_idx = paged_kernels.select(q, summaries, drawn, npages, replace(cfg, sketch_bits=0), 12).pages
    assert not torch.equal(bound_idx[0], k_idx[0])
    with pytest.raises(RuntimeError, match="codes: "):
        paged_kernels.select(q, summaries, drawn, npages, cfg, 12, sketch[:, :, :, :1])


@pytest.mark.parametrize("group", [G, 7])
def test_select_returns_the_sketch_weights_sketch_weights_computes(group: int) -> None:
    """Asked for them, the kernel returns each page's share of each query head's sketched softmax and its log
    normaliser: what ``sketch_weights`` computes, zero past a short sequence's pages."""
    g = torch.Generator().manual_seed(group)
    batch, p = 2, 120
    cfg = SelectionConfig(token_budget=256, page_size=S, sketch_bits=8)
    keys = torch.randn(batch, p, HKV, S, D, generator=g) * 2
    bounds = key_bounds(keys.flatten(0, 1)).view(batch, p, HKV, 2 * D)
    codes = key_codes(keys.flatten(0, 1), bounds.flatten(0, 1), 8).view(batch, p, HKV, D, S)
    summaries, sketch = bounds.transpose(1, 2), codes.transpose(1, 2)
    npages = torch.tensor([p, 30])
    q = torch.randn(batch, HKV * group, D, generator=g)
    ref = sketch_weights(q, summaries, sketch, 8, selection_masks(npages, p, cfg).invalid)
    got = paged_kernels.select(q, summaries, torch.zeros(batch, p), npages, cfg, 4, sketch, weights=True).weights
    assert got is not None and got.share.shape == (batch, HKV, group, p)
    assert torch.allclose(got.share, ref.share, atol=1e-5) and torch.allclose(got.log_total, ref.log_total, atol=1e-4)
    assert float(got.share[1, :, :, 30:].abs().sum()) == 0.0
    assert paged_kernels.select(q, summaries, torch.zeros(batch, p), npages, cfg, 4, sketch).weights is None


@pytest.mark.parametrize("batch", [1, 2])
def test_attend_with_the_rest_column_equals_the_torch_ops(batch: int) -> None:
    """The pages a selection left out, as one more column per query head (``rest_of_pages``): the kernel merges
    it as ``decode_attention`` does, and its weight comes out of the pages' masses; a rest of -inf (nothing
    left out) changes nothing."""
    c = _case(batch, torch.float32, seed=3)
    k, v, mask = _gathered(c)
    g = torch.Generator().manual_seed(9)
    lse = torch.randn(batch, HKV, G, generator=g) * 2 + 3
    mean = torch.randn(batch, HKV, G, D, generator=g)
    ref, probs = decode_attention(c["q"], k, v, mask, (lse, mean))
    rows = c["pool"].view(-1, S * D)
    out, mass = paged_kernels.attend(c["q"], rows, c["stage"], c["slots"], c["ntok"], HKV, S, (lse, mean))
    assert torch.allclose(out, ref, atol=1e-5)
    assert torch.allclose(mass, probs.view(batch, -1, 32, S).sum(dim=(1, 3)), atol=1e-5)
    assert float(mass.sum()) < batch * HKV * G - 0.01  # the rest drew its share
    plain, _ = paged_kernels.attend(c["q"], rows, c["stage"], c["slots"], c["ntok"], HKV, S)
    none = torch.full_like(lse, float("-inf"))
    same, _ = paged_kernels.attend(c["q"], rows, c["stage"], c["slots"], c["ntok"], HKV, S, (none, torch.zeros_like(mean)))
    assert torch.equal(same, plain) and not torch.allclose(out, plain, atol=1e-3)


@pytest.mark.parametrize(("bits", "group", "d"), [(8, 7, 64), (4, 7, 64), (8, G, D), (8, 5, 32)])
def test_select_with_the_value_sketch_gives_the_rest_the_torch_ops_give(bits: int, group: int, d: int) -> None:
    """``--selection-rest sketch``: in the same pass as the selection, the kernel computes the left-out pages'
    column (a softmax over all pages' sketched keys weighing their sketched values, less the selected pages'
    part) and gives the torch path's logit and value for the pages it selected, over strided views of a
    table's rows, with a short second sequence; a sequence with every page selected has nothing left (-inf,
    0); the selection is the one without the value sketch; a 2 x 5 x 32 shape takes the unit that reads its
    shape at run time."""
    g = torch.Generator().manual_seed(bits + group + d)
    batch, p, hkv = 3, 150, 2
    cfg = SelectionConfig(token_budget=13 * S, page_size=S, sketch_bits=bits)
    keys = torch.randn(batch + 1, p, hkv, S, d, generator=g) * 2
    vals = torch.randn(batch + 1, p, hkv, S, d, generator=g)
    bounds = key_bounds(keys.flatten(0, 1)).view(batch + 1, p, hkv, 2 * d)
    codes = key_codes(keys.flatten(0, 1), bounds.flatten(0, 1), bits).view(batch + 1, p, hkv, d * bits // 8, S)
    vbox = key_bounds(vals.flatten(0, 1)).view(batch + 1, p, hkv, 2 * d)
    vcodes = value_codes(vals.flatten(0, 1), vbox.flatten(0, 1)).view(batch + 1, p, hkv, S, d)
    summ, sketch = bounds.transpose(1, 2)[1:], codes.transpose(1, 2)[1:]  # strided views: rows 1..3
    vb, vc = vbox.transpose(1, 2)[1:], vcodes.transpose(1, 2)[1:]
    npages = torch.tensor([p, 30, 12])
    q = torch.randn(batch, hkv * group, d, generator=g)
    drawn = torch.zeros(batch, p)
    got = paged_kernels.select(q, summ, drawn, npages, cfg, 4, sketch, values=(vb, vc))
    assert got.rest is not None and got.weights is None
    plain = paged_kernels.select(q, summ, drawn, npages, cfg, 4, sketch)
    assert torch.equal(got.pages[:2], plain.pages[:2]) and plain.rest is None
    invalid = torch.arange(p)[None, :] >= npages[:, None]
    ref_lse, ref_mean = sketched_rest(q, summ, sketch, bits, vb, vc, got.pages, invalid)
    lse, mean = got.rest
    assert torch.allclose(lse[:2], ref_lse[:2], atol=1e-3) and torch.allclose(mean[:2], ref_mean[:2], atol=1e-3)
    assert bool(torch.isneginf(lse[2]).all()) and float(mean[2].abs().sum()) == 0.0
    with pytest.raises(RuntimeError, match="vcodes: "):
        paged_kernels.select(q, summ, drawn, npages, cfg, 4, sketch, values=(vb, vc.transpose(-1, -2)))


def test_locate_finds_each_pages_slot_and_counts_the_reads_by_tier() -> None:
    """Page ids map to arena slots (device slots below ``dram_base``, DRAM slots from it, < 0 in neither);
    padding entries are not counted; the open page's slot comes last; an id past the table is refused."""
    slot_of = torch.tensor([5, -1, 120, 7, -1, 130, -1])  # page id 6 is the scratch id (padding)
    pids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 6]])
    valid = torch.tensor([[True, True, True, True], [True, True, False, False]])
    slots, n_dev, n_dram, n_miss = paged_kernels.locate(slot_of, pids, valid, torch.tensor([900, 901]), 100)
    assert slots.tolist() == [[5, -1, 120, 7, 900], [-1, 130, -1, -1, 901]]
    assert (n_dev, n_dram, n_miss) == (2, 2, 2)
    with pytest.raises(RuntimeError, match="page id 7 out of"):
        paged_kernels.locate(slot_of, torch.tensor([[7]]), torch.tensor([[True]]), torch.tensor([0]), 100)


def test_rope_rotates_queries_and_keys_as_torch_does_bit_for_bit() -> None:
    """The kernel reads q and k through their strides (views of a fused qkv projection) and rounds as the
    torch formula rounds: equal bit for bit, so a model's outputs do not change with the kernels."""
    g = torch.Generator().manual_seed(7)
    n, hq, hkv, d = 5, 9, 3, 64
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(n, hq, d), k.view(n, hkv, d)
    angles = torch.rand(n, 1, d, generator=g) * 100
    cos, sin = angles.cos(), angles.sin()
    rq, rk = native.kernels().rope_rotate(q, k, cos, sin)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1)

    assert torch.equal(rq, q * cos + rotate_half(q) * sin) and torch.equal(rk, k * cos + rotate_half(k) * sin)
    with pytest.raises(RuntimeError, match="float32"):
        native.kernels().rope_rotate(q.double(), k, cos, sin)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_rounds_as_the_torch_formula_up_to_the_sum_of_squares(offset: float) -> None:
    """Llama's ``w * (x r)`` and Gemma's ``(x r) (1 + w)``, over rows read through their strides (Gemma's q/k
    norms get views of the fused qkv projection): equal to the torch formula within a rounding of r."""
    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(64, 1e-6, offset)
    norm.weight.data = torch.randn(64, generator=g) * 0.2 + (1.0 - offset)
    qkv = torch.randn(5, 15 * 64, generator=g) * 4
    q = qkv.split([9 * 64, 6 * 64], dim=-1)[0].reshape(5, 9, 64)  # strides (960, 64, 1)
    for x in (q, qkv[:, :64].contiguous(), torch.zeros(2, 64)):
        xf = x.float()
        r = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)
        ref = norm.weight * r if offset == 0.0 else r * (offset + norm.weight)
        got = norm(x)
        assert got.is_contiguous() and got.shape == x.shape
        assert torch.allclose(got, ref, rtol=1e-6, atol=0.0)
    with pytest.raises(RuntimeError, match="float32"):
        native.kernels().rms_norm(q.double(), norm.weight, 1e-6, offset)
    with pytest.raises(RuntimeError, match="weight"):
        native.kernels().rms_norm(q, norm.weight[:32], 1e-6, offset)


def test_block_gemv_gives_each_row_the_same_sum_whether_rows_are_walked_singly_or_in_pairs() -> None:
    """One input row walks the weight a row at a time, several walk it in pairs (``paired_rows``): each
    output is the same sum either way, bit for bit."""
    g = torch.Generator().manual_seed(5)
    b = Blocks(torch.randint(0, 16, (37, 128), dtype=torch.int8, generator=g), torch.rand(37, 4, generator=g),
               torch.rand(37, 4, generator=g), 32)
    x = torch.randn(4, 128, generator=g)
    for nib in (True, False):
        packed = block_kernels.pack(b, nib)
        together = block_kernels.gemv(x, packed)
        for i in range(4):
            assert torch.equal(block_kernels.gemv(x[i : i + 1], packed), together[i : i + 1])


@pytest.mark.parametrize("nib", [True, False])
def test_dequantizing_to_bfloat16_rounds_exactly_as_torch_casts_the_float32_weights(nib: bool) -> None:
    """A prompt chunk's bf16 GEMM takes its weights from one pass (``dequantize(.., torch.bfloat16)``): the
    same values as the float32 dequantization cast by torch, bit for bit, ties to even included."""
    g = torch.Generator().manual_seed(11)
    levels = torch.randint(0, 16, (53, 256), dtype=torch.int8, generator=g) if nib else \
        torch.randint(-127, 128, (53, 256), dtype=torch.int8, generator=g)
    b = Blocks(levels, torch.randn(53, 8, generator=g) * 0.05, torch.randn(53, 8, generator=g) if nib else None, 32)
    packed = block_kernels.pack(b, nib)
    exact = block_kernels.dequantize(packed)
    halves = block_kernels.dequantize(packed, torch.bfloat16)
    assert halves.dtype == torch.bfloat16 and torch.equal(halves, exact.to(torch.bfloat16))
    assert not torch.equal(halves.float(), exact)  # the rounding really happened
    ties = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8)])  # halfway: to the even neighbour
    b = Blocks(torch.ones(3, 32, dtype=torch.int8), ties[:, None].clone(), None, 32)
    assert torch.equal(block_kernels.dequantize(block_kernels.pack(b, False), torch.bfloat16)[:, 0],
                       ties.to(torch.bfloat16))
