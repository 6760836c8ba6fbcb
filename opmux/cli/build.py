"""``opmux build``: prebuild the CPU C++ kernels into the build cache (``OPMUX_CACHE_DIR``)."""

from __future__ import annotations

import argparse
from typing import Final

__all__ = ["HELP", "add_arguments", "run"]

HELP: Final = "prebuild the CPU C++ kernels"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``build`` options to ``parser``."""
    parser.add_argument("--verbose", action="store_true",
                        help="print the compiler command lines and output")


def run(ns: argparse.Namespace) -> int:
    """Build or verify-and-load the kernels; exit 1 with the compiler's message on failure."""
    from opmux.plugins.cpu import build

    ok, message = build.build_status(verbose=ns.verbose)
    print(("built: " if ok else "build failed: ") + message)
    return 0 if ok else 1
