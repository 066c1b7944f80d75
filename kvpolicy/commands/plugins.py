"""``kvpolicy plugins``: every registered policy, action, backend and preset, and where it came from."""

from __future__ import annotations

import argparse
import os


def _describe(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def _run(args: argparse.Namespace) -> int:
    from kvpolicy import registry

    disabled = os.environ.get(registry.DISABLE_ENV, "").strip() not in ("", "0")
    if disabled:
        print(f"entry-point plugins not loaded: {registry.DISABLE_ENV} is set")
    elif os.environ.get(registry.ALLOW_ENV, "").strip():
        print(f"entry-point plugins limited to {registry.ALLOW_ENV}={os.environ[registry.ALLOW_ENV]}")
    rows = [
        (kind, name, f"{source.distribution} {source.version or ''}".strip(), _describe(obj), source.origin)
        for kind in registry.KINDS
        for name, obj, source in registry.entries(kind)
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(1, 4)]
    for kind in registry.KINDS:
        print(f"{kind}:")
        for row in rows:
            if row[0] == kind:
                name, dist, obj, origin = row[1:]
                print(f"  {name:<{widths[0]}}  {dist:<{widths[1]}}  {obj:<{widths[2]}}  {origin}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    cmd = sub.add_parser(
        "plugins", help="registered policies, actions, backends and presets with the distribution they came from"
    )
    cmd.set_defaults(func=_run)
