"""The CPU kernels that multiply by weights kept in their GGUF blocks (``kernels/block_gemm.cpp``):
packing ``Blocks`` for them, building and loading them, and the torch path used where they cannot be built.

The C++ source is compiled on first use with torch's extension builder (ninja and a C++ compiler; about
20 s on 2 cores) into ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) and reused after
that. A folder named by ``$KVDRIVE_BLOCK_KERNELS`` that holds a build made by ``prebuild`` (the runtime
image's: it has no compiler) is loaded instead, when it was built from this source, with these flags,
against this torch. The kernels need AVX-512 (``torch.backends.cpu.get_cpu_capability()``). Without it, or
without a build, ``unavailable_reason()`` says why, and ``gemv`` / ``dequantize`` compute the same values
with torch ops (dequantize, then an fp32 matmul): exact, but paying for a float32 copy of the weight on
every call.

``python -m kvdrive.runtime.model.block_kernels DIR`` makes such a folder.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvdrive.runtime.model.gguf_blocks import Blocks

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "block_gemm.cpp"
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-ffp-contract=off", "-fopenmp")
NAME = "kvdrive_block_gemm"
PREBUILT_ENV = "KVDRIVE_BLOCK_KERNELS"  # a folder made by prebuild()
STAMP = "build.sha256"  # in that folder: build_digest() of the build it holds


@dataclass(frozen=True)
class PackedBlocks:
    """``Blocks`` in the kernels' layout: int8 levels [N, K], or two levels a byte [N, K / 2] (``nib``:
    levels 0..15, ggml's order within each block of 32)."""

    q: torch.Tensor  # [N, K] int8 or [N, K / 2] uint8
    scale: torch.Tensor  # [N, K / block] float32
    offset: torch.Tensor | None  # [N, K / block] float32
    nib: bool

    @property
    def in_features(self) -> int:
        return self.q.shape[1] * (2 if self.nib else 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.offset) if t is not None)

    def levels(self) -> torch.Tensor:  # -> [N, K] int8
        if not self.nib:
            return self.q
        n, half = self.q.shape
        g = self.q.view(n, half // 16, 1, 16)
        return torch.cat([g & 15, g >> 4], dim=2).view(n, half * 2).to(torch.int8)

    def blocks(self) -> Blocks:
        return Blocks(self.levels(), self.scale, self.offset, self.in_features // self.scale.shape[1])


def pack(blocks: Blocks, nib: bool) -> PackedBlocks:
    """``nib`` needs ``blocks.nibbles_fit()``."""
    if nib:
        if not blocks.nibbles_fit():
            raise ValueError("only levels 0..15 in blocks of 32 pack two to a byte")
        n, k = blocks.shape
        g = blocks.levels.to(torch.uint8).view(n, k // 32, 2, 16)
        q = (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    else:
        q = blocks.levels.contiguous()
    return PackedBlocks(q, blocks.scale.contiguous(), None if blocks.offset is None else blocks.offset.contiguous(), nib)


def build_digest() -> str:
    """What a build depends on: the source, the flags and the torch it links against."""
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join(FLAGS).encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()


def _compile(directory: Path | None = None) -> Any:
    """Compile (or reuse) the extension with torch's builder, into ``directory`` or its default cache."""
    from torch.utils.cpp_extension import load

    return load(NAME, [str(SOURCE)], extra_cflags=list(FLAGS), extra_ldflags=["-fopenmp"], verbose=False,
                build_directory=None if directory is None else str(directory))


def prebuild(directory: Path) -> Path:
    """Build the extension into ``directory`` for ``$KVDRIVE_BLOCK_KERNELS`` (needs a compiler, not AVX-512)."""
    directory.mkdir(parents=True, exist_ok=True)
    _compile(directory)
    library = directory / f"{NAME}.so"
    if not library.is_file():
        raise FileNotFoundError(f"torch's builder left no {library.name} in {directory}")
    (directory / STAMP).write_text(build_digest() + "\n")
    return library


def _prebuilt(directory: Path) -> tuple[Any, str]:
    """The build in ``directory`` when it matches this source, flags and torch: (module or None, why not)."""
    library, stamp = directory / f"{NAME}.so", directory / STAMP
    if not library.is_file() or not stamp.is_file():
        return None, f"${PREBUILT_ENV}={directory} holds no build (python -m {__name__} DIR makes one)"
    if stamp.read_text().strip() != build_digest():
        return None, f"the build in ${PREBUILT_ENV}={directory} is of another source, flags or torch"
    spec = importlib.util.spec_from_file_location(NAME, library)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, ""


def _build() -> tuple[Any, str]:
    """(the extension module or None, why not)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if "AVX512" not in capability:
        return None, f"the CPU offers {capability}; the kernels need AVX512"
    prebuilt = os.environ.get(PREBUILT_ENV)
    if prebuilt:
        module, why = _prebuilt(Path(prebuilt))
        if module is not None:
            return module, ""
        log.warning("%s; compiling instead", why)
    try:
        module = _compile()
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the torch path still works
        lines = str(exc).strip().splitlines()
        return None, f"building {SOURCE.name} failed: {lines[-1] if lines else type(exc).__name__}"
    return module, ""


@functools.cache
def _load() -> tuple[Any, str]:
    """The build, tried once a process, and what came of it in the log."""
    module, why = _build()
    if module is None:
        log.warning("block kernels unavailable (%s): auto keeps fp32; int8/int4 dequantize on every call", why)
    else:
        log.info("block kernels ready (%s)", SOURCE.name)
    return module, why


def unavailable_reason() -> str:
    """Empty when the kernels are built and loaded; otherwise why they are not (logged once)."""
    module, why = _load()
    return why


def gemv(x: torch.Tensor, w: PackedBlocks) -> torch.Tensor:  # [M, K] -> [M, N] float32
    x = x.float().contiguous()
    module, _ = _load()
    if module is None:
        return F.linear(x, w.blocks().dequantize())
    return module.block_gemv(x, w.q, w.scale, w.offset, w.nib)


def dequantize(w: PackedBlocks) -> torch.Tensor:  # -> [N, K] float32, equal to the file's values
    module, _ = _load()
    if module is None:
        return w.blocks().dequantize()
    return module.block_dequant(w.q, w.scale, w.offset, w.nib)


def rows(w: PackedBlocks, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, K] float32
    picked = PackedBlocks(w.q[ids], w.scale[ids], None if w.offset is None else w.offset[ids], w.nib)
    return picked.blocks().dequantize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}",
                                     description=f"build the block kernels into DIR, for ${PREBUILT_ENV}=DIR")
    parser.add_argument("directory", type=Path)
    library = prebuild(parser.parse_args(argv).directory)
    print(f"{library} ({build_digest()[:12]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
