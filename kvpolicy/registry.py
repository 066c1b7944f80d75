"""Names -> classes for policies, actions, backends and presets, collected through pluggy hooks.

Three kinds of plugin feed the same hooks (:mod:`kvpolicy.hookspecs`):

- the built-in parts (:mod:`kvpolicy.builtins`), counted as coming from the distribution ``kvpolicy``;
- installed distributions that declare an entry point in the group ``kvpolicy``
  (``[project.entry-points."kvpolicy"] snapkv = "kvpolicy_snapkv"``), loaded on the first lookup,
  never on ``import kvpolicy``;
- objects passed to :func:`register` at run time.

Environment variables (read at the first lookup, or after :func:`reset`):

``KVPOLICY_DISABLE_PLUGIN_AUTOLOAD``
    any value but empty or ``0`` loads no entry points (the built-ins and :func:`register` still work).
``KVPOLICY_PLUGINS``
    comma-separated entry-point names: load only these.

A name registered twice (for the same kind) is a :class:`~kvpolicy.errors.ConfigError` naming both
distributions. A plugin that fails to load (or whose hook raises) is skipped with a
:class:`PluginWarning` naming it and its error; everything else keeps working.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

import pluggy

from kvpolicy import builtins, hookspecs
from kvpolicy.errors import ConfigError

KINDS = ("policies", "actions", "backends", "presets")
_SINGULAR = {"policies": "policy", "actions": "action", "backends": "backend", "presets": "preset"}

#: entry-point group third-party distributions declare
ENTRY_POINT_GROUP = "kvpolicy"
DISABLE_ENV = "KVPOLICY_DISABLE_PLUGIN_AUTOLOAD"
ALLOW_ENV = "KVPOLICY_PLUGINS"
_BUILTIN_PLUGIN = "kvpolicy.builtins"


class PluginWarning(UserWarning):
    """A plugin could not be loaded or its hook failed; it was skipped."""


@dataclass(frozen=True)
class Source:
    """Where a registered part came from.

    Attributes
    ----------
    distribution : str
        Distribution name (``"kvpolicy"`` for the built-ins), or the plugin name for objects
        passed to :func:`register`.
    version : str or None
        Distribution version (``None`` for run-time registrations).
    origin : str
        ``"built in"``, ``"entry point 'name' = module"`` or ``"registered at run time"``.
    """

    distribution: str
    version: str | None
    origin: str

    def __str__(self) -> str:
        dist = self.distribution if self.version is None else f"{self.distribution} {self.version}"
        return f"{dist} ({self.origin})"


_manager: pluggy.PluginManager | None = None
_tables: dict[str, dict[str, tuple[Any, Source]]] | None = None
_sources: dict[str, Source] = {}
_autoloaded = False


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager (built-ins registered on first use; entry points are loaded
    on the first lookup through :func:`names`, :func:`get` or :func:`entries`)."""
    global _manager
    if _manager is None:
        from kvpolicy import __version__

        pm = pluggy.PluginManager("kvpolicy")
        pm.add_hookspecs(hookspecs)
        pm.register(builtins, name=_BUILTIN_PLUGIN)
        _sources[_BUILTIN_PLUGIN] = Source("kvpolicy", __version__, "built in")
        _manager = pm
    return _manager


def register(plugin: object, name: str | None = None) -> None:
    """Register a plugin object (a module or instance with ``kvpolicy_register_*`` hooks) at run time."""
    global _tables
    registered = plugin_manager().register(plugin, name=name)
    if registered is not None:
        _sources[registered] = Source(registered, None, "registered at run time")
    _tables = None


def unregister(plugin: object) -> None:
    """Remove a plugin registered with :func:`register`."""
    global _tables
    pm = plugin_manager()
    name = pm.get_name(plugin)
    pm.unregister(plugin)
    _sources.pop(name or "", None)
    _tables = None


def reset() -> None:
    """Forget every plugin and table; the next lookup starts afresh (re-reading the environment)."""
    global _manager, _tables, _autoloaded
    _manager = None
    _tables = None
    _autoloaded = False
    _sources.clear()


def _allowed() -> set[str] | None:
    raw = os.environ.get(ALLOW_ENV, "").strip()
    if not raw:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def load_entry_points() -> int:
    """Load and register the distributions' ``kvpolicy`` entry points (once; honours the environment).

    Returns
    -------
    int
        Number of plugins registered by this call.
    """
    global _autoloaded, _tables
    pm = plugin_manager()
    if _autoloaded:
        return 0
    _autoloaded = True
    if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
        return 0
    import importlib.metadata

    allowed = _allowed()
    found: dict[tuple[str, str], tuple[Any, Any]] = {}
    for dist in importlib.metadata.distributions():
        for ep in dist.entry_points:
            if ep.group != ENTRY_POINT_GROUP or (allowed is not None and ep.name not in allowed):
                continue
            # the same distribution may be visible twice on sys.path: the first one wins, as for imports
            found.setdefault((dist.metadata["Name"] or "?", ep.name), (dist, ep))
    count = 0
    for (dist_name, ep_name), (dist, ep) in sorted(found.items()):
        source = Source(dist_name, dist.version, f"entry point {ep_name!r} = {ep.value}")
        key = f"{dist_name}:{ep_name}"
        try:
            plugin = ep.load()
            pm.register(plugin, name=key)
        except Exception as exc:  # a broken plugin must not take the others down
            warnings.warn(
                f"kvpolicy plugin {ep_name!r} from {source} failed to load and is skipped: {type(exc).__name__}: {exc}",
                PluginWarning,
                stacklevel=2,
            )
            continue
        _sources[key] = source
        count += 1
    if allowed is not None:
        missing = sorted(allowed - {ep_name for _, ep_name in found})
        if missing:
            warnings.warn(
                f"{ALLOW_ENV} names {missing}, but no installed distribution declares such an entry point "
                f"in the group {ENTRY_POINT_GROUP!r}",
                PluginWarning,
                stacklevel=2,
            )
    _tables = None
    return count


def _collect() -> dict[str, dict[str, tuple[Any, Source]]]:
    global _tables
    if _tables is not None:
        return _tables
    load_entry_points()
    pm = plugin_manager()
    impls: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        for impl in getattr(pm.hook, f"kvpolicy_register_{kind}").get_hookimpls():
            impls.setdefault(impl.plugin_name, {})[kind] = impl
    tables: dict[str, dict[str, tuple[Any, Source]]] = {k: {} for k in KINDS}
    for plugin_name, plugin in pm.list_name_plugin():  # registration order
        if plugin is None or plugin_name not in impls:  # blocked, or implements no hook
            continue
        source = _sources.get(plugin_name, Source(plugin_name, None, "registered at run time"))
        provided: dict[str, dict[str, Any]] = {}
        try:
            for kind, impl in impls[plugin_name].items():
                provided[kind] = impl.function() or {}
        except Exception as exc:
            if plugin_name == _BUILTIN_PLUGIN:
                raise
            warnings.warn(
                f"kvpolicy plugin {plugin_name!r} from {source}: its hook kvpolicy_register_{kind} raised "
                f"{type(exc).__name__}: {exc}; the plugin is skipped",
                PluginWarning,
                stacklevel=3,
            )
            continue
        for kind, parts in provided.items():
            for name, obj in parts.items():
                if name in tables[kind]:
                    other = tables[kind][name][1]
                    raise ConfigError(
                        f"{_SINGULAR[kind]} name {name!r} is registered twice: by {other} and by {source}. "
                        f"Uninstall one of the two distributions, or choose the entry points to load with "
                        f"{ALLOW_ENV}=name,name"
                    )
                tables[kind][name] = (obj, source)
    _tables = tables
    return tables


def names(kind: str) -> list[str]:
    """Registered names of ``kind`` (one of ``policies``, ``actions``, ``backends``, ``presets``)."""
    return sorted(_collect()[kind])


def entries(kind: str) -> list[tuple[str, Any, Source]]:
    """``(name, object, source)`` for every registered name of ``kind``, sorted by name."""
    table = _collect()[kind]
    return [(name, obj, source) for name, (obj, source) in sorted(table.items())]


def get(kind: str, name: str) -> Any:
    """Look up ``name``; unknown names raise an error listing the registered ones."""
    table = _collect()[kind]
    if not isinstance(name, str) or name not in table:
        singular = _SINGULAR[kind]
        raise ConfigError(f"unknown {singular} {name!r}; registered {kind}: {sorted(table)}")
    return table[name][0]
