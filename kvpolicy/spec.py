"""The spec of a cache: where every name becomes a part, once.

- :class:`CacheSpec` is the composition: policy, action, transform, backend (``None``: ``"auto"``),
  layout, attention and per-layer widths. It is frozen and JSON-able (:meth:`CacheSpec.to_dict`,
  :meth:`CacheSpec.from_dict`), and the registry is the allowlist of what a dict may name.
- :meth:`CacheSpec.resolve` turns the keywords of :class:`~kvpolicy.CompressedCache` into parts;
  :meth:`CacheSpec.from_preset` and :meth:`CacheSpec.from_file` do the same for a preset and a
  preset file.

Nothing here touches tensors or transformers: :class:`~kvpolicy.CompressedCache` binds a spec to a
model's config as one :class:`~kvpolicy.layer.composition.Composition`, and its layers decide their
backend and decode path at their first update (:func:`kvpolicy.layer.composition.plan`, which is also
what ``backend="auto"`` stands for: :func:`~kvpolicy.layer.composition.choose_backend`).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpolicy import layer_bits as per_layer
from kvpolicy import registry, state_check
from kvpolicy.actions.base import Action
from kvpolicy.backends.base import Backend
from kvpolicy.errors import CacheFileError, ConfigError
from kvpolicy.formats.base import Format
from kvpolicy.policies.base import Policy
from kvpolicy.policies.sinks import Sinks
from kvpolicy.transforms.base import NoTransform, Transform

#: ``backend="auto"``: :func:`~kvpolicy.layer.composition.choose_backend` picks the backend for the device
AUTO = "auto"
LAYOUTS = ("ordered", "agnostic")
#: how a decode step's attention reads the compressed segment (see :mod:`kvpolicy.fused`)
ATTENTION = ("auto", "fused", "materialized")
#: what :meth:`CacheSpec.to_dict` records as its type and version
TYPE = "kvpolicy.CacheSpec"
VERSION = 1

#: role -> (registry kind, base class)
ROLES: dict[str, tuple[str, type]] = {
    "policy": ("policies", Policy),
    "action": ("actions", Action),
    "backend": ("backends", Backend),
    "transform": ("transforms", Transform),
}
#: the roles a part's parameter may hold a part of (nested in the saved form): the spec's, and a format
NESTED_ROLES: dict[str, tuple[str, type]] = {**ROLES, "format": ("formats", Format)}
#: the entries of a dict :meth:`CacheSpec.to_dict` writes (``layer_bits``, ``type``, ``version``: optional,
#: absent from files written before the spec had them)
DICT_KEYS = ("policy", "action", "backend", "transform", "backend_auto", "layout", "attention")


@dataclass(frozen=True, eq=False)
class CacheSpec:
    """A cache's composition, with every name resolved to a part.

    Parameters
    ----------
    policy : Policy
        Which tokens stay at full precision.
    action : Action
        What happens to the others.
    transform : Transform
        The change of basis of demoted tokens (default: none).
    backend : Backend or None
        How bits are packed; ``None`` for ``"auto"`` (:func:`~kvpolicy.layer.composition.choose_backend` picks one
        for the device).
    layout : {"ordered", "agnostic"}
        The order in which keys are handed to attention (see :class:`~kvpolicy.CompressedCache`).
    attention : {"auto", "fused", "materialized"}
        How decode steps read the compressed history.
    layer_bits : tuple of (int, (int, int))
        ``(layer index, (key_bits, value_bits))`` pairs of the layers whose widths differ from the
        action's, in the order given; a mapping is accepted and normalised.

    Examples
    --------
    >>> spec = CacheSpec.resolve(policy="log", window=16, bits=2)
    >>> spec.policy
    LogWindow(window=16)
    >>> CacheSpec.from_dict(spec.to_dict()) == spec
    True
    """

    policy: Policy
    action: Action
    transform: Transform = field(default_factory=NoTransform)
    backend: Backend | None = None
    layout: str = "ordered"
    attention: str = "auto"
    layer_bits: tuple[tuple[int, tuple[int, int]], ...] = ()

    def __post_init__(self) -> None:
        for role, (kind, base) in ROLES.items():
            value = getattr(self, role)
            if not isinstance(value, base) and not (role == "backend" and value is None):
                raise ConfigError(
                    f"CacheSpec: {role} must be a {base.__name__} object; got {role}={value!r:.80} (names become "
                    f"parts in CacheSpec.resolve; registered {kind}: {registry.names(kind)})"
                )
        if self.layout not in LAYOUTS:
            raise ConfigError(f"layout must be one of {list(LAYOUTS)}; got layout={self.layout!r}")
        if self.attention not in ATTENTION:
            raise ConfigError(f"attention must be one of {list(ATTENTION)}; got attention={self.attention!r}")
        given = self.layer_bits
        if isinstance(given, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in given):
            given = dict(given)  # the pairs this class holds
        widths = per_layer.normalize(given)
        if widths and not self.action.compresses:
            raise ConfigError(f"layer_bits sets code widths; action {self.action.name!r} compresses nothing")
        object.__setattr__(self, "layer_bits", tuple(widths.items()))

    def _key(self) -> tuple:
        """What equality compares: backends are equal when they are of one class with equal parameters."""
        backend = None if self.backend is None else (type(self.backend), _part(self.backend, "backend")["params"])
        return (self.policy, self.action, self.transform, repr(backend), self.layout, self.attention, self.layer_bits)

    def __eq__(self, other: object) -> bool:
        return self._key() == other._key() if isinstance(other, CacheSpec) else NotImplemented

    def __hash__(self) -> int:
        return hash(self._key())

    @property
    def widths(self) -> dict[int, tuple[int, int]]:
        """:attr:`layer_bits` as ``{layer index: (key_bits, value_bits)}``."""
        return dict(self.layer_bits)

    # ------------------------------------------------------------------ names to parts
    @classmethod
    def resolve(
        cls,
        policy: str | Policy = "log",
        action: str | Action = "quantize",
        backend: str | Backend = AUTO,
        layout: str = "ordered",
        attention: str = "auto",
        transform: str | Transform = "none",
        layer_bits: Mapping[Any, Any] | None = None,
        **params: Any,
    ) -> CacheSpec:
        """The spec of ``CompressedCache(**keywords)``: names looked up in the registry, each keyword of
        ``params`` given to the named part that accepts it.

        ``sinks=S`` with a policy that has no ``sinks`` parameter wraps it in
        :class:`~kvpolicy.policies.Sinks`. A parameter a part declares as a part of its own
        (:attr:`Action.part_parameters`, e.g. a :class:`~kvpolicy.actions.tiered.Tiered` action's
        ``keep``) may be given as ``{"name": ..., **params}`` dicts.

        Raises
        ------
        ConfigError
            An unknown name; a keyword accepted by two named parts, by none, or also set inside a
            given object; a bad layout, attention or ``layer_bits``.
        """
        params = dict(params)  # never mutate the caller's dict
        auto = isinstance(backend, str) and backend == AUTO
        sinks = _sinks_keyword(policy, params)
        # with "auto" the torch backend stands in while keywords are handed out (it takes none)
        named = {"policy": policy, "action": action, "backend": "torch" if auto else backend, "transform": transform}
        parts = _compose(named, params)
        return cls(
            policy=parts["policy"] if sinks is None else Sinks(parts["policy"], sinks),
            action=parts["action"],
            transform=parts["transform"],
            backend=None if auto else parts["backend"],
            layout=layout,
            attention=attention,
            layer_bits=layer_bits if layer_bits is not None else {},
        )

    @classmethod
    def from_preset(cls, name: str | Path, **overrides: Any) -> CacheSpec:
        """The spec of a preset: a registered preset (``"logquant"``, ``"kvpolicy-3bit"``...), a preset file
        shipped with kvpolicy (``"smollm2-8k-2.5bit"``) or a preset file's path, as
        :func:`kvpolicy.preset_source.resolve` finds it.

        ``overrides`` that are parameters of a registered preset's function go to it (e.g. ``budget=128``);
        the rest are cache keywords (e.g. ``layout="agnostic"``, ``backend="torch"``) and replace what the
        preset gives.

        Raises
        ------
        ConfigError
            An unknown name (with the closest known one), a bad preset file (naming it and the problem), or
            bad overrides.
        """
        from kvpolicy import preset_source

        return cls.from_source(preset_source.resolve(name), **overrides)

    @classmethod
    def from_source(cls, source: Any, **overrides: Any) -> CacheSpec:
        """The spec of a :class:`~kvpolicy.preset_source.PresetSource` with ``overrides``: a registered preset's
        own parameters or cache keywords for a preset, cache keywords on top of the ``[cache]`` table for a file.

        Raises
        ------
        ConfigError
            A bad file (naming it and the problem) or bad overrides.
        """
        from kvpolicy import preset_source

        if source.kind == "preset":
            return cls.from_registered_preset(source.name, **overrides)
        return cls.from_table(preset_source.read_table(source), str(source), **overrides)

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> CacheSpec:
        """The spec of a preset file: the ``[cache]`` table of a TOML file (what ``kvpolicy tune``
        writes), ``overrides`` on top. ``path`` is a file's path or any name :meth:`from_preset` takes
        (a shipped preset file's, a registered preset's).

        Raises
        ------
        ConfigError
            If the file cannot be read or parsed, has no ``[cache]`` table, or its keywords are bad (the
            message names the file).
        """
        return cls.from_preset(path, **overrides)

    @classmethod
    def from_registered_preset(cls, name: str, **overrides: Any) -> CacheSpec:
        """The spec of the registered preset ``name`` (see :meth:`from_preset`)."""
        fn = registry.get("presets", name)
        accepted = set(inspect.signature(fn).parameters)
        own = {k: v for k, v in overrides.items() if k in accepted}
        try:
            keywords = fn(**own)
        except TypeError as exc:  # pragma: no cover - defensive
            raise ConfigError(f"preset {name!r}: {exc}") from exc
        if isinstance(keywords, CacheSpec):
            keywords = keywords.keywords()
        rest = {k: v for k, v in overrides.items() if k not in accepted}
        try:
            return cls.resolve(**{**keywords, **rest})
        except ConfigError as exc:
            if not str(exc).startswith("unknown keyword(s)"):
                raise
            close = {k: difflib.get_close_matches(k, sorted(accepted), n=1) for k in sorted(rest)}
            hint = ", ".join(f"{m[0]!r} for {k!r}" for k, m in close.items() if m)
            raise ConfigError(
                f"{exc}; preset {name!r} itself takes {sorted(accepted)}" + (f"; did you mean {hint}?" if hint else "")
            ) from None

    @classmethod
    def from_table(cls, table: Mapping[str, Any], where: str, **overrides: Any) -> CacheSpec:
        """The spec of a preset file's ``[cache]`` table (untrusted data), ``overrides`` on top.

        Raises
        ------
        ConfigError
            Whatever is wrong with the table's keywords, prefixed with ``where`` (the file).
        """
        keywords = {**table, **overrides}
        try:
            return cls.resolve(**keywords)
        except (ConfigError, TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as exc:
            message = " ".join(str(exc).split())
            message = message if len(message) <= 400 else message[:400] + "..."
            raise ConfigError(
                f"{where}: its [cache] table is not a composition kvpolicy can build: {message}"
            ) from None

    def keywords(self) -> dict[str, Any]:
        """The keywords of :meth:`resolve` (and of :class:`~kvpolicy.CompressedCache`) that build this spec."""
        return {
            "policy": self.policy, "action": self.action, "transform": self.transform,
            "backend": AUTO if self.backend is None else self.backend, "layout": self.layout,
            "attention": self.attention, "layer_bits": self.widths,
        }  # fmt: skip

    # ------------------------------------------------------------------ the saved form
    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict: each part's registered name and dataclass parameters (a parameter that is
        itself a part nested as ``{"part": {"role", "name", "params"}}``), the other settings, and this
        format's ``type`` and ``version``. Equal specs give equal dicts; :meth:`from_dict` reads it back.

        Raises
        ------
        TypeError
            A part has a parameter that is not a JSON value (nor a part, nor a list of them).
        """
        out: dict[str, Any] = {"type": TYPE, "version": VERSION}
        for role in ROLES:
            value = getattr(self, role)
            out[role] = None if value is None else _part(value, role)
        out.update(backend_auto=self.backend is None, layout=self.layout, attention=self.attention)
        if self.layer_bits:
            out["layer_bits"] = {str(i): list(pair) for i, pair in self.layer_bits}
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = "the spec") -> CacheSpec:
        """The spec :meth:`to_dict` described, read as untrusted data: parts only from the registry.

        Also reads the composition of files written before the spec had a type and version (those
        recorded the backend ``"auto"`` chose beside ``backend_auto``; the choice is made again).

        Parameters
        ----------
        data : dict
            What :meth:`to_dict` returned (parsed JSON).
        where : str
            What the data came from (a file's path), for messages.

        Raises
        ------
        CacheFileError
            A part the registry does not know (``where`` was written where a plugin is installed that
            is not installed here), or another version of this format.
        ValueError, ConfigError
            Malformed data: a missing or extra entry, a value of the wrong type, bad parameters.
        """
        comp = state_check.entries(data, "composition", DICT_KEYS, ("layer_bits", "type", "version"))
        if "type" in comp and comp["type"] != TYPE:
            raise ValueError(f"composition: type is {comp['type']!r:.60}, not {TYPE!r}")
        if "version" in comp and comp["version"] != VERSION:
            raise CacheFileError(
                f"{where!r} holds a cache spec of version {comp['version']!r:.20}; this kvpolicy reads version "
                f"{VERSION} (save the cache again with the kvpolicy that will load it)"
            )
        auto = state_check.flag(comp["backend_auto"], "backend_auto")
        parts = {role: _rebuild(comp[role], role, where) for role in ROLES if not (role == "backend" and auto)}
        widths = comp.get("layer_bits", {})
        if not isinstance(widths, dict):
            raise ValueError(f"composition: layer_bits is a {type(widths).__name__}, not a mapping")
        pairs = {}
        for key, pair in widths.items():
            if not (isinstance(key, str) and key.isdecimal() and len(key) <= 6):
                raise ValueError(f"composition: layer_bits index {key!r:.20} is not a layer index")
            if not (isinstance(pair, list) and len(pair) == 2):
                raise ValueError(f"composition: layer_bits[{key!r}] is not a (key_bits, value_bits) pair")
            pairs[int(key)] = (state_check.integer(pair[0], "key_bits", 1, 16),
                               state_check.integer(pair[1], "value_bits", 1, 16))  # fmt: skip
        return cls(
            policy=parts["policy"], action=parts["action"], transform=parts["transform"],
            backend=None if auto else parts["backend"],
            layout=state_check.choice(comp["layout"], "layout", LAYOUTS),
            attention=state_check.choice(comp["attention"], "attention", ATTENTION),
            layer_bits=pairs,
        )  # fmt: skip


# ---------------------------------------------------------------------- composing
def parameter_names(obj_or_cls: Any) -> set[str]:
    """The keywords a part's constructor takes (a dataclass's fields, and any shortcuts its ``__init__`` adds)."""
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    if not dataclasses.is_dataclass(cls):
        return set()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {name for name, p in inspect.signature(cls).parameters.items() if p.kind in named}


def _sinks_keyword(policy: str | Policy, params: dict[str, Any]) -> int | None:
    """Take ``sinks`` out of ``params`` when it asks for :class:`~kvpolicy.policies.Sinks` around a policy
    that has no ``sinks`` parameter of its own (the ``"sink"`` policy keeps its own)."""
    if isinstance(policy, str) and registry.get("policies", policy) is Sinks:
        raise ConfigError(
            f"policy={policy!r} wraps another policy, so it cannot be named alone: pass the policy to wrap and "
            "sinks=S (policy='log', sinks=4), or the object (policy=Sinks(LogWindow(42), 4))"
        )
    if "sinks" not in params:
        return None
    cls = registry.get("policies", policy) if isinstance(policy, str) else type(policy)
    if "sinks" in parameter_names(cls):
        return None
    return params.pop("sinks")


def _compose(named: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """Turn names or objects into objects, giving each keyword of ``params`` to the named part that
    accepts it. A keyword accepted by two named parts, by no part, or also set inside a given object,
    is an error."""
    pool = dict(params)
    classes: dict[str, type] = {}
    for role, (kind, base) in ROLES.items():
        given = named[role]
        if isinstance(given, base):
            continue
        if not isinstance(given, str):
            raise ConfigError(
                f"{role} must be a registered name or a {base.__name__} object; got {role}={given!r} "
                f"(registered {kind}: {registry.names(kind)})"
            )
        classes[role] = registry.get(kind, given)
    owners: dict[str, list[str]] = {}
    for role, cls in classes.items():
        for key in parameter_names(cls) & set(pool):
            owners.setdefault(key, []).append(f"{role}={named[role]!r}")
    for key, roles in sorted(owners.items()):
        if len(roles) > 1:
            raise ConfigError(
                f"keyword {key}={pool[key]!r} is a parameter of {' and '.join(roles)}; "
                "pass those parts as objects to say which one it belongs to"
            )
    built: dict[str, Any] = {}
    for role, cls in classes.items():
        mine = {k: pool.pop(k) for k in sorted(parameter_names(cls) & set(pool))}
        try:
            built[role] = cls(**_nested_parts(cls, mine))
        except TypeError as exc:
            raise ConfigError(f"{role} {named[role]!r}: {exc}") from exc
    for role in ROLES:
        if role in built:
            continue
        given = named[role]
        clash = sorted(parameter_names(given) & set(pool))
        if clash:
            raise ConfigError(f"{clash} given both as keyword(s) and inside {role}={given!r}; give each parameter once")
        built[role] = given
    if pool:
        accepted = {role: sorted(parameter_names(obj)) for role, obj in built.items()}
        known = sorted({name for names in accepted.values() for name in names})
        close = {k: difflib.get_close_matches(k, known, n=1) for k in sorted(pool)}
        hint = ", ".join(f"{m[0]!r} for {k!r}" for k, m in close.items() if m)
        raise ConfigError(f"unknown keyword(s) {sorted(pool)} for this composition; accepted: {accepted}"
                          + (f"; did you mean {hint}?" if hint else ""))  # fmt: skip
    return built


def _nested_parts(cls: type, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with each ``{"name": ..., **params}`` dict of a parameter that ``cls`` declares as parts
    (``cls.part_parameters``: parameter -> registry kind), alone or in a list, built from the registry, and
    each name given for a parameter ``cls`` declares as naming a part (``cls.name_parameters``) replaced by
    the class registered under it."""
    out = dict(params)
    for key, kind in getattr(cls, "part_parameters", {}).items():
        value = out.get(key)
        if isinstance(value, (list, tuple)):
            out[key] = [_named_part(v, kind, f"{cls.__name__}: {key}[{i}]") for i, v in enumerate(value)]
        elif value is not None:
            out[key] = _named_part(value, kind, f"{cls.__name__}: {key}")
    for key, kind in getattr(cls, "name_parameters", {}).items():
        value = out.get(key)
        if isinstance(value, str):
            if value not in registry.names(kind):
                raise ConfigError(f"{cls.__name__}: {key} must be one of {registry.names(kind)}; got {key}={value!r}")
            out[key] = registry.get(kind, value)
    return out


def _named_part(value: Any, kind: str, where: str) -> Any:
    if not (isinstance(value, Mapping) and isinstance(value.get("name"), str)):
        return value  # an object (or a mistake the part's own checks name)
    params = {k: v for k, v in value.items() if k != "name"}
    try:
        return registry.get(kind, value["name"])(**params)
    except TypeError as exc:
        raise ConfigError(f"{where}={dict(value)!r}: {exc}") from None


# ---------------------------------------------------------------------- the saved form of a part
def _part(obj: Any, role: str) -> dict[str, Any]:
    """``{"name", "params"}`` of a part, with ``"from"``: the distribution that registers it when that is not
    kvpolicy (so that a file's reader without it is told what to install); a parameter that is itself a part,
    or a list of them, is nested as ``{"part": {"role", "name", "params"}}``."""
    params = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else {}
    out = {"name": obj.name, "params": {key: _encode(value, role, obj, key) for key, value in params.items()}}
    source = registry.provider(NESTED_ROLES[role][0], obj.name)
    if source not in (None, "kvpolicy"):
        out["from"] = source
    return out


def _encode(value: Any, role: str, owner: Any, key: str) -> Any:
    for kind_role, (_, base) in NESTED_ROLES.items():
        if isinstance(value, base):
            return {"part": {"role": kind_role, **_part(value, kind_role)}}
    if isinstance(value, (list, tuple)):
        return [_encode(v, role, owner, key) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{role} {owner.name!r}: parameter {key}={value!r} is not a JSON value; it cannot be saved")


def _decode(value: Any, role: str, where: str) -> Any:
    if isinstance(value, dict):
        nested = state_check.entries(value, "a nested part", ("part",))["part"]
        return _rebuild(nested, nested.get("role", role) if isinstance(nested, dict) else role, where)
    if isinstance(value, list):
        return [_decode(v, role, where) for v in value]
    return value


def _rebuild(data: Any, role: str, where: str) -> Any:
    """The part :func:`_part` described (nested parts first)."""
    state_check.entries(data, f"the {role}", ("name", "params"), ("role", "from"))
    kind = NESTED_ROLES[state_check.choice(role, "a part's role", NESTED_ROLES)][0]
    if not isinstance(data["name"], str) or not isinstance(data["params"], dict):
        raise ValueError(f"the {role}: a part is a name and a mapping of parameters")
    params = {key: _decode(value, role, where) for key, value in data["params"].items()}
    try:
        cls = registry.get(kind, data["name"])
    except ConfigError as exc:
        msg = f"{where!r} was saved with {role} {data['name']!r:.60}, which is not installed: {exc}"
        dist = data.get("from")
        if isinstance(dist, str) and dist.replace("-", "").replace("_", "").isalnum() and len(dist) <= 60:
            msg += f". The distribution {dist!r} registers it: install it (pip install {dist})"
        raise CacheFileError(msg) from None
    return cls(**params)
