"""Names -> classes for policies, actions, backends, transforms, presets, formats and file codecs, collected through
pluggy hooks.

Three kinds of plugin feed the same hooks (:mod:`kvpolicy.hookspecs`):

- the built-in parts (:mod:`kvpolicy.builtins`), counted as coming from the distribution ``kvpolicy``;
- installed distributions that declare an entry point in the group ``kvpolicy``
  (``[project.entry-points."kvpolicy"] snapkv = "kvpolicy_snapkv"``), loaded on the first lookup,
  never on ``import kvpolicy``;
- objects passed to :func:`register` at run time.

A hook may name a class as ``"package.module:Class"`` instead of giving it: the module is imported at the
first :func:`get` of that name (the built-ins register so, and a lookup never imports a part it does not need).

Environment variables (read at the first lookup, or after :func:`reset`):

``KVPOLICY_DISABLE_PLUGIN_AUTOLOAD``
    any value but empty or ``0`` loads no entry points (the built-ins and :func:`register` still work).
``KVPOLICY_PLUGINS``
    comma-separated entry-point names: load only these.

A name registered by two plugins (for the same kind) is a :class:`Conflict`: looking that name up
is a :class:`~kvpolicy.errors.ConfigError` naming both distributions, every other name still
resolves, and :func:`conflicts` lists it (``kvpolicy list`` and ``kvpolicy plugins`` print it).
A plugin that fails to load, whose hook raises, or whose hook returns something malformed (not a
dict, a name that is not a string, a value that is not a subclass of the kind's base class or, for a
preset, not callable, or a model preset that :func:`kvpolicy.model_presets.problem` refuses) is skipped as a
whole with one :class:`PluginWarning` naming it, its distribution and every problem found; everything else keeps
working.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import reprlib
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pluggy

from kvpolicy import builtins, hookspecs
from kvpolicy.errors import ConfigError, did_you_mean

KINDS = (
    "policies", "actions", "backends", "transforms", "presets", "formats", "codecs", "commands", "model_presets",
)  # fmt: skip
_SINGULAR = {
    "policies": "policy", "actions": "action", "backends": "backend", "transforms": "transform", "presets": "preset",
    "formats": "format", "codecs": "codec", "commands": "command", "model_presets": "model preset",
}  # fmt: skip
#: what each hook's dict maps names to, for messages
_EXPECTED = {
    "policies": "Policy subclass",
    "actions": "Action subclass",
    "backends": "Backend subclass",
    "transforms": "Transform subclass",
    "presets": "preset function",
    "formats": "Format subclass",
    "codecs": "Codec subclass",
    "commands": "function register(subparsers)",
    "model_presets": "kvpolicy.model_presets.ModelPreset",
}

#: entry-point group third-party distributions declare
ENTRY_POINT_GROUP = "kvpolicy"
DISABLE_ENV = "KVPOLICY_DISABLE_PLUGIN_AUTOLOAD"
ALLOW_ENV = "KVPOLICY_PLUGINS"
_BUILTIN_PLUGIN = "kvpolicy.builtins"
_RESEARCH = (
    "a format or codec a plugin registers is named once that plugin is installed (the research formats and file "
    "codecs: pip install ./plugins/kvpolicy-research)"
)
#: the parts that plugins shipped beside the core register (some of them built in in earlier releases), for the
#: message of a lookup that finds none: kind -> name -> which plugin registers it and how to install it; ``"*"``
#: stands for any name of that kind (what :func:`moved` says for a name the table does not list)
MOVED: dict[str, dict[str, str]] = {
    "formats": {"*": _RESEARCH},
    "codecs": {"*": _RESEARCH},
    "backends": {
        name: f"backend {name!r} comes from the plugin kvpolicy-quanto-hqq: pip install ./plugins/kvpolicy-quanto-hqq"
        for name in ("quanto", "hqq")
    },
}


def moved(kind: str, name: object = "*") -> str:
    """What :data:`MOVED` says about the unregistered ``name`` of ``kind`` (``""``: nothing)."""
    table = MOVED.get(kind, {})
    return table.get(name, table.get("*", "")) if isinstance(name, str) else table.get("*", "")


class PluginWarning(UserWarning):
    """A plugin could not be loaded, or its hook raised or returned something malformed; it was skipped."""


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


@dataclass(frozen=True)
class Conflict:
    """A name that more than one plugin registers for the same kind: looking it up is an error.

    Attributes
    ----------
    kind : str
        One of :data:`KINDS`.
    name : str
        The name registered more than once.
    sources : tuple of Source
        Every plugin registering it, in registration order (the built-ins first).
    """

    kind: str
    name: str
    sources: tuple[Source, ...]

    def __str__(self) -> str:
        times = "twice" if len(self.sources) == 2 else f"{len(self.sources)} times"
        by = " and by ".join(str(source) for source in self.sources)
        return f"{_SINGULAR[self.kind]} name {self.name!r} is registered {times}: by {by}"

    def error(self) -> ConfigError:
        """The error a lookup of :attr:`name` raises, saying how to resolve the conflict."""
        return ConfigError(
            f"{self}. Uninstall all but one of these distributions, or choose the entry points to load "
            f"with {ALLOW_ENV}=name,name"
        )


@dataclass
class _Tables:
    """What the hooks registered: ``parts[kind][name] = (object, source)`` for the names that resolve,
    ``conflicts[kind][name] = [source, ...]`` for those registered more than once."""

    parts: dict[str, dict[str, tuple[Any, Source]]] = field(default_factory=lambda: {k: {} for k in KINDS})
    conflicts: dict[str, dict[str, list[Source]]] = field(default_factory=lambda: {k: {} for k in KINDS})

    def add(self, kind: str, name: str, obj: Any, source: Source) -> None:
        """Register ``name``; a name already present becomes a conflict and no longer resolves."""
        if name in self.conflicts[kind]:
            self.conflicts[kind][name].append(source)
        elif name in self.parts[kind]:
            self.conflicts[kind][name] = [self.parts[kind].pop(name)[1], source]
        else:
            self.parts[kind][name] = (obj, source)


_manager: pluggy.PluginManager | None = None
_tables: _Tables | None = None
_sources: dict[str, Source] = {}
_autoloaded = False
#: held while the plugin manager, the entry points or the tables change: threads that make their first lookup
#: together wait for one of them to load the entry points and build the tables (re-entrant: a plugin's import
#: may look a name up)
_lock = threading.RLock()


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager (built-ins registered on first use; entry points are loaded
    on the first lookup through :func:`names`, :func:`get` or :func:`entries`)."""
    global _manager
    with _lock:
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
    with _lock:
        registered = plugin_manager().register(plugin, name=name)
        if registered is not None:
            _sources[registered] = Source(registered, None, "registered at run time")
        _tables = None


def unregister(plugin: object) -> None:
    """Remove a plugin registered with :func:`register`."""
    global _tables
    with _lock:
        pm = plugin_manager()
        name = pm.get_name(plugin)
        pm.unregister(plugin)
        _sources.pop(name or "", None)
        _tables = None


def reset() -> None:
    """Forget every plugin and table; the next lookup starts afresh (re-reading the environment)."""
    global _manager, _tables, _autoloaded
    with _lock:
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
    with _lock:
        return _load_entry_points()


def _load_entry_points() -> int:
    """:func:`load_entry_points`, with the registry's lock held."""
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
                stacklevel=3,
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
                stacklevel=3,
            )
    _tables = None
    return count


def _show(value: object) -> str:
    """A short description of a returned value for messages: its (shortened) repr and its type."""
    return f"{reprlib.repr(value)} ({type(value).__name__})"


#: the class every registered part of a kind subclasses, by module (imported when a part is checked: the registry
#: imports no part's module, so every module may look names up here)
_BASES = {
    "policies": "kvpolicy.policies.base:Policy", "actions": "kvpolicy.actions.base:Action",
    "transforms": "kvpolicy.transforms.base:Transform", "formats": "kvpolicy.formats.base:Format",
    "codecs": "kvpolicy.persist:Codec", "backends": "kvpolicy.backends.base:Backend",
    "model_presets": "kvpolicy.model_presets:ModelPreset",
}  # fmt: skip


def _base_class(kind: str) -> type:
    """The class every registered object of ``kind`` (not ``presets`` or ``commands``) must subclass (for
    ``model_presets``: be an instance of). Imported by name: the modules of the kinds import the registry."""
    module, _, name = _BASES[kind].partition(":")
    return getattr(importlib.import_module(module), name)


def _part_problem(kind: str, obj: object, owner: str | None = None) -> str | None:
    """What is wrong with ``obj`` as a registered object of ``kind``, or ``None`` if it is acceptable (``owner``:
    the top-level package of the plugin registering it, which a model preset's file must be in)."""
    if kind == "model_presets":  # data, not code: checked here in full, never imported by name
        return _base_class(kind).problem_of(obj, owner)
    if isinstance(obj, str) and re.fullmatch(r"[\w.]+:\w+", obj):
        return None  # a part named by its module, checked when first looked up (_resolved)
    if kind == "presets":
        if callable(obj):
            return None
        return f"{_show(obj)} is not callable; a preset is a function returning CompressedCache keyword arguments"
    if kind == "commands":
        if callable(obj):
            return None
        return f"{_show(obj)} is not callable; a command is a function register(subparsers) adding its parser"
    base = _base_class(kind)
    expected = f"a subclass of {base.__module__}.{base.__qualname__}"
    if not isinstance(obj, type):
        return f"{_show(obj)} is not a class; expected {expected}"
    if not issubclass(obj, base):
        return f"class {obj.__module__}.{obj.__qualname__} is not {expected}"
    return None


def _problems(kind: str, returned: object, owner: str | None = None) -> list[str]:
    """Everything wrong with what the hook ``kvpolicy_register_{kind}`` returned (empty if nothing)."""
    hook = f"kvpolicy_register_{kind}"
    if not isinstance(returned, Mapping):
        return [f"{hook} returned {_show(returned)}, not a dict {{name: {_EXPECTED[kind]}}}"]
    problems = []
    for name, obj in returned.items():
        if not isinstance(name, str) or not name:
            problems.append(f"{hook} returned the name {_show(name)}; a name must be a non-empty string")
            continue
        problem = _part_problem(kind, obj, owner)
        if problem is not None:
            problems.append(f"{hook} returned {name!r}: {problem}")
    return problems


def _skip(plugin_name: str, source: Source, problems: list[str]) -> None:
    """Warn that the plugin ``plugin_name`` is skipped, naming it, its distribution and every problem."""
    warnings.warn(
        f"kvpolicy plugin {plugin_name!r} from {source} is skipped, none of its names is registered: "
        + "; ".join(problems),
        PluginWarning,
        stacklevel=6,  # _skip, _call_hooks, _build_tables, _collect, the public lookup, its caller
    )


def _call_hooks(
    plugin_name: str, impls: dict[str, Any], source: Source, owner: str | None = None
) -> dict[str, Mapping[str, Any]] | None:
    """Call one plugin's hooks and check what they return (``owner``: the plugin's top-level package).

    Returns
    -------
    dict or None
        ``{kind: {name: object}}``, or ``None`` when a hook raised or returned something malformed
        (the plugin was then skipped with a :class:`PluginWarning`).

    Raises
    ------
    Exception
        For the built-in plugin, whose failure is a bug in kvpolicy: the hook's own exception, or
        ``TypeError`` listing the malformed returns.
    """
    returned: dict[str, Any] = {}
    for kind, impl in impls.items():
        try:
            returned[kind] = impl.function()
        except Exception as exc:
            if plugin_name == _BUILTIN_PLUGIN:
                raise
            _skip(plugin_name, source, [f"its hook kvpolicy_register_{kind} raised {type(exc).__name__}: {exc}"])
            return None
    problems = [problem for kind, value in returned.items() for problem in _problems(kind, value, owner)]
    if not problems:
        return returned
    if plugin_name == _BUILTIN_PLUGIN:
        raise TypeError(f"kvpolicy's built-in registrations are malformed: {'; '.join(problems)}")
    _skip(plugin_name, source, problems)
    return None


def _collect() -> _Tables:
    tables = _tables
    if tables is not None:  # built already: no lock on the path of every lookup
        return tables
    with _lock:
        return _build_tables()


def _build_tables() -> _Tables:
    """The tables of every registered plugin, built once (with the registry's lock held) until a change of
    plugins drops them."""
    global _tables
    if _tables is not None:  # another thread built them while this one waited for the lock
        return _tables
    _load_entry_points()
    pm = plugin_manager()
    impls: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        for impl in getattr(pm.hook, f"kvpolicy_register_{kind}").get_hookimpls():
            impls.setdefault(impl.plugin_name, {})[kind] = impl
    tables = _Tables()
    for plugin_name, plugin in pm.list_name_plugin():  # registration order
        if plugin is None or plugin_name not in impls:  # blocked, or implements no hook
            continue
        source = _sources.get(plugin_name, Source(plugin_name, None, "registered at run time"))
        provided = _call_hooks(plugin_name, impls[plugin_name], source, _owner(plugin))
        for kind, parts in (provided or {}).items():
            for name, obj in parts.items():
                tables.add(kind, name, obj, source)
    _tables = tables
    return tables


def _owner(plugin: object) -> str:
    """The top-level package of a plugin object (a module, or an instance or class defined in one)."""
    module = plugin.__name__ if inspect.ismodule(plugin) else getattr(plugin, "__module__", None)
    if module is None:
        module = type(plugin).__module__
    return str(module).partition(".")[0]


def _check_kind(kind: object) -> str:
    """``kind`` itself when it is one of :data:`KINDS`; a :class:`~kvpolicy.errors.ConfigError` otherwise."""
    if kind not in KINDS:
        raise ConfigError(f"kind must be one of {list(KINDS)}; got kind={kind!r}")
    return str(kind)


def names(kind: str) -> list[str]:
    """Registered names of ``kind`` (one of :data:`KINDS`),
    sorted; a name in conflict (see :func:`conflicts`) is listed, though looking it up is an error."""
    kind = _check_kind(kind)
    tables = _collect()
    return sorted({*tables.parts[kind], *tables.conflicts[kind]})


def entries(kind: str) -> list[tuple[str, Any, Source]]:
    """``(name, object, source)`` for every name of ``kind`` that resolves, sorted by name (a name in
    conflict has no single object: see :func:`conflicts`)."""
    kind = _check_kind(kind)
    table = _collect().parts[kind]
    return [(name, _resolved(table, kind, name), table[name][1]) for name in sorted(table)]


def provider(kind: str, name: str) -> str | None:
    """The distribution that registers ``name`` of ``kind`` (``None``: none does, or several)."""
    found = _collect().parts[_check_kind(kind)].get(name)
    return None if found is None else found[1].distribution


def conflicts(kind: str | None = None) -> list[Conflict]:
    """The names registered more than once.

    Parameters
    ----------
    kind : str or None
        One of :data:`KINDS`, or ``None`` for every kind.

    Returns
    -------
    list of Conflict
        In :data:`KINDS` order, then by name. Looking one of these names up raises the
        :class:`~kvpolicy.errors.ConfigError` of :meth:`Conflict.error`; every other name resolves.
    """
    kinds = KINDS if kind is None else (_check_kind(kind),)
    tables = _collect()
    return [Conflict(k, name, tuple(sources)) for k in kinds for name, sources in sorted(tables.conflicts[k].items())]


def get(kind: str, name: str) -> Any:
    """Look up ``name``; unknown names raise an error listing the registered ones, a name registered
    more than once an error naming every distribution that registers it."""
    kind = _check_kind(kind)
    tables = _collect()
    if isinstance(name, str) and name in tables.conflicts[kind]:
        raise Conflict(kind, name, tuple(tables.conflicts[kind][name])).error()
    table = tables.parts[kind]
    if not isinstance(name, str) or name not in table:
        hint = did_you_mean(name, names(kind)) if isinstance(name, str) else ""
        plugin = MOVED.get(kind, {}).get(name) if isinstance(name, str) else None
        hint += f" ({plugin})" if plugin else ""
        raise ConfigError(f"unknown {_SINGULAR[kind]} {name!r}; registered {kind}: {names(kind)}{hint}")
    return _resolved(table, kind, name)


def _resolved(table: dict[str, tuple[Any, Source]], kind: str, name: str) -> Any:
    """The object registered as ``name``, a ``"module:Class"`` reference imported (once) and checked."""
    obj, source = table[name]
    if not isinstance(obj, str):
        return obj
    module, _, attr = obj.partition(":")
    try:
        resolved = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"{_SINGULAR[kind]} {name!r} of {source} names {obj!r}, which cannot be imported: {exc}"
        ) from None
    problem = "a name, not a class" if isinstance(resolved, str) else _part_problem(kind, resolved)
    if problem is not None:
        raise ConfigError(f"{_SINGULAR[kind]} {name!r} of {source}: {problem}")
    table[name] = (resolved, source)
    return resolved
