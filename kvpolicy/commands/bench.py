"""``kvpolicy bench <what>``: benchmarks that print numbers and ratios (never pass/fail)."""

from __future__ import annotations

import argparse
import importlib

#: benchmark modules under kvpolicy.bench; each defines ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``
BENCHMARKS: tuple[str, ...] = ("decode", "backends", "memory")


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHMARKS))
    which = bench.add_subparsers(dest="benchmark", required=True)
    for name in BENCHMARKS:
        module = importlib.import_module(f"kvpolicy.bench.{name}")
        parser = which.add_parser(name, help=module.HELP)
        module.add_arguments(parser)
        parser.set_defaults(func=module.run)
