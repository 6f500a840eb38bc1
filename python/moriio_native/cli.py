"""The ``moriio-native`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

logger = logging.getLogger("moriio_native.cli")


def cmake_dir() -> str:
    """Directory holding moriio_nativeConfig.cmake (for CMAKE_PREFIX_PATH / moriio_native_DIR)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib", "cmake", "moriio_native")


def _cmd_cmake_dir(_: argparse.Namespace) -> int:
    sys.stdout.write(cmake_dir() + "\n")
    return 0


def _cmd_backends(_: argparse.Namespace) -> int:
    from moriio_native.engine import available_backends

    for info in available_backends():
        state = "available" if info.available else f"unavailable: {info.reason}"
        sys.stdout.write(f"{info.name:9s} {state}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moriio-native", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("cmake-dir", help="print the CMake package directory").set_defaults(
        func=_cmd_cmake_dir
    )
    sub.add_parser("backends", help="list transport backends and why any is unavailable").set_defaults(
        func=_cmd_backends
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
