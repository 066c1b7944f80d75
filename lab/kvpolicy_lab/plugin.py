"""The lab as a kvpolicy plugin: its subcommands join the ``kvpolicy`` command through the hook
``kvpolicy_register_commands`` (the entry point ``kvpolicy_lab`` of the group ``kvpolicy``).

Each command module is imported only when the parser is built, so looking up a policy never imports
the lab's harness.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

from kvpolicy.hookspecs import hookimpl

COMMANDS = ("demo", "ablate", "tune", "analyze", "bench")


def _command(name: str) -> Callable[[argparse._SubParsersAction], None]:
    def register(sub: argparse._SubParsersAction) -> None:
        importlib.import_module(f"kvpolicy_lab.commands.{name}").register(sub)

    register.__qualname__ = register.__name__ = f"register_{name}"
    return register


@hookimpl
def kvpolicy_register_commands() -> dict[str, Callable[[argparse._SubParsersAction], None]]:
    return {name: _command(name) for name in COMMANDS}
