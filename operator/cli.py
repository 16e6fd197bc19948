"""Command line of the operator: ``kvdrive-operator``."""

from __future__ import annotations

import argparse
import sys

from kvdrive.operator import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvdrive-operator", description="KVDrive Kubernetes operator")
    parser.add_argument("--version", action="version", version=f"kvdrive-operator {__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.parse_args(argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
