"""The ``opmux`` command: ``info``, ``explain``, ``check``, ``matrix``, ``bench``, ``tune``,
``demo``, ``build``, ``generate``.

One module per command (``opmux.cli.<command>``), each with ``HELP``, ``add_arguments(parser)``
and ``run(namespace) -> exit status``; tables are printed by :mod:`opmux.cli.table`. Errors
exit non-zero with one line on stderr, no traceback (``OPMUX_DEBUG=1`` shows it).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from opmux.cli import bench, build, check, explain, generate, info, matrix, tune
from opmux.cli._option_checks import OneLineParser
from opmux.core import config

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from opmux.cli import demo

    parser = OneLineParser(prog="opmux", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    commands = (("info", info.HELP, info.add_arguments, info.run),
                ("explain", explain.HELP, explain.add_arguments, explain.run),
                ("check", check.HELP, check.add_arguments, check.run),
                ("matrix", matrix.HELP, matrix.add_arguments, matrix.run),
                ("bench", bench.HELP, bench.add_arguments, bench.run),
                ("tune", tune.HELP, tune.add_arguments, tune.run),
                ("demo", "a random Llama checkpoint through opmux, checked vs native",
                 demo.add_arguments, demo.run),
                ("build", build.HELP, build.add_arguments, build.run),
                ("generate", generate.HELP, generate.add_arguments, generate.run))
    for name, help_text, add_arguments, run in commands:
        p = sub.add_parser(name, help=help_text)
        add_arguments(p)
        p.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``opmux`` console script."""
    from opmux.core.errors import OpmuxError

    ns = _parser().parse_args(argv)
    try:
        return int(ns.run(ns))
    except (OpmuxError, ValueError, KeyError, OSError) as exc:
        if config.debug():
            raise
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"opmux: error: {message}", file=sys.stderr)
        return 2
