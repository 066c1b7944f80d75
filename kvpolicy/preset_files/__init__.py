"""Preset files shipped with kvpolicy: TOML files whose ``[cache]`` table holds
:class:`~kvpolicy.CompressedCache` keywords (what ``kvpolicy tune`` writes).

They load by name like the registered presets (``CompressedCache.for_model(model, "smollm2-8k-2.5bit")``,
``from_preset``, ``from_config``, the lab's ``kvpolicy estimate --preset``): :mod:`kvpolicy.preset_source` resolves
every such name.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def names() -> list[str]:
    """The shipped preset files, by name (the file name without ``.toml``)."""
    return sorted(p.stem for p in _HERE.glob("*.toml"))


def path(name: str) -> Path:
    """The file of the shipped preset file ``name`` (one of :func:`names`)."""
    if name not in names():
        raise KeyError(f"no shipped preset file {name!r}; shipped: {names()}")
    return _HERE / f"{name}.toml"
