"""``kvpolicy bench <what>``: benchmarks that print numbers and ratios (never pass/fail)."""

from __future__ import annotations

import argparse
import importlib

#: benchmark modules under kvpolicy_lab.bench; each defines ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``
BENCHMARKS: tuple[str, ...] = ("decode", "backends", "memory")


def _summary(module: object) -> str:
    """The first line of a benchmark module's docstring, without reST markup."""
    return (getattr(module, "__doc__", None) or "").strip().split("\n")[0].replace("``", "")


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``kvpolicy bench <what>`` for each of :data:`BENCHMARKS` to ``sub``."""
    bench = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHMARKS))
    which = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK", help=", ".join(BENCHMARKS))
    for name in BENCHMARKS:
        module = importlib.import_module(f"kvpolicy_lab.bench.{name}")
        parser = which.add_parser(name, help=module.HELP, description=_summary(module))
        module.add_arguments(parser)
        parser.set_defaults(func=module.run)
