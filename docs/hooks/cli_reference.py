"""mkdocs hook: render the ``kvpolicy`` command line's help into ``reference/cli.md`` at build time.

The page holds a marker line, ``<!-- cli-reference -->``; this hook replaces it with one section per
command and subcommand, each the ``--help`` text of the parser :func:`kvpolicy.cli.build_parser`
builds. The page therefore always matches the installed command line.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from typing import Any

MARKER = "<!-- cli-reference -->"
PAGE = "reference/cli.md"
#: terminal width argparse formats the help for
WIDTH = 100


def subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """``(name, parser)`` of every subcommand of ``parser``, in registration order."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def sections(parser: argparse.ArgumentParser, prog: str, depth: int = 2) -> Iterator[str]:
    """Markdown sections for ``parser`` and, below it, each of its subcommands."""
    yield f"{'#' * depth} `{prog}`\n\n```text\n{parser.format_help().rstrip()}\n```\n"
    for name, sub in subcommands(parser):
        yield from sections(sub, f"{prog} {name}", min(depth + 1, 4))


def render() -> str:
    """The help of every ``kvpolicy`` command, as Markdown."""
    from kvpolicy.cli import build_parser

    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)
    try:
        return "\n".join(sections(build_parser(), "kvpolicy"))
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """mkdocs event: fill the CLI reference page's marker with the rendered help."""
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lacks the marker line {MARKER!r} where the command help goes")
    return markdown.replace(MARKER, render())
