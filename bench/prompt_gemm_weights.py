"""What a prompt step's GEMMs cost with the weights as kept today, against a dense bf16 copy and a oneDNN-prepacked one.

Every block layer (int4/int8) of Qwen2.5-Coder-0.5B's decoder (96 of them; the LM head left out, as a prompt
step applies it to one row) over M rows of bf16 inputs:
- today: dequantize the blocks to bf16, then ``F.linear`` (what ``QuantLinear`` does for more than 16 rows);
- dense: ``F.linear`` on a bf16 copy made once (the session 12 experiment, +683 MiB);
- prepacked: ``torch.ops.mkldnn._linear_pointwise`` on a copy oneDNN reordered once into its own layout;
- dequantize alone.
Legs alternate, seven repeats, median (min-max) in ms for all 96 layers.

    cd bench && ../.venv/bin/python prompt_gemm_weights.py   # ~2 min on 2 cores
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvdrive.runtime.model import block_kernels
from kvdrive.runtime.model.loader import load_model
from kvdrive.runtime.model.weight_formats import QuantLinear


def measure(rows: int, layers: list[QuantLinear], dense: list[torch.Tensor]) -> dict[str, list[float]]:
    """Seconds of each leg over every layer at ``rows`` input rows, seven alternating repeats."""
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in dense]
    xs = {k: torch.randn(rows, k).bfloat16() for k in {x.in_features for x in layers}}  # [M, K]

    def today() -> None:
        for x in layers:
            F.linear(xs[x.in_features], block_kernels.dequantize(x.packed, torch.bfloat16))

    def dense_copy() -> None:
        for w in dense:
            F.linear(xs[w.shape[1]], w)

    def prepacked() -> None:
        for x, w in zip(layers, packed, strict=True):
            torch.ops.mkldnn._linear_pointwise(xs[x.in_features], w, None, "none", [], "")

    def dequantize_only() -> None:
        for x in layers:
            block_kernels.dequantize(x.packed, torch.bfloat16)

    legs: dict[str, Callable[[], None]] = {"today": today, "dense": dense_copy, "prepacked": prepacked,
                                            "dequantize alone": dequantize_only}
    seconds: dict[str, list[float]] = {k: [] for k in legs}
    for fn in legs.values():
        fn()  # warm-up
    for rep in range(7):
        for name in (list(legs) if rep % 2 == 0 else list(reversed(legs))):
            t = time.perf_counter()
            legs[name]()
            seconds[name].append(time.perf_counter() - t)
    return seconds


def main() -> None:
    torch.set_num_threads(2)
    loaded = load_model("qwen2.5-coder-0.5b", progress=False, gemm="auto")
    layers = [m for m in loaded.model.modules()
              if isinstance(m, QuantLinear) and m.packed is not None and m.out_features < 100_000]
    print(f"{len(layers)} block layers, shapes {sorted({(x.out_features, x.in_features) for x in layers})}")
    dense = [block_kernels.dequantize(x.packed, torch.bfloat16).contiguous() for x in layers]
    for rows in (64, 128, 256):
        seconds = measure(rows, layers, dense)
        print(f"M={rows}: " + "; ".join(f"{k} {1e3 * statistics.median(v):.1f} ms ({1e3 * min(v):.1f}-{1e3 * max(v):.1f})"
                                          for k, v in seconds.items()), flush=True)


if __name__ == "__main__":
    main()
