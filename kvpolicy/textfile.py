"""Small text files a user hands kvpolicy (preset files, grid files, a model folder's ``config.json``), read as
untrusted input.

:func:`read_text` opens the path without following it into anything but a regular file (a directory, a device
such as ``/dev/zero``, a named pipe or a socket is refused before a byte is read, so nothing blocks or runs
forever), refuses a file larger than its limit, a binary file and one that is not UTF-8; :func:`load_toml` and
:func:`load_json` parse it and refuse malformed or deeply nested data. Every refusal is a
:class:`~kvpolicy.errors.ConfigError` of one line naming the file and the problem.
"""

from __future__ import annotations

import json
import os
import stat
import tomllib
from pathlib import Path
from typing import Any

from kvpolicy.errors import ConfigError

#: the largest file :func:`read_text` reads by default (preset and grid files are a few KiB)
MAX_BYTES = 1 << 20
#: the deepest nesting of tables and lists :func:`load_toml` and :func:`load_json` accept
MAX_DEPTH = 32


def read_text(path: str | os.PathLike, what: str, limit: int = MAX_BYTES) -> str:
    """The UTF-8 text of the regular file ``path``.

    Parameters
    ----------
    path : str or os.PathLike
        The file (``~`` is expanded; a symbolic link is followed, and what it leads to must be a regular file).
    what : str
        What the file is, for messages (``"preset file"``).
    limit : int, optional
        The largest size accepted, in bytes (default :data:`MAX_BYTES`).

    Returns
    -------
    str

    Raises
    ------
    ConfigError
        The file does not exist, cannot be opened, is not a regular file, is larger than ``limit``, holds NUL
        bytes (a binary file) or is not UTF-8.
    """
    p = Path(path).expanduser()
    name = f"{what} {str(path)!r}"
    try:
        # O_NONBLOCK: opening a named pipe returns at once (it is then refused), instead of waiting for a writer
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        dangling = p.is_symlink()
        problem = "is a link to a path that does not exist" if dangling else "does not exist"
        raise ConfigError(f"{name} {problem}") from None
    except OSError as exc:
        raise ConfigError(f"{name} cannot be opened: {exc.strerror or type(exc).__name__}") from None
    mode = os.fstat(fd)
    problem = None
    if stat.S_ISDIR(mode.st_mode):
        problem = "is a directory, not a file"
    elif not stat.S_ISREG(mode.st_mode):
        problem = "is not a regular file (a device, a pipe or a socket); give a file"
    elif mode.st_size > limit:
        problem = f"is {mode.st_size} bytes; a {what} is at most {limit} bytes"
    if problem is not None:
        os.close(fd)
        raise ConfigError(f"{name} {problem}")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise ConfigError(f"{name} cannot be read: {exc.strerror or type(exc).__name__}") from None
    if len(data) > limit:
        raise ConfigError(f"{name} is larger than {limit} bytes, the most a {what} may hold")
    if b"\x00" in data:
        raise ConfigError(f"{name} is a binary file (it holds NUL bytes), not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{name} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); save it as UTF-8"
        ) from None


def load_toml(path: str | os.PathLike, what: str, limit: int = MAX_BYTES) -> dict[str, Any]:
    """The TOML document of ``path`` (:func:`read_text`), nested at most :data:`MAX_DEPTH` deep.

    Raises
    ------
    ConfigError
        Anything :func:`read_text` refuses, malformed TOML (with its line and column) or too deep a nesting.
    """
    return _load(path, what, limit, tomllib.loads, tomllib.TOMLDecodeError, "TOML", "tables")


def load_json(path: str | os.PathLike, what: str, limit: int = MAX_BYTES) -> Any:
    """The JSON document of ``path`` (:func:`read_text`), nested at most :data:`MAX_DEPTH` deep.

    Raises
    ------
    ConfigError
        Anything :func:`read_text` refuses, malformed JSON (with its line and column) or too deep a nesting.
    """
    return _load(path, what, limit, json.loads, json.JSONDecodeError, "JSON", "objects")


def _load(
    path: str | os.PathLike, what: str, limit: int, parse: Any, error: type[Exception], language: str, tables: str
) -> Any:
    text = read_text(path, what, limit)
    try:
        data = parse(text)
    except error as exc:
        raise ConfigError(f"{what} {str(path)!r} is not valid {language}: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{what} {str(path)!r} nests {tables} or arrays too deeply to read") from None
    check_depth(data, f"{what} {str(path)!r}")
    return data


def check_depth(data: Any, where: str, limit: int = MAX_DEPTH) -> None:
    """Refuse ``data`` (parsed TOML or JSON) whose dicts and lists nest more than ``limit`` deep.

    Raises
    ------
    ConfigError
        Naming ``where`` and the limit.
    """
    level, depth = [data], 0
    while True:
        containers = [item for item in level if isinstance(item, (dict, list))]
        if not containers:
            return
        depth += 1
        if depth > limit:
            raise ConfigError(f"{where} nests tables or arrays more than {limit} levels deep")
        level = [child for c in containers for child in (c.values() if isinstance(c, dict) else c)]
