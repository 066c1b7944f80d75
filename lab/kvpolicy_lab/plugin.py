"""The lab as a kvpolicy plugin: its subcommands join the ``kvpolicy`` command through the hook
``kvpolicy_register_commands`` (the entry point ``kvpolicy_lab`` of the group ``kvpolicy``).

Each command module is imported only when the parser is built, so looking up a policy never imports
the lab's harness.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvpolicy.hookspecs import command, hookimpl

COMMANDS = ("demo", "ablate", "tune", "analyze", "bench", "estimate")


@hookimpl
def kvpolicy_register_commands() -> dict[str, Callable[[argparse._SubParsersAction], None]]:
    return {name: command(f"kvpolicy_lab.commands.{name}") for name in COMMANDS}
