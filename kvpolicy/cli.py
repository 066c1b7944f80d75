"""The ``kvpolicy`` command: one module per subcommand in :mod:`kvpolicy.commands`."""

from __future__ import annotations

import argparse
import importlib
import sys

#: subcommand modules under kvpolicy.commands, in help order
COMMANDS = ("demo", "list", "plugins", "ablate", "analyze", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpolicy", description="Pluggable KV-cache compression for transformers.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"kvpolicy.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
