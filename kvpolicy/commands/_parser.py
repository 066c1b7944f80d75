"""The parser conventions every ``kvpolicy`` command shares.

- :class:`Parser`: an :class:`argparse.ArgumentParser` whose ``--help`` shows each flag's default
  (:class:`DefaultsFormatter`) and whose refusal of a misspelt choice (a flag's value or a subcommand's
  name) ends with ``did you mean ...?``; subparsers made from it are of the same class.
- :class:`ExtendList` and :func:`add_list`: a list flag takes space-separated values, and repeating it adds
  to the list (``--task lm passkey`` is ``--task lm --task passkey``); its first use replaces the default.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from kvpolicy.commands._types import list_item
from kvpolicy.errors import did_you_mean


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that ends each flag's text with ``(default: X)``, a list default written as it is typed
    (``16 42``); flags without a default (``None``), switches and ``--help`` are left as they are."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "%(default)" in text or default is None or default is False or default is argparse.SUPPRESS:
            return text
        if not action.option_strings and action.nargs not in ("?", "*"):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})".strip()


class Parser(argparse.ArgumentParser):
    """The ``kvpolicy`` parser class: defaults in ``--help`` and ``did you mean`` for a misspelt choice."""

    def __init__(self, *args: Any, formatter_class: type = DefaultsFormatter, **kwargs: Any) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        choices = action.choices
        if choices is None or value in choices:
            return
        shown = ", ".join(map(repr, choices))
        hint = did_you_mean(value, list(choices))
        raise argparse.ArgumentError(action, f"invalid choice: {value!r} (choose from {shown}){hint}")


class ExtendList(argparse.Action):
    """``nargs="+"`` values appended to the flag's list; the first use on a command line replaces the
    default, so ``--windows 8`` means ``[8]`` however many windows the default holds."""

    def __init__(self, option_strings: Sequence[str], dest: str, nargs: str = "+", **kwargs: Any) -> None:
        if nargs != "+":
            raise ValueError(f"ExtendList takes nargs='+'; got nargs={nargs!r}")
        super().__init__(option_strings, dest, nargs=nargs, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest, None)
        if current is None or current is self.default:
            current = []
        setattr(namespace, self.dest, [*current, *values])


def add_list(
    parser: argparse.ArgumentParser, flag: str, item: Callable[[str], Any] = str, spec: bool = False, **kwargs: Any
) -> argparse.Action:
    """Add the list flag ``flag``: space-separated values of type ``item``, repeatable, commas refused.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        Where the flag goes.
    flag : str
        Its name (``"--bits"``).
    item : callable, optional
        The type of one value (an ``argparse`` ``type=``), by default ``str``.
    spec : bool, optional
        The values are ``name[:key=value...]`` specs, whose values may hold commas
        (:func:`~kvpolicy.commands._types.list_item`).
    **kwargs
        Other ``add_argument`` keywords (``default``, ``help``, ``choices``, ``metavar``...).

    Returns
    -------
    argparse.Action
        The added action.
    """
    return parser.add_argument(flag, nargs="+", action=ExtendList, type=list_item(item, flag, spec), **kwargs)
