"""``python -m kvdrive.runtime.native DIR``: build the CPU kernels into DIR, for ``$KVDRIVE_KERNELS=DIR``."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvdrive.runtime.native.build import PREBUILT_ENV, build_digest, prebuild


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvdrive.runtime.native",
                                     description=f"build the CPU kernels into DIR, for ${PREBUILT_ENV}=DIR")
    parser.add_argument("directory", type=Path)
    library = prebuild(parser.parse_args(argv).directory)
    print(f"{library} ({build_digest()[:12]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
