"""Preset files shipped with kvpolicy: TOML files whose ``[cache]`` table holds
:class:`~kvpolicy.CompressedCache` keywords (what ``kvpolicy tune`` writes).

``CompressedCache.from_config(name)`` takes one of :func:`names` as well as a path.
"""

from __future__ import annotations

from pathlib import Path

from kvpolicy.errors import ConfigError, did_you_mean

_HERE = Path(__file__).resolve().parent


def names() -> list[str]:
    """The shipped preset files, by name (the file name without ``.toml``)."""
    return sorted(p.stem for p in _HERE.glob("*.toml"))


def resolve(path: str | Path) -> Path:
    """``path`` itself when it names an existing file, has a directory part or ends in ``.toml``; else the
    shipped file of that name.

    Raises
    ------
    ConfigError
        For a bare name that is neither a file here nor a shipped preset file (with the close matches).
    """
    p = Path(path)
    if p.exists() or p.suffix == ".toml" or len(p.parts) != 1:
        return p
    shipped = _HERE / f"{p.name}.toml"
    if shipped.is_file():
        return shipped
    hint = did_you_mean(p.name, names())
    raise ConfigError(
        f"from_config: {str(path)!r} is neither a file nor a shipped preset file{hint} (shipped: {names()}; a path "
        "to your own TOML file works too)"
    )
