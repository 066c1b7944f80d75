"""Argument types shared by the subcommands: each checks one flag's value at parse time.

Each is an ``argparse`` ``type=`` callable: a bad value raises :class:`argparse.ArgumentTypeError`,
which argparse reports as ``kvpolicy <command>: error: argument --flag: <message>`` on stderr with
exit status 2, before any model is loaded. Messages name the value and what is allowed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def positive_int(text: str) -> int:
    """An integer >= 1 (steps, repetitions, threads, token counts)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1; got {text!r}")
    return value


def list_item(convert: Callable[[str], T], flag: str, spec: bool = False) -> Callable[[str], T]:
    """The type of one value of the list flag ``flag``: ``convert``, after refusing a comma-separated value.

    Lists are space-separated (``--bits 2 4``); ``"2,4"`` is refused with a message naming ``flag``, the
    value and the form to type instead.

    Parameters
    ----------
    convert : callable
        The type of one value (``str -> T``, raising :class:`argparse.ArgumentTypeError`).
    flag : str
        The flag's name, for the message (``"--bits"``).
    spec : bool, optional
        The values are ``name[:key=value...]`` specs, whose values may hold commas
        (``speed:contexts=1024,4096``): only a comma in the name is refused (``lm,passkey``).

    Returns
    -------
    callable
        ``str -> T``.
    """

    def parse(text: str) -> T:
        if "," in (text.split(":", 1)[0] if spec else text):
            parts = [p.strip() for p in text.split(",") if p.strip()] or ["VALUE"]
            raise argparse.ArgumentTypeError(
                f"{text!r} is comma-separated; {flag} takes its values separated by spaces: {flag} {' '.join(parts)}"
            )
        return convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


#: the dtypes every ``--dtype`` flag takes: torch's names
DTYPES = ("float32", "bfloat16", "float16")
#: other spellings, refused with the torch name to use instead
_DTYPE_ALIASES = {
    "fp32": "float32", "f32": "float32", "float": "float32", "single": "float32",
    "bf16": "bfloat16", "bfloat": "bfloat16",
    "fp16": "float16", "f16": "float16", "half": "float16",
}  # fmt: skip


def dtype_name(text: str) -> str:
    """One of :data:`DTYPES`; another spelling (``fp32``, ``bf16``) is refused with the torch name to use."""
    if text in DTYPES:
        return text
    import difflib

    guess = _DTYPE_ALIASES.get(text.strip().lower().removeprefix("torch."))
    guess = guess or next(iter(difflib.get_close_matches(text.lower(), DTYPES, n=1)), None)
    hint = f"; did you mean {guess!r}?" if guess else ""
    raise argparse.ArgumentTypeError(f"must be one of {', '.join(DTYPES)} (torch's names); got {text!r}{hint}")


def model_name(text: str) -> str:
    """A model as ``kvpolicy ablate --model`` takes it: a built-in name, a local path or a hub id.

    Refused here: an empty name, a local path that does not exist, a directory without ``config.json``.
    Whether a hub id is in the local cache is checked when the command starts
    (the command's own check).
    """
    name = text.strip()
    if not name:
        raise argparse.ArgumentTypeError("must be a model name, a local path or a hub id; got an empty string")
    path = Path(name).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory without config.json, not a transformers model")
    if not path.exists() and (name.startswith((".", "/", "~")) or name.endswith(".gguf") or name.count("/") > 1):
        raise argparse.ArgumentTypeError(f"model path {text!r} does not exist")
    return name
