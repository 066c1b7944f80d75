"""The ``kvpolicy`` command: one module per subcommand, registered through the plugin hook
``kvpolicy_register_commands`` (the core's in :mod:`kvpolicy.commands`; the ``kvpolicy-lab``
distribution adds ``demo``, ``ablate``, ``tune``, ``analyze``, ``bench`` and ``estimate``). A lab subcommand without
the lab installed is one line naming the package to install, exit status 2.

Bad flag values stop at parse time (argparse: ``kvpolicy <command>: error: argument --flag: ...``,
exit status 2); a :class:`~kvpolicy.errors.ConfigError` raised later, while a command checks its
configuration, is reported the same way: one line on stderr, exit status 2, no traceback.

An interruption (Ctrl-C) is one line on stderr and exit status 130, the shell's status for SIGINT.
A command whose run directory resumes sets the parser default ``resumes`` to the name of the
attribute holding that directory (``"out"``), and the line then says where the finished work is
kept and that the same command resumes it.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from typing import Any

from kvpolicy.errors import LAB_INSTALL, LAB_PACKAGE, ConfigError

#: the subcommands' order in help (registered commands not listed here follow, by name)
ORDER = ("demo", "list", "plugins", "ablate", "tune", "analyze", "bench", "estimate", "presets")
#: the subcommands the kvpolicy-lab distribution adds (named here to say what to install without it)
LAB_COMMANDS = ("demo", "ablate", "tune", "analyze", "bench", "estimate")


def commands() -> list[tuple[str, Callable[[argparse._SubParsersAction], None]]]:
    """``(name, register)`` of every registered subcommand (:func:`kvpolicy.hookspecs.kvpolicy_register_commands`):
    the core's, and those of plugins such as the ``kvpolicy-lab`` distribution, in help order."""
    from kvpolicy import registry

    found = {name: register for name, register, _ in registry.entries("commands")}
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(found.items(), key=lambda item: (rank.get(item[0], len(ORDER)), item[0]))


def build_parser() -> argparse.ArgumentParser:
    """The ``kvpolicy`` parser with every registered subcommand (:func:`commands`).

    Every parser is a :class:`~kvpolicy.commands._parser.Parser`: defaults shown in ``--help``, and a
    misspelt choice answered with ``did you mean``. The conventions of every subcommand: list flags take
    space-separated values and may be repeated (``--bits 2 4``), dtypes are torch's names (``float32``,
    ``bfloat16``, ``float16``), ``--out`` is always a directory, and a flag that writes one file is named
    for what it writes (``--json``, ``--preset-file``).
    """
    from kvpolicy import __version__
    from kvpolicy.commands._parser import Parser

    found = commands()
    missing = [name for name in LAB_COMMANDS if name not in dict(found)]
    lab = f" ({', '.join(missing)}: pip install {LAB_PACKAGE})" if missing else ""
    parser = Parser(
        prog="kvpolicy",
        description="Pluggable KV-cache compression for transformers. List flags take space-separated values "
        "and may be repeated (--bits 2 4 == --bits 2 --bits 4); dtypes are torch's names (float32, bfloat16, "
        "float16); --out is always a directory.",
    )
    parser.add_argument("--version", action="version", version=f"kvpolicy {__version__}",
                        help="print the version and exit")  # fmt: skip
    from kvpolicy import registry

    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    added = [name for name, register in found if _add_command(sub, name, register)]
    clashes = registry.conflicts("commands")
    for conflict in clashes:
        _add_conflict(sub, conflict)
    sub.help = f"one of: {', '.join([*added, *(c.name for c in clashes)])}{lab}"  # read when help is printed
    return parser


def _add_command(sub: argparse._SubParsersAction, name: str, register: Callable) -> bool:
    """Add the command ``name`` through its plugin's ``register(sub)``; a plugin whose ``register`` raises, adds no
    parser named ``name``, adds other names beside it or sets no ``func`` to run is skipped with a
    :class:`~kvpolicy.registry.PluginWarning` naming the command and its distribution, and whatever it added is
    taken back, so that every other command (and ``--version``) still works. Returns whether it was added."""
    parsers, helps = dict(sub._name_parser_map), list(sub._choices_actions)
    try:
        register(sub)
    except Exception as exc:  # a plugin's bug must not take the command line down
        problem = f"its register(subparsers) raised {type(exc).__name__}: {exc}"
    else:
        new = {key: p for key, p in sub._name_parser_map.items() if parsers.get(key) is not p}
        mine = new.get(name)
        others = sorted(key for key, p in new.items() if p is not mine)
        if mine is None:
            problem = f"its register(subparsers) added no subcommand named {name!r}"
        elif others:
            problem = f"its register(subparsers) also added {others}, which are not its name"
        elif not _runs(mine):
            problem = "its subcommand sets no func to run (parser.set_defaults(func=...))"
        else:
            return True
    sub._name_parser_map.clear()
    sub._name_parser_map.update(parsers)
    sub._choices_actions[:] = helps
    from kvpolicy import registry

    source = next((str(src) for n, _, src in registry.entries("commands") if n == name), "a plugin")
    warnings.warn(
        f"kvpolicy command {name!r} from {source} is skipped: {problem}", registry.PluginWarning, stacklevel=3
    )
    return False


def _runs(parser: argparse.ArgumentParser) -> bool:
    """Whether every command line ``parser`` accepts sets a callable ``func``: its own default, or that of each of
    its subcommands."""
    if callable(parser.get_default("func")):
        return True
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return bool(subs) and all(_runs(p) for a in subs for p in set(a.choices.values()))


def _add_conflict(sub: argparse._SubParsersAction, conflict: Any) -> None:
    """A command name registered by several plugins: running it reports the conflict (naming them) and how to
    resolve it, and every other command works."""

    def refuse(args: argparse.Namespace) -> int:
        raise conflict.error()

    # no prefix character a command line uses: whatever follows the name (flags included) is taken, not refused
    p = sub.add_parser(conflict.name, help=f"(registered {len(conflict.sources)} times: see kvpolicy plugins)",
                       add_help=False, prefix_chars="\0")  # fmt: skip
    p.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    p.set_defaults(func=refuse)


def _lab_missing(argv: list[str]) -> str | None:
    """The lab subcommand ``argv`` asks for when it is not installed (None: anything else)."""
    words = [word for word in argv if not word.startswith("-")]
    if not words or words[0] not in LAB_COMMANDS:
        return None
    from kvpolicy import registry

    return None if words[0] in registry.names("commands") else words[0]


def _prog(args: argparse.Namespace) -> str:
    """``kvpolicy <command> [<what>]`` of the parsed command line, for error messages."""
    words = [getattr(args, key, None) for key in ("command", "analysis", "benchmark")]
    return " ".join(["kvpolicy", *(w for w in words if w)])


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    Parameters
    ----------
    argv : list of str, optional
        Arguments after the program name.

    Returns
    -------
    int
        0 on success, 2 for a configuration error (a one-line message on stderr), 130 when
        interrupted (Ctrl-C; a one-line message), or the command's own status (``kvpolicy ablate``:
        1 when a cell failed).
    """
    argv = sys.argv[1:] if argv is None else argv
    missing = _lab_missing(argv)
    if missing is not None:
        print(
            f"kvpolicy {missing}: error: this command comes with the {LAB_PACKAGE} package: {LAB_INSTALL}",
            file=sys.stderr,
        )
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    if not callable(getattr(args, "func", None)):  # a plugin's subcommand whose own subcommand was left out
        parser.error(f"{_prog(args)} needs a subcommand (see {_prog(args)} --help)")
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"{_prog(args)}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{_prog(args)}: {_interrupted(args)}", file=sys.stderr)
        return INTERRUPTED


#: exit status after Ctrl-C (128 + SIGINT, as shells report it)
INTERRUPTED = 130


def _interrupted(args: argparse.Namespace) -> str:
    """What an interruption of the parsed command means for its outputs."""
    where = getattr(args, "resumes", None)
    if where is None:
        return "interrupted"
    return (f"interrupted; the cells finished so far are kept in {getattr(args, where)}: run the same command "
            "again to resume")  # fmt: skip


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
