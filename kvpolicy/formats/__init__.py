"""Quantized tensor formats: one file each, owning its blocks' methods and its reference attention.

- :mod:`kvpolicy.formats.packed`: :class:`MinMax` specs, :class:`PackedTensor` blocks (asymmetric
  min-max groups, bit-packed; the ``"minmax"`` scheme);
- :mod:`kvpolicy.formats.codebook`: :class:`Codebook` specs, :class:`CodebookTensor` blocks
  (Lloyd-Max indices with a per-vector scale; the ``"codebook"`` scheme), imported when first used.

A new format is one file: a frozen :class:`~kvpolicy.formats.base.Format` spec and its
:class:`~kvpolicy.formats.base.QTensor` block, registered under its :attr:`~Format.name` through the
``kvpolicy_register_formats`` hook, as the built-in ones are (docs/how-to/write-a-plugin.md, "Write a
format"). The registry is the one table of formats: :func:`named` looks a scheme name up there.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvpolicy.errors import ConfigError
from kvpolicy.formats.base import Format, QTensor, attend, reference_attend
from kvpolicy.formats.packed import MinMax, PackedTensor

__all__ = [
    "Codebook", "CodebookTensor", "Format", "MinMax", "PackedTensor", "QTensor", "attend", "from_arguments",
    "load_block", "named", "reference_attend",
]  # fmt: skip

#: names imported when first used (a cache of min-max blocks never loads the codebook)
_LAZY = {"Codebook": "kvpolicy.formats.codebook", "CodebookTensor": "kvpolicy.formats.codebook"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvpolicy.formats' has no attribute {name!r}")


def named(name: str, param: str = "scheme", owner: str = "Quantize") -> type[Format]:
    """The format class registered under ``name`` (built in, or by a plugin).

    Raises
    ------
    ConfigError
        Naming ``param`` of ``owner`` and the registered formats, when none is registered under ``name``.
    """
    from kvpolicy import registry

    if isinstance(name, str) and name in registry.names("formats"):
        return registry.get("formats", name)
    raise ConfigError(
        f"{owner}: {param} must be one of {registry.names('formats')} or a Format class; got {param}={name!r} "
        f"({registry.moved('formats')})"
    )


def from_arguments(
    backend: str, bits: int, group_size: int | None, axis: str, meta_dtype: str = "auto", scheme: str = "minmax",
    fit: str = "minmax",
) -> Format:  # fmt: skip
    """The format the positional form ``Backend.quantize(x, bits, group_size, axis, meta_dtype=..., scheme=...,
    fit=...)`` names (the shortcut kept for callers of the flat signature): the options the format takes, a
    group size and axis left out where it has no groups.

    Raises
    ------
    ConfigError
        Naming ``backend`` when ``scheme`` is not a registered format's name, or an option the format does
        not take is given (``fit`` other than ``"minmax"``), or the format refuses one.
    """
    cls = named(scheme, "scheme", f"backend {backend!r}")
    given = {"bits": bits, "meta_dtype": meta_dtype, "group_size": group_size, "axis": axis, "fit": fit}
    taken = cls.options()
    if fit != "minmax" and "fit" not in taken:
        raise ConfigError(f"backend {backend!r}: fit={fit!r} applies to scheme='minmax' only; got scheme={scheme!r}")
    return cls(**{k: v for k, v in given.items() if k in taken})


def load_block(state: dict, fmt: Format | None = None) -> QTensor:
    """The block a saved ``state`` describes: ``fmt``'s block (a stream's own format), checked by its
    ``from_state``; without ``fmt``, the block of the registered format whose layouts name ``state``'s
    ``"layout"`` (a min-max block's checks name what is wrong when none does).

    Raises
    ------
    ValueError
        If ``state`` does not describe a block of the format (it comes from a file).
    """
    if fmt is not None:
        return fmt.block.from_state(state)
    from kvpolicy import registry

    layout = state.get("layout") if isinstance(state, dict) else None
    for _, cls, _ in registry.entries("formats"):
        if layout in cls.block.layouts:
            return cls.block.from_state(state)
    return PackedTensor.from_state(state)
