"""Argument types shared by the subcommands: each checks one flag's value at parse time.

Each is an ``argparse`` ``type=`` callable: a bad value raises :class:`argparse.ArgumentTypeError`,
which argparse reports as ``kvpolicy <command>: error: argument --flag: <message>`` on stderr with
exit status 2, before any model is loaded. Messages name the value and what is allowed.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from kvpolicy.errors import did_you_mean

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


#: the most tokens any token-count flag takes (the largest position a cache can hold)
MAX_TOKEN_COUNT = (1 << 31) - 1
#: a token count as typed: digits and an optional ``k`` (x 1024) or ``m`` (x 1024**2)
_TOKENS = re.compile(r"([0-9]{1,12})([kKmM]?)")
_TOKEN_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20}


def tokens(minimum: int = 1, maximum: int = MAX_TOKEN_COUNT) -> Callable[[str], int]:
    """The type of every flag that takes a token count: ``512``, ``2k``, ``8k``, ``128k`` (``k`` = 1024, ``m`` =
    1024**2), in ``[minimum, maximum]``.

    Parameters
    ----------
    minimum, maximum : int, optional
        The range allowed (default: 1 to :data:`MAX_TOKEN_COUNT`).

    Returns
    -------
    callable
        ``str -> int``, raising :class:`argparse.ArgumentTypeError` with the value and what is allowed.
    """

    def parse(text: str) -> int:
        match = _TOKENS.fullmatch(text.strip())
        if match is None:
            raise argparse.ArgumentTypeError(
                f"must be a token count such as 512, 2k, 8k or 128k (k = 1024); got {text!r}"
            )
        value = int(match[1]) * _TOKEN_UNITS[match[2].lower()]
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be a token count from {minimum} to {maximum}; got {text!r}")
        return value

    parse.__name__ = "token_count"
    return parse


#: ``--tokens``, ``--context``, ``--lengths``...: a token count >= 1 (:func:`tokens`)
token_count = tokens()


def choice_of(kind: str, known: Callable[[], list[str]]) -> Callable[[str], str]:
    """The type of a flag that takes one of the names ``known()`` returns (registered backends...): another
    name is refused with the closest one.

    Parameters
    ----------
    kind : str
        What a name is, for messages (``"backend"``).
    known : callable
        ``() -> list of str``, called when a value is checked (so plugins are loaded only then).
    """

    def parse(text: str) -> str:
        names = known()
        if text in names:
            return text
        raise argparse.ArgumentTypeError(
            f"unknown {kind} {text!r}{did_you_mean(text, names)} (one of: {', '.join(names)})"
        )

    parse.__name__ = kind
    return parse


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


#: how the built-in models are named in messages
BUILTIN_MODELS = "smollm2, gemma3-270m, tiny-<llama|qwen2|phi3|mistral>[-LAYERS]"


def model_name(text: str) -> str:
    """A model as every ``--model`` flag takes it: a built-in name, a local path or a hub id.

    Refused here: an empty name, a local path that does not exist, a directory without ``config.json``, a
    ``tiny-`` name of an unknown family, and a bare name (no ``/``) that is not a built-in name but close to one
    (``smolm2``: a typo, not a hub id). Whether a hub id is in the local cache is checked when the command starts
    (the command's own check, which knows ``--online``).
    """
    from kvpolicy.reference_models import GEMMA3_ALIASES, SMOLLM2_ALIASES
    from kvpolicy.tiny import MODEL_FAMILIES, PREFIX

    name = text.strip()
    if not name:
        raise argparse.ArgumentTypeError("must be a model name, a local path or a hub id; got an empty string")
    path = Path(name).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory without config.json, not a transformers model")
    if not path.exists() and (name.startswith((".", "/", "~")) or name.endswith(".gguf") or name.count("/") > 1):
        raise argparse.ArgumentTypeError(f"model path {text!r} does not exist")
    if path.exists() or "/" in name or name.lower() in SMOLLM2_ALIASES | GEMMA3_ALIASES:
        return name
    if name.startswith(PREFIX):
        family, _, layers = name[len(PREFIX) :].partition("-")
        if family not in MODEL_FAMILIES:
            close = did_you_mean_name(family, MODEL_FAMILIES)
            hint = f"; did you mean '{PREFIX}{close}{'-' + layers if layers else ''}'?" if close else ""
            raise argparse.ArgumentTypeError(
                f"unknown tiny model {name!r}{hint} (tiny-<family>[-LAYERS], family one of {', '.join(MODEL_FAMILIES)})"
            )
        if layers and not layers.isdecimal():
            raise argparse.ArgumentTypeError(f"tiny model {name!r}: LAYERS must be a positive integer (tiny-llama-4)")
        return name
    known = sorted(SMOLLM2_ALIASES | GEMMA3_ALIASES) + [PREFIX + f for f in MODEL_FAMILIES]
    hint = did_you_mean(name.lower(), known)
    if hint:
        raise argparse.ArgumentTypeError(
            f"unknown model {text!r}{hint} (built-in: {BUILTIN_MODELS}; or a local model folder, a .gguf file or a "
            "hub id such as org/name)"
        )
    return name


def did_you_mean_name(value: str, known: tuple[str, ...] | list[str]) -> str:
    """The known name closest to ``value`` (``""`` when none is close)."""
    import difflib

    close = difflib.get_close_matches(value, list(known), n=1)
    return close[0] if close else ""
