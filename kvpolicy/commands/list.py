"""``kvpolicy list``: the registered names of each kind, the shipped preset files, whether each backend can run
here (and why not), then the names registered more than once, if any. ``kvpolicy plugins`` shows which
distribution registered each name."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpolicy.backends.base import Usability

HELP = "the names you can use, and whether each backend can run here (what it needs when not)"
DESCRIPTION = (
    "The registered policies, actions, backends, transforms and presets, the preset files shipped with kvpolicy, "
    "and for each backend whether it can run on this machine: if not, the package extra, compiler or setting it "
    "needs. kvpolicy plugins shows instead which distribution (kvpolicy or a plugin) registered each name."
)


def backend_usability(name: str) -> Usability:
    """Whether the registered backend ``name`` can run here, and why not: its class's
    :meth:`~kvpolicy.backends.base.Backend.usability`, whose failure is reported, not raised."""
    from kvpolicy import registry
    from kvpolicy.backends.base import Usability

    try:
        state = registry.get("backends", name).usability()
    except Exception as exc:  # a plugin's own failure: shown on its line, the other lines still printed
        return Usability(False, f"its usability check raised {type(exc).__name__}: {exc}")
    if not isinstance(state, Usability):
        return Usability(False, f"its usability check returned {state!r}, not a kvpolicy.backends.base.Usability")
    return state


def backend_lines() -> list[str]:
    """``backends here:`` and one line per registered backend: its name, ``yes``/``no`` and why."""
    from kvpolicy import registry

    names = registry.names("backends")
    clashes = {conflict.name for conflict in registry.conflicts("backends")}
    width = max((len(n) for n in names), default=0)
    lines = ["backends here (usable; what it runs on, or what it needs):"]
    for name in names:
        if name in clashes:
            lines.append(f"  {name:<{width}}  ?   registered more than once: see conflicts")
            continue
        state = backend_usability(name)
        note = f"  {state.note}" if state.note else ""
        lines.append(f"  {name:<{width}}  {'yes' if state.usable else 'no ':<3}{note}".rstrip())
    lines.append("  (backend='auto' picks the fastest of these that serves the composition on its device)")
    return lines


def _run(args: argparse.Namespace) -> int:
    from kvpolicy import preset_files, registry
    from kvpolicy.commands.plugins import conflict_lines

    for kind in registry.KINDS:
        print(f"{kind}: {', '.join(registry.names(kind))}")
    print(f"preset files (load by name like presets): {', '.join(preset_files.names())}")
    for line in backend_lines():
        print(line)
    for line in conflict_lines():
        print(line)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``kvpolicy list`` to ``sub``."""
    lst = sub.add_parser("list", help=HELP, description=DESCRIPTION)
    lst.set_defaults(func=_run)
