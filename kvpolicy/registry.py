"""Names -> classes for policies, actions, backends and presets, collected through pluggy hooks."""

from __future__ import annotations

from typing import Any

import pluggy

from kvpolicy import builtins, hookspecs
from kvpolicy.errors import ConfigError

KINDS = ("policies", "actions", "backends", "presets")
_SINGULAR = {"policies": "policy", "actions": "action", "backends": "backend", "presets": "preset"}

_manager: pluggy.PluginManager | None = None
_tables: dict[str, dict[str, tuple[Any, str]]] | None = None


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager (built-ins registered on first use)."""
    global _manager
    if _manager is None:
        pm = pluggy.PluginManager("kvpolicy")
        pm.add_hookspecs(hookspecs)
        pm.register(builtins, name="kvpolicy.builtins")
        _manager = pm
    return _manager


def register(plugin: object, name: str | None = None) -> None:
    """Register a plugin object (a module or instance with ``kvpolicy_register_*`` hooks)."""
    global _tables
    plugin_manager().register(plugin, name=name)
    _tables = None


def unregister(plugin: object) -> None:
    """Remove a plugin registered with :func:`register`."""
    global _tables
    plugin_manager().unregister(plugin)
    _tables = None


def _collect() -> dict[str, dict[str, tuple[Any, str]]]:
    global _tables
    if _tables is not None:
        return _tables
    pm = plugin_manager()
    tables: dict[str, dict[str, tuple[Any, str]]] = {k: {} for k in KINDS}
    for kind in KINDS:
        hook = getattr(pm.hook, f"kvpolicy_register_{kind}")
        for impl in reversed(hook.get_hookimpls()):  # registration order
            source = impl.plugin_name
            for name, obj in (impl.function() or {}).items():
                if name in tables[kind]:
                    other = tables[kind][name][1]
                    raise ConfigError(
                        f"{_SINGULAR[kind]} name {name!r} is registered twice: by {other!r} and by {source!r}"
                    )
                tables[kind][name] = (obj, source)
    _tables = tables
    return tables


def names(kind: str) -> list[str]:
    """Registered names of ``kind`` (one of ``policies``, ``actions``, ``backends``, ``presets``)."""
    return sorted(_collect()[kind])


def get(kind: str, name: str) -> Any:
    """Look up ``name``; unknown names raise an error listing the registered ones."""
    table = _collect()[kind]
    if not isinstance(name, str) or name not in table:
        singular = _SINGULAR[kind]
        raise ConfigError(f"unknown {singular} {name!r}; registered {kind}: {sorted(table)}")
    return table[name][0]
