"""Exceptions raised by kvpolicy. Every message names the parameter, the value and what is allowed."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

#: the distribution of the evaluation and planning tools (``kvpolicy_lab``), named by the messages that send a user
#: to it (a lab subcommand, or a name that moved there, asked for without it)
LAB_PACKAGE = "kvpolicy-lab"
#: how to install it
LAB_INSTALL = f"pip install {LAB_PACKAGE} (from a clone of kvpolicy: pip install ./lab)"


def did_you_mean(value: object, known: Iterable[object]) -> str:
    """``"; did you mean 'x'?"`` for the known name closest to ``value`` (:func:`difflib.get_close_matches`),
    or ``""`` when none is close: the suffix of a message refusing a misspelt name.

    Parameters
    ----------
    value : object
        The name given.
    known : iterable
        The names allowed.
    """
    close = difflib.get_close_matches(str(value), [str(k) for k in known], n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


class ConfigError(ValueError):
    """A parameter has a value that the composition (policy, action, backend, layout) cannot accept."""


class NonFiniteError(ValueError):
    """NaN or Inf reached the quantizer (quantizing it would spread garbage through a whole group), or
    came out of it (:class:`MetadataOverflowError`)."""


class MetadataOverflowError(NonFiniteError):
    """Finite input gave a non-finite scale or minimum: the group's range does not fit the dtype the
    quantization metadata is stored in (e.g. float32 keys beyond 65504 with float16 metadata). The
    message names the dtype, the magnitude and the remedy (usually ``meta_dtype="float32"``)."""


class MissingDependencyError(ConfigError, ImportError):
    """An optional package (a backend's library) is not installed; the message names the extra that
    installs it.

    Subclasses both :class:`ConfigError` (the composition asked for something this environment
    cannot do) and :class:`ImportError` (what is missing is a package).
    """


class CacheFileError(ValueError):
    """A saved cache cannot be loaded: the file is missing, truncated, corrupted, of another format
    version, or does not fit the model or the installed parts (the message names what differs)."""


class PaddingError(NotImplementedError):
    """A compressed cache was given padding it cannot serve exactly (right padding, a hole in the attention
    mask, padding that appears after a row's first token). The message names the row, what marked the
    padding and the remedy (``padding_side="left"``); ``action="none"`` serves any padding."""
