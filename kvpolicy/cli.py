"""The ``kvpolicy`` command: one module per subcommand, registered through the plugin hook
``kvpolicy_register_commands`` (the core's in :mod:`kvpolicy.commands`; the ``kvpolicy-lab``
distribution adds ``demo``, ``ablate``, ``tune``, ``analyze`` and ``bench``). A lab subcommand without
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
from collections.abc import Callable

from kvpolicy.errors import ConfigError

#: the subcommands' order in help (registered commands not listed here follow, by name)
ORDER = ("demo", "list", "plugins", "ablate", "tune", "analyze", "bench", "estimate")
#: the subcommands the kvpolicy-lab distribution adds (named here to say what to install without it)
LAB_COMMANDS = ("demo", "ablate", "tune", "analyze", "bench")
LAB_PACKAGE = "kvpolicy-lab"


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
    names = ", ".join(name for name, _ in found)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help=f"one of: {names}{lab}")
    for _, register in found:
        register(sub)
    return parser


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
            f"kvpolicy {missing}: error: this command comes with the {LAB_PACKAGE} package: pip install {LAB_PACKAGE} "
            f"(from a clone of kvpolicy: pip install ./lab)",
            file=sys.stderr,
        )
        return 2
    args = build_parser().parse_args(argv)
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
