"""KVDrive's C++ CPU kernels: building the one extension that holds them, and loading it.

``kernels/block_gemm.cpp`` multiplies by weights kept in their GGUF blocks (``model.block_kernels``);
``kernels/paged_decode.cpp`` selects a decode layer's pages and attends to them in place in the KV pool
(``attention.paged_kernels``); ``kernels/rope.cpp`` rotates queries and keys (``model.rope``);
``kernels/norm.cpp`` RMS-normalises float32 rows (``model.layers``); ``kernels/prefix_attention.cpp`` attends a
prompt chunk to its earlier keys with bf16 products (``attention.dense``). One extension, so one compiler run
and one prebuilt folder.
"""

from kvdrive.runtime.native.build import (
    NAME,
    PREBUILT_ENV,
    STAMP,
    build_digest,
    kernels,
    prebuild,
    unavailable_reason,
)

__all__ = ["NAME", "PREBUILT_ENV", "STAMP", "build_digest", "kernels", "prebuild", "unavailable_reason"]
