"""Compiling, prebuilding and loading the CPU kernels' extension (``kernels/*.cpp``).

The sources are compiled on first use with torch's extension builder (ninja and a C++ compiler; about
40 s on 2 cores) into a folder under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) named
by the Python version and ``build_digest()``, and reused after that. Builders take turns on an ``flock`` the
kernel drops when a process dies, so a build killed half-way (which leaves torch's own ``lock`` file, on
which every later start would wait forever) is cleared by the next one. A folder named by
``$KVDRIVE_KERNELS`` that holds a build made by ``prebuild`` (the runtime image's: it has no compiler) is
loaded instead, when it was built from these sources, with these flags, against this torch. The kernels need
AVX-512 (``torch.backends.cpu.get_cpu_capability()``). Without it, or without a build,
``unavailable_reason()`` says why (logged once a process) and every caller computes the same values with
torch ops.

``python -m kvdrive.runtime.native DIR`` makes such a folder.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

KERNELS = Path(__file__).with_name("kernels")
SOURCES = tuple(KERNELS / name for name in
                ("block_gemm.cpp", "paged_decode.cpp", "prefix_attention.cpp", "rope.cpp", "norm.cpp",
                 "module.cpp"))
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-ffp-contract=off", "-fopenmp")
NAME = "kvdrive_cpu_kernels"
PREBUILT_ENV = "KVDRIVE_KERNELS"  # a folder made by prebuild()
STAMP = "build.sha256"  # in that folder: build_digest() of the build it holds


def build_digest() -> str:
    """What a build depends on: the sources, the flags and the torch it links against."""
    h = hashlib.sha256()
    for source in SOURCES:
        h.update(source.name.encode())
        h.update(source.read_bytes())
    h.update(" ".join(FLAGS).encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()


def build_directory() -> Path:
    """Where ``_compile`` builds by default: one folder per Python version and ``build_digest()``."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions")
    return Path(root) / f"{NAME}-py{sys.version_info.major}{sys.version_info.minor}-{build_digest()[:16]}"


def _compile(directory: Path | None = None) -> Any:
    """Compile (or reuse) the extension with torch's builder, into ``directory`` or ``build_directory()``."""
    from torch.utils.cpp_extension import load

    directory = build_directory() if directory is None else directory
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "kvdrive.flock", "a") as turn:
        try:
            fcntl.flock(turn, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process's build of the CPU kernels in %s", directory)
            fcntl.flock(turn, fcntl.LOCK_EX)
        # torch's builder takes its own turn by creating this file and waits while it exists; holding the
        # flock, nobody else is building, so a file found now was left by a builder that was killed
        baton = directory / "lock"
        if baton.exists():
            log.warning("removing %s, left behind by a build of the CPU kernels that was killed", baton)
            baton.unlink(missing_ok=True)
        return load(NAME, [str(s) for s in SOURCES], extra_cflags=list(FLAGS), extra_ldflags=["-fopenmp"],
                    verbose=False, build_directory=str(directory))


def prebuild(directory: Path) -> Path:
    """Build the extension into ``directory`` for ``$KVDRIVE_KERNELS`` (needs a compiler, not AVX-512)."""
    directory.mkdir(parents=True, exist_ok=True)
    _compile(directory)
    library = directory / f"{NAME}.so"
    if not library.is_file():
        raise FileNotFoundError(f"torch's builder left no {library.name} in {directory}")
    (directory / STAMP).write_text(build_digest() + "\n")
    return library


def prebuilt(directory: Path) -> tuple[Any, str]:
    """The build in ``directory`` when it matches these sources, flags and torch: (module or None, why not)."""
    library, stamp = directory / f"{NAME}.so", directory / STAMP
    if not library.is_file() or not stamp.is_file():
        return None, f"${PREBUILT_ENV}={directory} holds no build (python -m kvdrive.runtime.native DIR makes one)"
    if stamp.read_text().strip() != build_digest():
        return None, f"the build in ${PREBUILT_ENV}={directory} is of other sources, flags or torch"
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
    folder = os.environ.get(PREBUILT_ENV)
    if folder:
        module, why = prebuilt(Path(folder))
        if module is not None:
            return module, ""
        log.warning("%s; compiling instead", why)
    try:
        module = _compile()
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the torch paths still work
        lines = str(exc).strip().splitlines()
        return None, f"building the CPU kernels failed: {lines[-1] if lines else type(exc).__name__}"
    return module, ""


@functools.cache
def _load() -> tuple[Any, str]:
    """The build, tried once a process, and what came of it in the log."""
    module, why = _build()
    if module is None:
        log.warning("CPU kernels unavailable (%s): auto keeps fp32 weights; int8/int4 dequantize on every call; "
                    "decode attention gathers pages with torch ops", why)
    else:
        log.info("CPU kernels ready (%s)", ", ".join(s.name for s in SOURCES))
    return module, why


def kernels() -> Any:
    """The loaded extension, or None where it cannot be built (``unavailable_reason`` says why)."""
    return _load()[0]


def unavailable_reason() -> str:
    """Empty when the kernels are built and loaded; otherwise why they are not."""
    return _load()[1]
