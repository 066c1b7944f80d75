"""Argument types of the lab's subcommands, beside the library's own (:mod:`kvpolicy.commands._types`).

Each is an ``argparse`` ``type=`` callable: a bad value raises :class:`argparse.ArgumentTypeError`,
reported by argparse before any model is loaded; :func:`check_output` is the same check for an output
path a command derives rather than parses.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvpolicy.errors import ConfigError, did_you_mean


def at_least(minimum: int, what: str = "an integer") -> Callable[[str], int]:
    """A type for one integer >= ``minimum`` (``what`` names it in messages: ``"a context length"``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {what} >= {minimum}; got {text!r}")
        return value

    parse.__name__ = f"int_min_{minimum}"
    return parse


def spec_of(kind: str, known: Callable[[], list[str]]) -> Callable[[str], str]:
    """The type of one value of a ``name[:key=value...]`` flag (``--policy``, ``--task``...) whose name must be one
    of ``known()``; another name is refused with the closest one. The parameters are checked when the grid is
    built."""

    def parse(text: str) -> str:
        name = text.split(":", 1)[0]
        names = known()
        if name not in names:
            raise argparse.ArgumentTypeError(
                f"unknown {kind} {name!r}{did_you_mean(name, names)} (one of: {', '.join(names)})"
            )
        return text

    parse.__name__ = kind
    return parse


def preset_spec(text: str) -> str:
    """``preset[:key=value...]`` whose preset is a registered preset, a shipped preset file or a preset file's
    path (:func:`kvpolicy.preset_source.resolve`); another name is refused with the closest one."""
    from kvpolicy import preset_source

    try:
        preset_source.check(text.split(":", 1)[0])
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def baseline_spec(text: str) -> str:
    """``dynamic`` or ``hf-<quanto|hqq>-<bits>`` (``[:key=value...]``); another name is refused with the closest one."""
    from kvpolicy_lab.eval.grid import parse_baseline

    try:
        spec = parse_baseline(text)
        known_backend = spec.kind == "dynamic" or spec.args.get("backend") in ("quanto", "hqq")
    except ConfigError:
        known_backend = False
    if not known_backend:
        name = text.split(":", 1)[0]
        known = ["dynamic", "hf-quanto-2", "hf-quanto-4", "hf-hqq-2", "hf-hqq-4"]
        raise argparse.ArgumentTypeError(
            f"unknown baseline {name!r}{did_you_mean(name, known)} (dynamic, hf-quanto-<bits> or hf-hqq-<bits>)"
        )
    return text


def non_negative_int(text: str) -> int:
    """An integer >= 0 (seeds, warm-up rounds)."""
    return at_least(0)(text)


def positive_float(text: str) -> float:
    """A finite number > 0 (budgets)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0; got {text!r}")
    return value


def device_name(text: str) -> str:
    """A supported torch device name (``cpu``, ``cuda``, ``cuda:N``, ``mps``), present here or not."""
    from kvpolicy_lab.devices import parse_device

    try:
        return parse_device(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def available_device(text: str) -> str:
    """A supported torch device that exists on this machine."""
    from kvpolicy_lab.devices import check_device

    try:
        return check_device(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def out_dir(text: str) -> Path:
    """A directory that exists and is writable, or that can be created (nothing is left behind here)."""
    path = Path(text).expanduser()
    problem = output_problem(path, "directory")
    if problem:
        raise argparse.ArgumentTypeError(f"{text!r} {problem}; give a directory path (new or existing)")
    return path


def out_file(text: str) -> Path:
    """A file path to write: a writable file, or a new one in a directory that exists or can be created."""
    path = Path(text).expanduser()
    problem = output_problem(path, "file")
    if problem:
        raise argparse.ArgumentTypeError(f"{text!r} {problem}; give a file path such as docs/results.md")
    return path


def check_output(flag: str, path: Path, kind: str) -> Path:
    """Refuse, before any work, an output path that a command derives rather than parses.

    The same check as :func:`out_dir` and :func:`out_file`, for paths such as a default placed next to
    another flag's value.

    Parameters
    ----------
    flag : str
        What the path is, for the message (``"--runs (default: next to --out)"``).
    path : Path
        The path the command will write.
    kind : {"file", "directory"}
        What will be written there.

    Returns
    -------
    Path
        ``path``, unchanged.

    Raises
    ------
    ConfigError
        One line naming ``flag``, the path and why it cannot be written.
    """
    problem = output_problem(path, kind)
    if problem:
        raise ConfigError(f"{flag}: {str(path)!r} {problem}; give a {kind} path this user can write")
    return path


#: the kinds of output :func:`output_problem` checks
OUTPUT_KINDS = ("file", "directory")


def output_problem(path: Path, kind: str) -> str | None:
    """Why ``path`` cannot be written as an output ``kind``, or ``None`` when it can.

    The one check behind every output flag. A path passes when it already is a ``kind`` this user can
    write, or when it can be created. Writability is asked of the system (``os.access``) and then
    tried: a file is opened for appending (its contents untouched) and, for a new path, a temporary
    file is created and removed in the directory where the first new part would be made. The attempt
    catches what ``os.access`` cannot see (read-only mounts seen by root, ``/proc`` and ``/sys``,
    network file systems).

    Parameters
    ----------
    path : Path
        The output path.
    kind : {"file", "directory"}
        What will be written there.

    Returns
    -------
    str or None
        A reason such as ``"is an existing file, not a directory"``; ``None`` when the path can be written.

    Raises
    ------
    ValueError
        ``kind`` is not one of :data:`OUTPUT_KINDS`.
    """
    if kind not in OUTPUT_KINDS:
        raise ValueError(f"kind must be one of {list(OUTPUT_KINDS)}; got kind={kind!r}")
    path = path.absolute()
    if kind == "directory":
        return dir_problem(path)
    try:
        if path.is_dir():
            return "is an existing directory, not a file"
        if path.exists():
            return _existing_file_problem(path)
    except OSError as exc:  # e.g. a parent directory that cannot be searched
        return f"cannot be checked: {exc.strerror}"
    problem = dir_problem(path.parent)
    return f"cannot be written: its directory {str(path.parent)!r} {problem}" if problem else None


def dir_problem(path: Path) -> str | None:
    """Why ``path`` cannot be used as an output directory, or ``None`` when it can (see :func:`output_problem`).

    Parameters
    ----------
    path : Path
        An existing directory, or a path whose nearest existing ancestor is a writable directory.

    Returns
    -------
    str or None
        A reason such as ``"is an existing file"``; ``None`` when the path can be written to.
    """
    path = path.absolute()
    try:
        return _existing_dir_problem(path) if path.exists() else _new_dir_problem(path)
    except OSError as exc:  # e.g. a parent directory that cannot be searched
        return f"cannot be checked: {exc.strerror}"


def _existing_file_problem(path: Path) -> str | None:
    if not path.is_file():
        return "is not a regular file"
    if not os.access(path, os.W_OK):
        return "is a file this user cannot write to"
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
    except OSError as exc:
        return f"is a file that cannot be written ({exc.strerror})"
    return None


def _existing_dir_problem(path: Path) -> str | None:
    if not path.is_dir():
        return "is an existing file, not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return "is a directory this user cannot write to"
    failed = _write_fails(path)
    return f"is a directory that cannot be written ({failed})" if failed else None


def _new_dir_problem(path: Path) -> str | None:
    ancestor = next(p for p in path.parents if p.exists())
    if not ancestor.is_dir():
        return f"cannot be created: {str(ancestor)!r} is a file"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"cannot be created: {str(ancestor)!r} is not writable by this user"
    failed = _write_fails(ancestor)
    return f"cannot be created: nothing can be written in {str(ancestor)!r} ({failed})" if failed else None


def _write_fails(directory: Path) -> str | None:
    """Why a file cannot be created in ``directory`` (the system's reason), or ``None``; leaves nothing."""
    try:
        fd, name = tempfile.mkstemp(prefix=".kvpolicy-write-check-", dir=directory)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    os.close(fd)
    os.unlink(name)
    return None


#: memory units: binary (KiB...) and decimal (KB...)
_MEMORY_UNITS = {
    "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}  # fmt: skip
_MEMORY = re.compile(r"([0-9]{1,15}(?:\.[0-9]{1,9})?)\s*([a-zA-Z]*)")


def memory_size(text: str) -> int:
    """A memory budget in bytes: a number and a unit, binary (``512MiB``, ``4GiB``) or decimal (``4GB``).

    Raises
    ------
    argparse.ArgumentTypeError
        A value without a unit, an unknown or ambiguous unit (``4G``: GiB or GB?), or a budget under one byte.
    """
    match = _MEMORY.fullmatch(text.strip())
    allowed = "a number and a unit: 512MiB, 4GiB, 4GB (KiB, MiB, GiB, TiB or KB, MB, GB, TB)"
    if match is None:
        raise argparse.ArgumentTypeError(f"must be {allowed}; got {text!r}")
    number, unit = match[1], match[2].lower()
    if unit not in _MEMORY_UNITS:
        guesses = [u for u in ("KiB", "MiB", "GiB", "TiB") if unit and u.lower().startswith(unit[0])]
        hint = f"; did you mean {number}{guesses[0]} or {number}{guesses[0].replace('i', '')}?" if guesses else ""
        raise argparse.ArgumentTypeError(f"must be {allowed}; got {text!r}{hint}")
    value = int(float(number) * _MEMORY_UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least one byte; got {text!r}")
    return value


def preset_name(text: str) -> str:
    """A registered preset, a preset file shipped with kvpolicy or a preset file's path
    (:func:`kvpolicy.preset_source.resolve`); another name is refused with the closest one."""
    from kvpolicy import preset_source

    try:
        preset_source.check(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text
