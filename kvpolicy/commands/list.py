"""``kvpolicy list``: registered names, then the names registered more than once, if any."""

from __future__ import annotations

import argparse


def _run(args: argparse.Namespace) -> int:
    from kvpolicy import registry
    from kvpolicy.commands.plugins import conflict_lines

    for kind in registry.KINDS:
        print(f"{kind}: {', '.join(registry.names(kind))}")
    for line in conflict_lines():
        print(line)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    lst = sub.add_parser("list", help="registered policies, actions, backends, transforms and presets")
    lst.set_defaults(func=_run)
