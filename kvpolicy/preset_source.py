"""One resolver for every name that stands for a composition: a registered preset (``"kvpolicy-3bit"``), a preset
file shipped with kvpolicy (``"smollm2-8k-2.5bit"``), a plugin's model preset (:mod:`kvpolicy.model_presets`) or
the path of a user's preset file.

``CompressedCache.for_model``, ``from_preset`` and ``from_config``, the command line and the lab's ``estimate``
all go through :func:`resolve` (and :meth:`kvpolicy.spec.CacheSpec.from_source`), so a name works (or is refused,
with the same ``did you mean``) everywhere alike.

The rules, in order:

1. a ``pathlib.Path`` (any ``os.PathLike``) is a path;
2. a registered preset name, then a shipped preset file's name, then a registered model preset's name, is that
   preset, even when a file of the same name sits in the working directory (a warning names that file and how to
   load it instead);
3. a string that is clearly a path is a path: it has a directory part (``./smollm2-3bit``, ``presets/x``), ends
   in ``.toml``, is absolute or starts with ``~``;
4. anything else is refused, with the closest known name, and, when a file of that name exists here, the path
   to type to load it.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpolicy.errors import ConfigError, did_you_mean

#: what :class:`PresetSource` can be
KINDS = ("preset", "shipped file", "model preset", "file", "default")


@dataclass(frozen=True)
class PresetSource:
    """Where a composition's name leads (see :func:`resolve`).

    Parameters
    ----------
    name : str
        The name or path as given.
    kind : {"preset", "shipped file", "model preset", "file", "default"}
        A registered preset, a preset file shipped with kvpolicy, a preset file a distribution registers as a
        model preset (:mod:`kvpolicy.model_presets`), a user's preset file, or ``CompressedCache()``'s defaults
        (what ``for_model(model, "auto")`` builds where no model preset suits the model).
    path : Path or None
        The file read (absolute), for the file kinds.
    reason : str or None
        Why it was chosen, when ``for_model(model, "auto")`` chose it (``repr`` of the cache shows it).
    """

    name: str
    kind: str
    path: Path | None = None
    reason: str | None = None

    def __str__(self) -> str:
        if self.kind == "preset":
            return f"preset {self.name!r}"
        if self.kind == "shipped file":
            return f"preset file {self.name!r} shipped with kvpolicy ({self.path})"
        if self.kind == "model preset":
            return f"model preset {self.name!r} ({self.path})"
        if self.kind == "default":
            return "the default composition"
        return f"preset file {str(self.path)!r}"


def names() -> list[str]:
    """Every name :func:`resolve` takes without a path: the registered presets, the shipped preset files, then the
    registered model presets."""
    from kvpolicy import preset_files, registry

    known = registry.names("presets")
    known += [name for name in preset_files.names() if name not in known]
    return known + [name for name in registry.names("model_presets") if name not in known]


def looks_like_path(text: str) -> bool:
    """Whether ``text`` was clearly meant as a path: a directory part, a ``.toml`` suffix, absolute, or ``~``."""
    seps = [s for s in (os.sep, os.altsep, "/") if s]
    return (
        any(s in text for s in seps)
        or text.lower().endswith(".toml")
        or text.startswith("~")
        or (Path(text).is_absolute())
    )


def resolve(name: str | os.PathLike) -> PresetSource:
    """The composition ``name`` stands for (the rules are in this module's docstring).

    Parameters
    ----------
    name : str or os.PathLike
        A registered preset, a shipped preset file's name, or the path of a preset file.

    Returns
    -------
    PresetSource

    Raises
    ------
    ConfigError
        An unknown name (with the closest known one), or a name that is not a string or a path.
    """
    from kvpolicy import preset_files, registry

    if isinstance(name, os.PathLike):
        return PresetSource(os.fspath(name), "file", Path(name).expanduser().absolute())
    if not isinstance(name, str):
        raise ConfigError(
            f"a preset is a preset's name or a preset file's path (str or pathlib.Path); got a {type(name).__name__}:"
            f" {name!r:.80}"
        )
    if name in registry.names("presets"):
        _warn_if_shadowed(name)
        return PresetSource(name, "preset")
    if name in preset_files.names():
        _warn_if_shadowed(name)
        return PresetSource(name, "shipped file", preset_files.path(name))
    if name in registry.names("model_presets"):
        _warn_if_shadowed(name)
        return PresetSource(name, "model preset", registry.get("model_presets", name).path())
    if name.strip() and looks_like_path(name):
        return PresetSource(name, "file", Path(name).expanduser().absolute())
    here = ""
    if name.strip() and Path(name).exists():
        here = f"; a file named {name!r} is in the working directory: pass {'./' + name!r} to load it"
    hint = did_you_mean(name, names())
    raise ConfigError(
        f"unknown preset {name!r}{hint}{here} (presets: {', '.join(registry.names('presets'))}; preset files shipped "
        f"with kvpolicy: {', '.join(preset_files.names())}{_model_presets()}; or the path of a preset file such as "
        "./my-preset.toml)"
    )


def _model_presets() -> str:
    """``; model presets: a, b`` for the refusal of an unknown name, or nothing when none is registered."""
    from kvpolicy import registry

    found = registry.names("model_presets")
    return f"; model presets plugins register: {', '.join(found)}" if found else ""


def _warn_if_shadowed(name: str) -> None:
    """Say so when a file in the working directory has the name of a preset (the preset is what loads)."""
    if Path(name).exists():
        warnings.warn(
            f"{name!r} names a preset shipped with kvpolicy, and that is what was loaded; the file {name!r} in the "
            f"working directory was not read (pass {'./' + name!r} to load it instead)",
            UserWarning,
            stacklevel=4,
        )


def check(name: str | os.PathLike) -> PresetSource:
    """:func:`resolve`, and for a file, that it exists (the check of a command-line flag, before any work).

    Raises
    ------
    ConfigError
        An unknown name, or a preset file that does not exist.
    """
    source = resolve(name)
    if source.path is not None and not source.path.exists():
        dangling = source.path.is_symlink()
        problem = "is a link to a path that does not exist" if dangling else "does not exist"
        raise ConfigError(f"preset file {source.name!r} {problem}")
    return source


#: the largest preset file read (they are a few KiB)
MAX_FILE_BYTES = 1 << 16


def read_table(source: PresetSource) -> dict[str, Any]:
    """The ``[cache]`` table of the preset file ``source``, read as untrusted input.

    Raises
    ------
    ConfigError
        The file cannot be read or parsed (:func:`kvpolicy.textfile.load_toml`), or has no ``[cache]`` table.
    """
    from kvpolicy import textfile

    assert source.path is not None
    shown = source.name if source.kind == "file" else str(source.path)
    data = textfile.load_toml(shown, "preset file", MAX_FILE_BYTES)
    table = data.get("cache")
    if not isinstance(table, dict):
        found = f"its [cache] is a {type(table).__name__}" if "cache" in data else f"it has {sorted(data)[:10]}"
        raise ConfigError(
            f"preset file {shown!r} has no [cache] table of CompressedCache keywords ({found}); kvpolicy tune writes "
            "such files"
        )
    return table
