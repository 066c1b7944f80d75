"""``kvpolicy plugins``: every registered policy, action, backend, transform and preset, and which
distribution registered it (kvpolicy itself or a plugin, its version and entry point); then the names
registered more than once, if any. ``kvpolicy list`` shows the names and whether each backend runs here."""

from __future__ import annotations

import argparse
import os


def _describe(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def conflict_lines() -> list[str]:
    """The "conflicts" section shared by ``kvpolicy list`` and ``kvpolicy plugins``: a header and one
    line per name registered more than once (naming every distribution and version), or nothing."""
    from kvpolicy import registry

    found = registry.conflicts()
    if not found:
        return []
    header = (
        "conflicts (looking these names up is an error; uninstall all but one of the distributions, "
        f"or choose the entry points to load with {registry.ALLOW_ENV}=name,name):"
    )
    return [header, *(f"  {conflict}" for conflict in found)]


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
    for line in conflict_lines():
        print(line)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``kvpolicy plugins`` to ``sub``."""
    cmd = sub.add_parser(
        "plugins",
        help="which distribution (kvpolicy or a plugin) registered each name",
        description="Every registered policy, action, backend, transform and preset with the distribution that "
        "registered it (kvpolicy or a plugin), its version, the object and where it was loaded from; then the "
        "names registered more than once. kvpolicy list shows instead the names you can use and whether each "
        "backend can run here.",
    )
    cmd.set_defaults(func=_run)
