"""Quantized tensor formats: one file each, owning its blocks' methods and its reference attention.

- :mod:`kvpolicy.formats.packed`: :class:`MinMax` specs, :class:`PackedTensor` blocks (asymmetric
  min-max groups, bit-packed; the ``"minmax"`` scheme);
- :mod:`kvpolicy.formats.codebook`: :class:`Codebook` specs, :class:`CodebookTensor` blocks
  (Lloyd-Max indices with a per-vector scale; the ``"codebook"`` scheme);
- :mod:`kvpolicy.formats.lattice`: :class:`Lattice` specs, :class:`LatticeTensor` blocks (D4 lattice
  indices, four channels each, with a per-vector scale; the ``"lattice"`` scheme).

A new format is one file: a frozen :class:`~kvpolicy.formats.base.Format` spec and its
:class:`~kvpolicy.formats.base.QTensor` block, registered under its :attr:`~Format.name` through the
``kvpolicy_register_formats`` hook (as a plugin registers any part). Backends that serve formats by
reference (``torch``) store and attend over it at once; others add kernels keyed by its classes.
"""

from __future__ import annotations

from kvpolicy.errors import ConfigError
from kvpolicy.formats.base import Format, QTensor, attend, reference_attend
from kvpolicy.formats.codebook import Codebook, CodebookTensor
from kvpolicy.formats.lattice import Lattice, LatticeTensor
from kvpolicy.formats.packed import MinMax, PackedTensor

__all__ = [
    "BUILTIN",
    "Codebook",
    "CodebookTensor",
    "Format",
    "Lattice",
    "LatticeTensor",
    "MinMax",
    "PackedTensor",
    "QTensor",
    "attend",
    "from_arguments",
    "load_block",
    "reference_attend",
]

#: the built-in formats by scheme name (registered in :mod:`kvpolicy.builtins` as well; a plugin's format is
#: looked up by name in the registry by :meth:`kvpolicy.spec.CacheSpec.resolve`, never here)
BUILTIN: dict[str, type[Format]] = {"minmax": MinMax, "codebook": Codebook, "lattice": Lattice}


def from_arguments(
    backend: str, bits: int, group_size: int | None, axis: str, meta_dtype: str = "auto", scheme: str = "minmax",
    fit: str = "minmax",
) -> Format:  # fmt: skip
    """The format the positional form ``Backend.quantize(x, bits, group_size, axis, meta_dtype=..., scheme=...,
    fit=...)`` names (the shortcut kept for callers of the flat signature).

    Raises
    ------
    ConfigError
        Naming ``backend`` when ``scheme`` is not a built-in format's name (a format a plugin registers is
        passed as its spec), or ``fit`` is not one of ``("minmax", "mse")`` or is given with another scheme.
    """
    from kvpolicy.formats.base import FITS

    if scheme not in BUILTIN:
        raise ConfigError(
            f"backend {backend!r}: scheme must be one of {list(BUILTIN)} in the positional form quantize(x, bits, "
            f"group_size, axis, scheme=...); got scheme={scheme!r} (pass any other format as its spec: "
            "quantize(x, MyFormat(...)))"
        )
    if fit not in FITS:
        raise ConfigError(f"backend {backend!r}: fit must be one of {list(FITS)}; got fit={fit!r}")
    if scheme != "minmax" and fit != "minmax":
        raise ConfigError(f"backend {backend!r}: fit={fit!r} applies to scheme='minmax' only; got scheme={scheme!r}")
    return BUILTIN[scheme].from_options(bits, group_size, axis, fit, meta_dtype)


def load_block(state: dict, fmt: Format | None = None) -> QTensor:
    """The block a saved ``state`` describes, chosen by its ``"layout"`` entry among the built-in formats'
    blocks and ``fmt``'s (a stream's own format); a layout none of them reads is checked as a packed
    block (whose checks name what is wrong). A block of another format than the stream's is refused by
    the stream's ``validate``.

    Raises
    ------
    ValueError
        If ``state`` does not describe a block (it comes from a file).
    """
    blocks = [f.block for f in BUILTIN.values()]
    if fmt is not None and fmt.block not in blocks:
        blocks.insert(0, fmt.block)
    layout = state.get("layout") if isinstance(state, dict) else None
    for block in blocks:
        if layout in block.layouts:
            return block.from_state(state)
    return PackedTensor.from_state(state)
