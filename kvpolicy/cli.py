"""The ``kvpolicy`` command: one module per subcommand in :mod:`kvpolicy.commands`.

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
import importlib
import sys

from kvpolicy.errors import ConfigError

#: subcommand modules under kvpolicy.commands, in help order
COMMANDS = ("demo", "list", "plugins", "ablate", "tune", "analyze", "bench", "estimate")


def build_parser() -> argparse.ArgumentParser:
    """The ``kvpolicy`` parser with every subcommand of :data:`COMMANDS` registered.

    Every parser is a :class:`~kvpolicy.commands._parser.Parser`: defaults shown in ``--help``, and a
    misspelt choice answered with ``did you mean``. The conventions of every subcommand: list flags take
    space-separated values and may be repeated (``--bits 2 4``), dtypes are torch's names (``float32``,
    ``bfloat16``, ``float16``), ``--out`` is always a directory, and a flag that writes one file is named
    for what it writes (``--json``, ``--preset-file``, ``--docs``).
    """
    from kvpolicy import __version__
    from kvpolicy.commands._parser import Parser

    parser = Parser(
        prog="kvpolicy",
        description="Pluggable KV-cache compression for transformers. List flags take space-separated values "
        "and may be repeated (--bits 2 4 == --bits 2 --bits 4); dtypes are torch's names (float32, bfloat16, "
        "float16); --out is always a directory.",
    )
    parser.add_argument("--version", action="version", version=f"kvpolicy {__version__}",
                        help="print the version and exit")  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="one of: " + ", ".join(COMMANDS))
    for name in COMMANDS:
        importlib.import_module(f"kvpolicy.commands.{name}").register(sub)
    return parser


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
