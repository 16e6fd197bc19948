"""Weight formats (``--weights``): the GGUF file's own blocks kept as they are, the CPU block kernels that
multiply by them in float32, what ``auto`` picks, and what a decode step computes in each format.

The story: a GGUF stores Q4/Q5/Q6/Q8 blocks. The loader used to expand them to fp32 (4 bytes a weight).
Now ``int8``/``int4`` keep the blocks (levels, scale, offset) and the block kernels compute from them
with float32 inputs, so a step reads 0.75-1.1 bytes a weight and still computes the fp32 model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf_builder import decoded_logits, written_reference

from kvdrive.runtime import native
from kvdrive.runtime.engine import EngineConfig, LLMEngine, ModelRunner
from kvdrive.runtime.model import block_kernels, load_model
from kvdrive.runtime.model.errors import ModelLoadError
from kvdrive.runtime.model.gguf_blocks import BLOCK_EXACT_TYPES, Blocks, read_blocks
from kvdrive.runtime.model.gguf_loader import _dequantize
from kvdrive.runtime.model.quantize import WeightPlan
from kvdrive.runtime.model.registry import demo_model_path
from kvdrive.runtime.model.weight_formats import (
    SMALL_BATCH,
    QuantLinear,
    auto_format,
    host_has_bf16_units,
    requantize,
    resolve_gemm,
    weight_bytes,
)

CPU = torch.device("cpu")


def _relative(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_blocks_are_the_files_values_bit_for_bit(qtype: str) -> None:
    """Levels * scale + offset equals gguf's own dequantization exactly, for every type gguf can write."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, (48, 256)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(w.shape)

    class Tensor:  # the two fields of gguf's ReaderTensor that read_blocks uses
        tensor_type = gguf.GGMLQuantizationType[qtype]
        shape = np.array([256, 48])
        data = raw

    blocks = read_blocks(Tensor())
    assert torch.equal(blocks.dequantize(), torch.from_numpy(expected))
    assert blocks.nibbles_fit() == (qtype in ("Q4_0", "Q4_1"))


def test_real_files_blocks_are_bit_exact() -> None:
    """Every block type in the demo GGUF (Q8_0 embedding, Q4_1 layers) reads back exactly."""
    reader = gguf.GGUFReader(demo_model_path())
    seen: set[str] = set()
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in BLOCK_EXACT_TYPES and kind not in seen and len(t.shape) == 2:
            seen.add(kind)
            blocks = read_blocks(t)
            assert torch.equal(blocks.dequantize(), torch.from_numpy(_dequantize(t).copy()).view(blocks.shape))
    assert seen == {"Q8_0", "Q4_1"}


def _blocks(n: int, k: int, block: int, levels: tuple[int, int], offset: bool, seed: int = 0) -> Blocks:
    g = torch.Generator().manual_seed(seed)
    lv = torch.randint(levels[0], levels[1] + 1, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // block, generator=g) * 0.02
    off = (torch.rand(n, k // block, generator=g) - 0.5) * 0.1 if offset else None
    return Blocks(lv, scale, off, block)


@pytest.mark.parametrize("nib,block,levels,offset", [
    (True, 32, (0, 15), True),  # Q4_1 / Q4_K / Q4_0
    (False, 32, (-127, 127), False),  # Q8_0
    (False, 32, (-16, 15), True),  # Q5_x with an offset
    (False, 16, (-32, 31), False),  # Q6_K's blocks of 16
])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_block_kernels_compute_the_fp32_product(nib: bool, block: int, levels: tuple[int, int], offset: bool,
                                                rows: int) -> None:
    """The kernel's product is the float32 matmul of the dequantized weight up to summation order, for
    every row count a decode batch can have, and an output count that is no multiple of the tile."""
    if native.unavailable_reason():
        pytest.skip(f"block kernels unavailable here: {native.unavailable_reason()}")
    b = _blocks(70, 96, block, levels, offset)
    packed = block_kernels.pack(b, nib)
    w = b.dequantize()
    assert torch.equal(block_kernels.dequantize(packed), w)  # the prompt path's weights: bit for bit
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    ref = x.double() @ w.double().T
    assert _relative(block_kernels.gemv(x, packed), ref) < 2e-6
    assert _relative(F.linear(x, w), ref) < 2e-6


def test_torch_path_without_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host that cannot build the kernels computes the same values (slower) and ``auto`` keeps fp32."""
    monkeypatch.setattr(native.build, "_load", lambda: (None, "no compiler (test)"))
    b = _blocks(40, 64, 32, (0, 15), True)
    packed = block_kernels.pack(b, True)
    x = torch.randn(3, 64)
    assert _relative(block_kernels.gemv(x, packed), x.double() @ b.dequantize().double().T) < 2e-6
    assert torch.equal(block_kernels.dequantize(packed), b.dequantize())
    assert auto_format(["Q4_1"], CPU) == "fp32"


def test_the_command_line_offers_every_format() -> None:
    from kvdrive.runtime import cli_args
    from kvdrive.runtime.model.weight_formats import WEIGHT_CHOICES

    assert cli_args.WEIGHT_CHOICES == WEIGHT_CHOICES


def test_pack_refuses_levels_that_do_not_fit_a_nibble() -> None:
    with pytest.raises(ValueError, match="0..15"):
        block_kernels.pack(_blocks(8, 32, 32, (-16, 15), False), nib=True)


@pytest.mark.parametrize("types,expected", [
    (["Q4_1"], "int4"), (["Q4_K", "Q4_0"], "int4"), (["Q8_0"], "int8"), (["Q5_0", "Q5_0", "Q8_0"], "int8"),
    (["Q6_K"], "int8"), (["Q4_K", "Q6_K"], "int8"), (["BF16"], "bf16"), (["F16"], "fp32"), (["F32"], "fp32"),
    (["Q4_1", "F32"], "fp32"), ([], "fp32"), (["Q2_K"], "fp32"),
])
def test_auto_keeps_each_tensor_in_its_files_format(types: list[str], expected: str) -> None:
    if native.unavailable_reason() and expected in ("int8", "int4"):
        expected = "fp32"
    assert auto_format(types, CPU) == expected


@pytest.mark.parametrize("fmt,bound", [("bf16", 1e-2), ("int8", 2e-2), ("int4", 0.2)])
def test_requantized_float_weights_cost_what_their_format_costs(fmt: str, bound: float) -> None:
    """A float weight asked into a lower format is rounded (stated, and bounded here)."""
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    x = torch.randn(2, 128)
    layer = QuantLinear(w, None, fmt, CPU)
    ref = x.double() @ w.double().T
    err = _relative(layer(x), ref)
    assert 1e-7 < err < bound
    if fmt != "bf16":
        assert torch.equal(requantize(w, fmt).dequantize(), block_kernels.dequantize(layer.packed))


@pytest.mark.parametrize("qtype,weights", [("Q4_1", "auto"), ("Q4_0", "int4"), ("Q8_0", "auto"),
                                           ("Q5_1", "int8"), ("Q4_1", "int8")])
@pytest.mark.parametrize("tie", [False, True])
def test_decode_in_the_files_blocks_matches_the_reference(qtype: str, weights: str, tie: bool,
                                                          hf_model_factory, tmp_path: Path) -> None:
    """A tiny llama written as GGUF (llama.cpp's q/k row order included) decodes in its blocks to what
    transformers computes in fp32 with the same weights."""
    _, ref = hf_model_factory(arch="llama", tie=tie, hidden_size=64, intermediate_size=96)
    ids, expected = written_reference(tmp_path / "tiny.gguf", ref, qtype)
    torch.testing.assert_close(decoded_logits(tmp_path / "tiny.gguf", ids, weights), expected, atol=3e-4, rtol=1e-3)


@pytest.fixture(scope="module")
def demo_formats() -> dict[str, object]:
    return {w: load_model("demo", progress=False, weights=w) for w in ("fp32", "auto")}


def test_demo_auto_keeps_the_files_blocks_at_a_quarter_of_the_bytes(demo_formats: dict[str, object]) -> None:
    auto = demo_formats["auto"]
    fp32 = demo_formats["fp32"]
    if native.unavailable_reason():
        assert auto.weights.summary() == "fp32"  # type: ignore[attr-defined]
        return
    assert auto.weights.summary() == "int4 x 120, int8 x 1"  # type: ignore[attr-defined]
    held, full = sum(weight_bytes(auto.model).values()), sum(weight_bytes(fp32.model).values())  # type: ignore[attr-defined]
    assert held < 0.26 * full, (held, full)
    assert auto.fingerprint != fp32.fingerprint  # type: ignore[attr-defined]


def test_demo_auto_decodes_what_fp32_decodes(demo_formats: dict[str, object]) -> None:
    """Greedy chat answers in ``auto`` are token for token the fp32 ones, and each step's log-probs agree."""
    from kvdrive.runtime.engine import SamplingParams
    from kvdrive.runtime.prompt import ChatMessage

    answers = {}
    for name, loaded in demo_formats.items():
        gen = ModelRunner(loaded, EngineConfig(full_attention=True))  # type: ignore[arg-type]
        ids = loaded.tokenizer.encode_chat([ChatMessage("user", "Name three colours of the rainbow.")])  # type: ignore[attr-defined]
        answers[name] = list(LLMEngine(gen).generate_tokens(ids, SamplingParams(max_tokens=24)))
        gen.close()
    assert answers["auto"] == answers["fp32"]


def _bench_model(weights: str, tmp_path: Path) -> dict:  # type: ignore[type-arg]
    out = tmp_path / f"model-{weights}.json"
    done = subprocess.run([sys.executable, "-m", "kvdrive.runtime.cli", "bench", "model", "--weights", weights,
                           "--threads", "1", "--prefill", "32", "--decode-context", "32", "--decode-tokens", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def test_the_model_bench_shows_the_weights_saving_in_the_resident_set(tmp_path: Path) -> None:
    """`kvdrive bench model` reports the process's resident bytes before and after the load: the demo's
    auto weights (the file's 4/8-bit blocks) must cost the process hundreds of MB less than fp32."""
    if native.unavailable_reason():
        pytest.skip(f"block kernels unavailable here: {native.unavailable_reason()}")
    fp32, auto = _bench_model("fp32", tmp_path), _bench_model("auto", tmp_path)
    assert fp32["weights"] == "fp32: fp32" and auto["weights"].startswith("auto: int4 x ")
    assert fp32["weight_bytes"] > 4 * auto["weight_bytes"]
    growth = {r["weights"]: r["rss_after_load_bytes"] - r["rss_before_load_bytes"] for r in (fp32, auto)}
    assert growth[fp32["weights"]] >= fp32["weight_bytes"] * 0.9  # the weights are resident
    assert growth[fp32["weights"]] - growth[auto["weights"]] >= 0.8 * (fp32["weight_bytes"] - auto["weight_bytes"])


def test_the_weights_bench_checks_fp32_against_itself_and_measures_a_lossy_format() -> None:
    """`kvdrive bench weights`, small: fp32 is its own reference (identical, KL exactly 0); int4 requantizes
    the demo's Q8_0 embedding (lossy), so its KL is above 0 and its bytes are a fraction of fp32's."""
    from kvdrive.runtime.bench.weights_bench import run_weights_bench, table

    res = run_weights_bench("demo", ("fp32", "int4"), chats=2, chat_tokens=6, doc_tokens=96, documents=1,
                            contexts=(256,), depths=(0.5,))
    fp32, int4 = res.formats
    assert fp32.weights == "fp32: fp32" and int4.weights.startswith("int4: int4 x ")
    assert (fp32.chats_identical, fp32.chats, fp32.documents_identical) == (2, 2, 1)
    assert fp32.document_kl_mean == 0.0 and fp32.document_kl_max == 0.0
    assert int4.document_kl_max > 0.0 and int4.weight_bytes * 4 < fp32.weight_bytes
    assert fp32.passkeys == int4.passkeys == 1 and set(fp32.passkey_found_by_context) == {256}
    assert "| int4: int4 x " in table(res)


def test_the_weights_bench_shows_what_a_16_bit_cache_costs() -> None:
    """`--kv-dtype bfloat16`: the reference keeps a float32 cache, so fp32 weights over a bfloat16 cache are
    no longer identical to it: the cache's rounding is the only difference, and it is small."""
    from kvdrive.runtime.bench.weights_bench import run_weights_bench, table

    res = run_weights_bench("demo", ("fp32",), chats=2, chat_tokens=6, doc_tokens=96, documents=1,
                            contexts=(256,), depths=(0.5,), kv_dtype=torch.bfloat16)
    (fp32,) = res.formats
    assert res.kv_dtype == "bfloat16" and "KV cache bfloat16" in table(res)
    assert 0.0 < fp32.document_kl_max < 0.05


@pytest.mark.skipif(bool(native.unavailable_reason()), reason="the block kernels are not built on this host")
def test_a_bf16_gemm_serves_many_rows_and_leaves_decode_rows_exact() -> None:
    """``--gemm bf16``: a block layer's GEMM over more than SMALL_BATCH rows runs in bfloat16 (close to the
    float32 one, not equal); a decode step's rows still take the float32 block kernel, bit for bit."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(96, 128, generator=g)
    exact, fast = QuantLinear(w, None, "int8", CPU), QuantLinear(w, None, "int8", CPU, gemm="bf16")
    many, few = torch.randn(SMALL_BATCH + 8, 128, generator=g), torch.randn(SMALL_BATCH, 128, generator=g)
    a, b = exact(many), fast(many)
    assert b.dtype == torch.float32 and not torch.equal(a, b)
    assert _relative(b, a) < 1e-2
    assert torch.equal(exact(few), fast(few))


def test_the_gemm_dtype_is_checked_and_named_in_the_page_fingerprint() -> None:
    with pytest.raises(ModelLoadError, match="--gemm 'fp16'"):
        load_model("demo", progress=False, gemm="fp16")
    assert resolve_gemm("fp32", CPU) == "fp32" and resolve_gemm("bf16", CPU) == "bf16"
    assert resolve_gemm("auto", CPU) == ("bf16" if host_has_bf16_units() else "fp32")
    plan = WeightPlan("auto", {"layers.0.down_proj": "int4"})
    assert plan.fingerprint() != replace(plan, gemm="bf16").fingerprint()
    assert "gemm" not in plan.fingerprint()  # pages stored before --gemm existed still match a float32 server
    floats = WeightPlan("auto", {"layers.0.down_proj": "bf16"})  # no block layer: the GEMM dtype changes nothing
    assert floats.fingerprint() == replace(floats, gemm="bf16").fingerprint()
    # the prompt's attention products follow the block layers' GEMM dtype, so the same fingerprint covers them
    assert replace(plan, gemm="bf16").prompt_products() == "bf16"
    assert plan.prompt_products() == "fp32" and replace(floats, gemm="bf16").prompt_products() == "fp32"
    assert resolve_gemm("bf16", torch.device("meta")) == "fp32"  # off the CPU the path does not exist
