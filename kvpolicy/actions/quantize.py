"""The ``"quantize"`` action: demoted tokens are quantized once, when demoted, and never again.

A :class:`Quantize` action holds one format spec per role (:attr:`Quantize.keys`, :attr:`Quantize.values`,
:mod:`kvpolicy.formats`); each format owns its options, their defaults and what a backend must serve. The flat
keywords (``bits``, ``key_bits``, ``group_size``, ``scheme``...) are shortcuts that name a format's option for one
role or both (:data:`SHORTCUTS`); :func:`role_formats` builds the specs from them, in one place.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvpolicy import formats, state_check
from kvpolicy.actions.base import Action, DemotedStore
from kvpolicy.backends.base import Backend, QTensor, check_metadata, widen_remedy
from kvpolicy.derived import Derived
from kvpolicy.errors import ConfigError, MetadataOverflowError, NonFiniteError
from kvpolicy.formats.base import Format
from kvpolicy.layer.parts import Part
from kvpolicy.positions import POSITION_DTYPE

#: code width when neither ``bits`` nor a role's own width is given
DEFAULT_BITS = 2
#: the format when no scheme is given
DEFAULT_SCHEME = "minmax"
#: role field -> the prefix of its own shortcut keywords
ROLES = {"keys": "key", "values": "value"}
#: a format's option -> the shortcut keywords naming it: for both roles, the keys' own, the values' own
SHORTCUTS: dict[str, tuple[str | None, str | None, str | None]] = {
    "bits": ("bits", "key_bits", "value_bits"), "group_size": ("group_size", "key_group_size", "value_group_size"),
    "axis": (None, "key_axis", "value_axis"), "fit": ("fit", "key_fit", "value_fit"),
    "centre": (None, "key_centre", None), "norm_bits": ("norm_bits", None, None),
    "meta_dtype": ("meta_dtype", None, None),
}  # fmt: skip
#: the keywords naming each role's format
SCHEME = ("scheme", "key_scheme", "value_scheme")
KEYWORDS = (*SCHEME, *(kw for names in SHORTCUTS.values() for kw in names if kw is not None))
#: options a role's own keyword may give for a format that has none (compositions saved with every role's axis)
IGNORED = ("axis",)


@dataclass(frozen=True, eq=False, init=False)
class Quantize(Action):
    """Quantize demoted tokens: keys and values each to a format (:mod:`kvpolicy.formats`).

    ``Quantize(keys=MinMax(bits=3, group_size=128, axis="channel", fit="mse"), values=Codebook(bits=2))``
    gives each role's format whole; the flat keywords are shortcuts that build the same specs
    (``Quantize(key_bits=3, key_fit="mse", value_scheme="codebook")`` is the action above), with the
    defaults each format gives the options they leave out. A role given whole takes no shortcut of its own
    (``keys=`` with ``key_bits=`` is an error), and the shared shortcuts (``bits``, ``scheme``...) then
    apply to the other role alone. A shortcut given for both roles sets the option in each format that has
    it (``group_size`` with codebook keys and min-max values groups the values), and is an error where
    neither has it; a role's own keyword is an error where its format lacks the option (an axis excepted:
    a format without groups ignores it).

    Parameters
    ----------
    keys, values : Format, optional
        The format of keys and of values (:class:`~kvpolicy.formats.MinMax`,
        :class:`~kvpolicy.formats.Codebook` or a format a plugin registers), exactly as given: none of
        the defaults below is applied to it, and :meth:`serving` never changes it.
    bits, key_bits, value_bits : int, optional
        Code width of both roles, of keys, of values (default 2; keys usually need more, see
        docs/explanation/quantization.md). Which widths exist depends on the format and the backend
        (``torch``: 2, 3, 4, 8); a pair of widths the backend lacks is refused with the pairs it has.
    scheme, key_scheme, value_scheme : str or Format class, optional
        The format of both roles, of keys, of values, by its registered name (``"minmax"``, the default;
        ``"codebook"``; a plugin's) or its class. ``"codebook"``: one scale per token and head plus
        ``bits``-bit Lloyd-Max indices (:mod:`kvpolicy.formats.codebook`; ``bits + 16 / head_dim`` bits per
        element, no zero-point); it assumes rotated, near-Gaussian coordinates, so a cache refuses it
        without a rotation (``transform="hadamard"``).
    group_size, key_group_size, value_group_size : int, optional
        Min-max groups: elements sharing one scale and minimum (``"token"`` axis: channels of one token,
        dividing ``head_dim``; ``"channel"`` axis: tokens of one channel). Default by axis,
        :data:`~kvpolicy.formats.packed.DEFAULT_GROUP_SIZE`: 128 tokens per channel, 64 channels per
        token; a default per-token group that does not divide the head dim becomes the largest one below
        it that does (:meth:`serving`; the cache's ``repr`` shows it), a size given is never changed. When
        both roles are grouped per channel, one size must divide the other.
    key_axis, value_axis : {"channel", "token"}, optional
        Min-max grouping axis; default KIVI's (keys per channel, values per token): on SmolLM2-135M at
        2 bits with the log policy, per-token keys raise next-token loss far more than per-channel keys.
        Per-channel tokens wait in a full-precision staging buffer until a group of them is demoted.
    fit, key_fit, value_fit : {"minmax", "mse"}, optional
        How min-max groups choose their range: the extremes (``"minmax"``: every element within half a step)
        or the range of least squared error (``"mse"``; same bytes, same kernels). Default: ``"mse"`` for
        keys, ``"minmax"`` for values: fitting both cuts SmolLM2-135M's KL with 2-bit keys but raises it with
        3- or 4-bit keys, the values being what lose (docs/explanation/quantization.md, "Fitted ranges"). On
        a backend that does not fit ranges (``quanto``, ``hqq``) the keys' default becomes ``"minmax"``
        (:meth:`serving`), while ``"mse"`` given is refused.
    key_centre : bool, optional
        Codebook keys: quantize each key around the mean of the first keys the layer demotes, stored once
        and shared by every later key, so the codebook spends its cells on how keys differ
        (:mod:`kvpolicy.formats.codebook`; measured in docs/explanation/quantization.md). Values are
        never centred.
    norm_bits : {16, 8}, optional
        Codebook roles: the bits of each vector's scale (default 16, the metadata dtype; 8: a one-byte
        log-scale code, :mod:`kvpolicy.formats.scale_codes`).
    meta_dtype : {"auto", "float16", "bfloat16", "float32"}, optional
        The dtype of scales and minimums; default ``"auto"``: ``bfloat16`` for ``bfloat16`` inputs,
        ``float16`` otherwise. float16 holds magnitudes up to 65504 only: float32 keys or values beyond it
        raise :class:`~kvpolicy.errors.MetadataOverflowError` whatever ``check_finite`` says, and
        ``"float32"`` or ``"bfloat16"`` store them. Which values a backend accepts:
        ``Backend.capabilities.meta_dtypes``.
    check_finite : bool
        Raise :class:`~kvpolicy.errors.NonFiniteError` if NaN or Inf reaches the quantizer, or comes
        out of it in the stored metadata (one reduction over the demoted tokens and one over their
        scales and minimums; switch off for speed once a model is known good).
    defaulted : sequence of str, optional
        Which options of the role formats the defaults filled (``"keys.fit"``...): the only ones
        :meth:`serving` may replace. Computed from the shortcuts; given only when the formats are (a saved
        spec, :func:`dataclasses.replace`).

    Attributes
    ----------
    keys, values : Format
        Each role's format, the defaults filled in.
    """

    keys: Format = field(default=None)  # type: ignore[assignment]
    values: Format = field(default=None)  # type: ignore[assignment]
    check_finite: bool = True
    defaulted: tuple[str, ...] = field(default=(), repr=False)

    name: ClassVar[str] = "quantize"
    #: ``keys`` and ``values`` given as ``{"name": ..., **params}`` tables (a preset file) are built by
    #: ``CacheSpec.resolve``, which also looks the scheme keywords' names up in the registry
    part_parameters: ClassVar[dict[str, str]] = {"keys": "formats", "values": "formats"}
    name_parameters: ClassVar[dict[str, str]] = dict.fromkeys(SCHEME, "formats")

    def __init__(
        self, bits: int | None = None, group_size: int | None = None, key_axis: str | None = None,
        value_axis: str | None = None, check_finite: bool = True, meta_dtype: str | None = None,
        key_group_size: int | None = None, value_group_size: int | None = None, key_bits: int | None = None,
        value_bits: int | None = None, scheme: str | type[Format] | None = None,
        key_scheme: str | type[Format] | None = None, value_scheme: str | type[Format] | None = None,
        key_centre: bool | None = None, fit: str | None = None, key_fit: str | None = None,
        value_fit: str | None = None, norm_bits: int | None = None, *, keys: Format | None = None,
        values: Format | None = None, defaulted: tuple[str, ...] | list[str] | None = None,
    ) -> None:  # fmt: skip
        given = {name: value for name, value in locals().items() if name in KEYWORDS and value is not None}
        if given.get("key_centre") is False:
            del given["key_centre"]  # the old default, written by saved specs of older versions
        if not isinstance(check_finite, bool):
            raise ConfigError(f"Quantize: check_finite must be a bool; got check_finite={check_finite!r}")
        built, filled = role_formats(given, {"keys": keys, "values": values})
        if defaulted is not None:
            filled = _checked_defaulted(defaulted, built)
        kf, vf = built["keys"], built["values"]
        if vf.centre:
            raise ConfigError(
                f"Quantize: values={vf!r} is centred; only keys are (the fused path adds a key centre to the "
                "scores, and has no term for a value centre). Use centre=False for the values"
            )
        if kf.grouped and vf.grouped and kf.axis == vf.axis == "channel" and max(
            kf.group_size, vf.group_size
        ) % min(kf.group_size, vf.group_size):  # fmt: skip
            raise ConfigError(
                f"Quantize: keys and values both grouped per channel need one group size to divide the other "
                f"(tokens are read back in whole groups of both); got key_group_size={kf.group_size}, "
                f"value_group_size={vf.group_size}"
            )
        object.__setattr__(self, "keys", kf)
        object.__setattr__(self, "values", vf)
        object.__setattr__(self, "check_finite", check_finite)
        object.__setattr__(self, "defaulted", tuple(sorted(filled)))
        #: the shortcut keywords given, so that errors name the parameter the caller wrote (not compared, not saved)
        object.__setattr__(self, "_given", frozenset(given))

    def _derived(self, keys: Format, values: Format, defaulted: tuple[str, ...]) -> Quantize:
        """An action of these formats that names parameters in errors as this one does."""
        out = Quantize(keys=keys, values=values, check_finite=self.check_finite, defaulted=defaulted)
        object.__setattr__(out, "_given", self._given)
        return out

    def _param(self, kind: str, option: str) -> str:
        """The parameter that set ``kind``'s ``option`` as the caller wrote it: the kind's own, the shorthand,
        or the kind's own marked ``(default)`` when the defaults set it."""
        own = f"{kind}_{option}"
        if own not in self._given and option in self._given:
            return option
        return own + (" (default)" if own not in self._given and f"{kind}s.{option}" in self.defaulted else "")

    # ------------------------------------------------------------------ reading
    def roles(self) -> tuple[tuple[str, Format], tuple[str, Format]]:
        """``(("key", keys format), ("value", values format))``."""
        return (("key", self.keys), ("value", self.values))

    def _canonical(self) -> tuple:
        return (self.keys, self.values, self.check_finite)

    def __eq__(self, other: object) -> bool:
        # equal when they quantize alike: Quantize() == Quantize(key_group_size=128, value_group_size=64)
        return isinstance(other, Quantize) and self._canonical() == other._canonical()

    def __hash__(self) -> int:
        return hash(("quantize", *self._canonical()))

    def __repr__(self) -> str:
        shown = self._shortcut_form()
        if shown is None:
            return f"Quantize(keys={self.keys!r}, values={self.values!r}, check_finite={self.check_finite!r})"
        return f"Quantize({', '.join(f'{k}={v!r}' for k, v in shown)})"

    def _shortcut_form(self) -> list[tuple[str, Any]] | None:
        """The shortcut keywords, in the repr's order, that build an action equal to this one (``None``: none
        do, e.g. keys and values with different metadata dtypes, or a format with an option no keyword names).

        Widths first; for two min-max roles the group sizes and axes in effect (one ``group_size`` when they
        agree), otherwise the scheme(s), each grouped role's group size and axis, and every other option off
        its default; ``meta_dtype`` when set; fits other than ``"minmax"``, and a ``"minmax"`` fit too where the
        keywords shown would otherwise build the default fit in its place."""
        k, v = self.keys, self.values
        out: list[tuple[str, Any]] = []
        out += [("bits", k.bits)] if k.bits == v.bits else [("key_bits", k.bits), ("value_bits", v.bits)]
        if k.name == v.name == DEFAULT_SCHEME:
            if k.group_size == v.group_size:
                out.append(("group_size", k.group_size))
            else:
                out += [("key_group_size", k.group_size), ("value_group_size", v.group_size)]
            out += [("key_axis", k.axis), ("value_axis", v.axis)]
        else:
            out += [("scheme", k.name)] if k.name == v.name else [("key_scheme", k.name), ("value_scheme", v.name)]
            for kind, fmt in self.roles():
                if fmt.grouped:
                    out += [(f"{kind}_group_size", fmt.group_size), (f"{kind}_axis", fmt.axis)]
            extra: dict[str, Any] = {}
            for i, (_, fmt) in enumerate(self.roles()):
                for f in dataclasses.fields(fmt):  # type: ignore[arg-type]
                    value = getattr(fmt, f.name)
                    if f.name in SHORTCUTS and f.name not in ("bits", "group_size", "axis", "fit", "meta_dtype"):
                        if value == f.default:
                            continue
                        keyword = SHORTCUTS[f.name][1 + i] or SHORTCUTS[f.name][0]
                        if keyword is None or extra.setdefault(keyword, value) != value:
                            return None
                    elif f.name not in SHORTCUTS:
                        return None  # an option no keyword names
            out += list(extra.items())
        out.append(("check_finite", self.check_finite))
        if k.meta_dtype != "auto":
            out.append(("meta_dtype", k.meta_dtype))
        if k.fit == v.fit:
            out += [] if k.fit == "minmax" else [("fit", k.fit)]
        else:
            out += [(f"{kind}_fit", fmt.fit) for kind, fmt in self.roles() if fmt.fit != "minmax"]
        classes = {k.name: type(k), v.name: type(v)}
        kwargs = {key: classes[val] if key.endswith("scheme") else val for key, val in out}
        plain = [
            (f"{kind}_fit", "minmax") for kind, fmt in self.roles() if fmt.fit == "minmax" and "fit" in fmt.options()
        ]
        # the fewest min-max fits named first: none, each role's alone, then both
        for extra_fits in [[], *([p] for p in plain), *([plain] if len(plain) > 1 else [])]:
            try:
                rebuilt = Quantize(**kwargs, **dict(extra_fits))
            except (ConfigError, TypeError, ValueError):
                continue
            if rebuilt == self:
                return out + extra_fits
        return None

    # ------------------------------------------------------------------ the Action hooks
    def check_backend(self, backend: Backend) -> None:
        """Each role's format served by ``backend`` (:meth:`Backend.check_format`), and a pair of widths it serves."""
        for kind, fmt in self.roles():
            backend.check_format(fmt, kind)
        k, v = self.keys, self.values
        caps = backend.capabilities
        pairs = caps.bit_pairs if caps.bit_pairs is not None else tuple(itertools.product(caps.bits, caps.bits))
        if k.grouped and v.grouped and k.bits != v.bits and (k.bits, v.bits) not in pairs:
            raise ConfigError(
                f"backend {backend.name!r} does not support key_bits={k.bits}, value_bits={v.bits}; "
                f"it supports (key_bits, value_bits) in {[tuple(p) for p in pairs]}"
            )

    def serving(
        self, backend: Backend, key_dim: int | None = None, value_dim: int | None = None
    ) -> tuple[Quantize, tuple[str, ...]]:
        """Each role format's :meth:`~kvpolicy.formats.base.Format.serving`: the options :attr:`defaulted` names
        that ``backend`` or the head dims cannot serve replaced (a format given whole, or an option given as a
        shortcut, never is): e.g. min-max keys' default fit ``"mse"`` on a backend without it (``quanto``,
        ``hqq``) by ``key_fit="minmax"``, a default per-token group size that does not divide the head dim
        by the largest that does (head_dim 48: 48, 80: 40, 96: 48)."""
        new, left, notes = {}, set(self.defaulted), []
        for (role, kind), dim in zip(ROLES.items(), (key_dim, value_dim), strict=True):
            mine = tuple(d.partition(".")[2] for d in self.defaulted if d.startswith(f"{role}."))
            new[role], replaced, said = getattr(self, role).serving(backend, kind, dim, mine)
            left -= {f"{role}.{option}" for option in replaced}
            notes += said
        if not notes:
            return self, ()
        return self._derived(new["keys"], new["values"], tuple(left)), tuple(notes)

    def with_widths(self, key_bits: int, value_bits: int) -> Quantize:
        """This action with keys of ``key_bits`` and values of ``value_bits`` bits (a layer's own widths)."""
        keys, values = dataclasses.replace(self.keys, bits=key_bits), dataclasses.replace(self.values, bits=value_bits)
        return self._derived(keys, values, self.defaulted)

    def check_transform(self, transform: Any) -> None:
        """A format that assumes rotated data (``needs_rotation``, e.g. the codebook) refuses the identity transform."""
        kinds = [(kind, fmt) for kind, fmt in self.roles() if fmt.needs_rotation]
        if kinds and getattr(transform, "identity", False):
            raise ConfigError(
                f"Quantize: scheme={kinds[0][1].name!r} for the {' and '.join(k for k, _ in kinds)}s assumes rotated "
                "coordinates (close to Gaussian, which its codes are built for); without a rotation the few "
                "outlier channels of keys take whole cells. Pass transform='hadamard', or use scheme='minmax'; got "
                f"transform={transform.name!r}"
            )

    def check_head_dim(self, head_dim: int, multiple: int = 4, role: str | None = None) -> None:
        """Per-token groups split each token's channels: ``group_size`` must divide ``head_dim``; a format
        without groups needs a multiple of its ``head_dim_multiple``.

        ``multiple`` is the backend's group-size granularity, used to suggest valid sizes. ``role``
        (``"key"`` or ``"value"``) checks that tensor kind's axis only (models whose keys and values
        have different head dims); ``None`` checks both.
        """
        for kind, fmt in self.roles():
            if role not in (None, kind):
                continue
            if not fmt.grouped:
                if head_dim % fmt.head_dim_multiple:
                    raise ConfigError(
                        f"Quantize: {kind}s with scheme={fmt.name!r} need a head_dim that is a multiple of "
                        f"{fmt.head_dim_multiple} (their codes pack into whole bytes); got head_dim={head_dim}"
                    )
                continue
            if fmt.axis != "token" or head_dim % fmt.group_size == 0:
                continue
            divisors = [g for g in range(multiple, head_dim + 1, multiple) if head_dim % g == 0]
            what = f"the {role} head_dim" if role else "head_dim"
            raise ConfigError(
                f"Quantize: {self._param(kind, 'group_size')}={fmt.group_size} does not divide {what}={head_dim} "
                f"(per-token groups split each token's channels); choose one of {divisors}"
            )

    def new_store(self, backend: Backend, layer_idx: int) -> QuantizedStore:
        return QuantizedStore(self, backend, layer_idx)


def role_formats(given: dict[str, Any], whole: dict[str, Format | None]) -> tuple[dict[str, Format], set[str]]:
    """The formats of keys and values that ``Quantize``'s shortcut keywords ``given`` describe (a role in
    ``whole`` given as its format), and the options their defaults filled (``"keys.fit"``...).

    Raises
    ------
    ConfigError
        Naming the keyword: a shortcut contradicting the one for both roles, a role given whole and by
        keywords, an option its format lacks (or a shared one neither format has), a value a format refuses.
    """
    for role, fmt in whole.items():
        if fmt is not None and not isinstance(fmt, Format):
            raise ConfigError(
                f"Quantize: {role} must be a format spec (kvpolicy.formats.MinMax(...), Codebook(...)); got "
                f"{role}={fmt!r}"
            )
        own = sorted(p for p in given if p.startswith(f"{ROLES[role]}_"))
        if fmt is not None and own:
            raise ConfigError(
                f"Quantize: {role}={fmt!r} gives the {ROLES[role]}s' format whole; {own} would set it again. Give "
                f"{role}= alone, or the {ROLES[role]}_* keywords"
            )
    shared = sorted(p for p in given if not p.startswith(("key_", "value_")))
    if None not in whole.values() and shared:
        raise ConfigError(
            f"Quantize: keys= and values= give both formats whole, so {shared} would apply to neither; drop "
            f"{' and '.join(shared)}, or set them inside the formats"
        )
    classes = {param: _scheme_class(param, given[param]) for param in SCHEME if param in given}
    for both, *each in [SCHEME, *SHORTCUTS.values()]:
        for param in each:
            if both in given and param in given:
                a, b = (classes[both], classes[param]) if both == "scheme" else (given[both], given[param])
                if a != b:
                    raise ConfigError(
                        f"Quantize: {both}={given[both]!r} (the shorthand for both) contradicts "
                        f"{param}={given[param]!r}; give {both} alone, or {' and '.join(p for p in each if p)}"
                    )
    built: dict[str, Format] = {}
    filled: set[str] = set()
    unused: dict[str, int] = {}  # shared keyword -> how many roles' formats lack its option
    for i, (role, kind) in enumerate(ROLES.items()):
        if whole[role] is not None:
            built[role] = whole[role]  # type: ignore[assignment]
            continue
        cls = classes.get(SCHEME[1 + i]) or classes.get("scheme") or formats.MinMax
        options: dict[str, Any] = {}
        params: list[str] = []
        for option, names in SHORTCUTS.items():
            param = next((p for p in (names[1 + i], names[0]) if p is not None and p in given), None)
            if param is None:
                continue
            if option in cls.options():
                options[option] = given[param]
                params.append(f"{param}={given[param]!r}")
            elif param == names[0]:
                unused[param] = unused.get(param, 0) + 1
            elif option not in IGNORED:
                raise ConfigError(
                    f"Quantize: {param}={given[param]!r} does not apply to {kind}s in format {cls.name!r}, whose "
                    f"options are {list(cls.options())}"
                )
        options.setdefault("bits", DEFAULT_BITS)
        try:
            built[role], defaults = cls.for_role(kind, options)
        except ConfigError as exc:
            refused = ", ".join(params)
            raise ConfigError(f"Quantize: the {kind}s' format {cls.name!r} refuses {refused}: {exc}") from None
        filled |= {f"{role}.{option}" for option in defaults}
    neither = sorted(p for p, n in unused.items() if n == sum(fmt is None for fmt in whole.values()))
    if neither:
        raise ConfigError(
            f"Quantize: {neither[0]}={given[neither[0]]!r} applies to neither role: keys in format "
            f"{built['keys'].name!r} and values in {built['values'].name!r} have no option {neither[0]!r}; drop it, "
            "or use a format that has it"
        )
    return built, filled


def _scheme_class(param: str, value: object) -> type[Format]:
    """The format class a scheme keyword names: a registered format's name, or a :class:`Format` class."""
    if isinstance(value, type) and issubclass(value, Format):
        return value
    return formats.named(value, param)  # type: ignore[arg-type]


def _checked_defaulted(defaulted: object, built: dict[str, Format]) -> set[str]:
    """The ``defaulted`` given (a saved spec's), each entry an option its role's format may default."""
    allowed = {f"{role}.{option}" for role, kind in ROLES.items()
               for option in type(built[role]).for_role(kind, {"bits": built[role].bits})[1]}  # fmt: skip
    if isinstance(defaulted, str) or not isinstance(defaulted, (tuple, list)):
        raise ConfigError(f"Quantize: defaulted must be a list of {sorted(allowed)}; got {defaulted!r}")
    unknown = [d for d in defaulted if d not in allowed]
    if unknown:
        raise ConfigError(f"Quantize: defaulted names {unknown}; it may name {sorted(allowed)}")
    return set(defaulted)


class QuantizedStream:
    """Append-only quantized storage of one tensor kind (keys or values) of one layer.

    Tokens are quantized in the order they are appended, to the stream's format :attr:`fmt`, which
    ``backend.quantize`` is handed with every block. With ``axis="channel"`` they first wait in
    ``staging`` (full precision) until a whole group of ``group_size`` tokens is there. A stream whose
    format has no groups (codebook) quantizes every token on arrival (``axis="token"``, no ``group_size``).
    """

    def __init__(self, backend: Backend, fmt: Format) -> None:
        self.backend = backend
        #: what this stream stores: the format spec every block is quantized to
        self.fmt = fmt
        self.bits = fmt.bits
        self.scheme = fmt.name
        self.centre = fmt.centre
        self.group_size = fmt.group_size if fmt.grouped else None
        self.axis = fmt.axis if fmt.grouped else "token"
        self.q: QTensor | None = None
        self.staging: torch.Tensor | None = None
        #: ``centre``: the float32 centre ``(batch, kv_heads, 1, head_dim)`` the first block is to be
        #: quantized around, when set before it arrives (:meth:`QuantizedStore.take_first_block` sets the
        #: mean of the first block an unsplit demotion would have made); ``None`` otherwise, and
        #: again once the first block is held (the block holds its centre: :attr:`stream_centre`)
        self.first_centre: torch.Tensor | None = None
        self._proposed_centre: torch.Tensor | None = None

    def append(self, x: torch.Tensor) -> None:
        """Append ``x``: ``(batch, kv_heads, n, head_dim)``."""
        self.commit(*self.prepare(x))

    def prepare(self, x: torch.Tensor) -> tuple[QTensor | None, torch.Tensor | None]:
        """Quantize what appending ``x`` makes ready, without changing the stream.

        Returns
        -------
        block : QTensor or None
            The newly quantized tokens (``None`` when a per-channel group is not complete yet).
        staging : torch.Tensor or None
            The staging buffer after the append, ``(batch, kv_heads, n_staged, head_dim)``.
        """
        if self.axis == "token":
            return self._quantize(x), self.staging
        staged = x if self.staging is None else torch.cat([self.staging, x], dim=2)
        ready = staged.shape[2] - staged.shape[2] % self.group_size
        block = self._quantize(staged[:, :, :ready].contiguous()) if ready else None
        return block, staged[:, :, ready:].contiguous() if ready < staged.shape[2] else None

    def commit(self, block: QTensor | None, staging: torch.Tensor | None) -> None:
        """Store what :meth:`prepare` returned."""
        if block is not None:
            self.q = block if self.q is None else self.backend.cat([self.q, block])
            # the held block now carries the centre (rounded to the metadata dtype, as every later block
            # is quantized around): the float32 one is dropped, so nbytes() counts every byte held
            self.first_centre = self._proposed_centre = None
        self.staging = staging

    @property
    def stream_centre(self) -> torch.Tensor | None:
        """The centre every block of this stream is quantized around, ``(batch, kv_heads, 1, head_dim)``:
        the held block's (in the metadata dtype) once there is one, else the one set for the first
        block (:attr:`first_centre`, float32), else ``None``."""
        if self.q is not None:
            return self.q.centre  # type: ignore[attr-defined]
        return self.first_centre

    def _quantize(self, x: torch.Tensor) -> QTensor:
        centre = None
        if self.centre:
            # the first block's mean, then that block's stored centre for every later block: a stream
            # holds one centre, so its blocks concatenate
            centre = None if self.q is None else self.q.centre  # type: ignore[attr-defined]
            if centre is None:
                centre = self.first_centre if self.first_centre is not None else x.float().mean(dim=2, keepdim=True)
                self._proposed_centre = centre
            return self.backend.quantize(x, self.fmt, centre=centre)
        return self.backend.quantize(x, self.fmt)

    def read(self) -> torch.Tensor:
        """All held tokens in append order, ``(batch, kv_heads, n, head_dim)``."""
        return self.read_from(0)

    def read_from(self, start: int) -> torch.Tensor:
        """Tokens ``[start, n)`` at full precision (dequantized and staged), ``(batch, kv_heads, n - start, head_dim)``.

        ``start`` must be a group boundary of a per-channel stream's quantized part (see :meth:`QTensor.narrow`).
        """
        parts = []
        n = 0 if self.q is None else self.q.shape[2]
        if start < n:
            block = self.q if start == 0 else self.q.narrow(start, n - start)
            parts.append(self.backend.dequantize(block))
        if self.staging is not None:
            parts.append(self.staging)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    @property
    def num_quantized(self) -> int:
        return 0 if self.q is None else self.q.num_tokens

    def nbytes(self) -> dict[str, int]:
        out = dict.fromkeys(("codes", "scales", "zeros", "staging"), 0)  # a centre adds its own role
        if self.q is not None:
            for role, n in self.q.nbytes().items():
                out[role] = out.get(role, 0) + n
        if self.staging is not None:
            out["staging"] = self.staging.numel() * self.staging.element_size()
        return out

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-axis (dim 0) operation to every per-row tensor: the block, the staging buffer and a
        centre set for (or proposed by) a first block not held yet."""
        if self.q is not None:
            self.q = self.q.map_batch(fn)
        if self.staging is not None:
            self.staging = fn(self.staging)
        if self.first_centre is not None:
            self.first_centre = fn(self.first_centre)
        if self._proposed_centre is not None:
            self._proposed_centre = fn(self._proposed_centre)

    def state_dict(self) -> dict[str, Any]:
        block = None if self.q is None else self.backend.block_state(self.q)
        return {
            "bits": self.bits, "group_size": self.group_size, "axis": self.axis, "scheme": self.scheme, "q": block,
            "staging": self.staging,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state_check.entries(state, "stream", ("bits", "group_size", "axis", "q", "staging"), ("scheme",))
        saved = (state["bits"], state["group_size"], state["axis"], state.get("scheme", DEFAULT_SCHEME))
        mine = (self.bits, self.group_size, self.axis, self.scheme)
        if saved != mine or any(type(a) is not type(b) for a, b in zip(saved, mine, strict=True)):
            raise ValueError(
                f"a stream saved with (bits, group_size, axis, scheme)={saved!r:.80} cannot load into one configured "
                f"with {mine}"
            )
        block = state["q"]
        if block is not None:
            block = self.backend.load_block(state_check.entries(block, "block", block), self.fmt)
        self.q = block
        self.staging = None if state["staging"] is None else state_check.tensor(state["staging"], "staging")

    def validate(self, like: torch.Tensor) -> None:
        """Raise ``ValueError`` unless the restored block and staging buffer fit a layer whose
        full-precision tensors are shaped like ``like`` (``(batch, kv_heads, n, head_dim)``): the same
        batch, heads, head dim and dtype, metadata of the dtypes and layout this stream's own
        quantization gives, finite metadata, and a staging buffer holding less than one group."""
        b, h, _, d = like.shape
        if self.q is not None:
            q = self.q
            reference = self._reference_block(like)
            if type(q) is not type(reference) or q.bits != reference.bits:
                raise ValueError(f"block: a {type(q).__name__} of {q.bits} bits where this stream holds {reference}")
            if (q.shape[0], q.shape[1], q.shape[3]) != (b, h, d) or q.dtype != like.dtype:
                raise ValueError(
                    f"block of shape {tuple(q.shape)} and dtype {q.dtype} in a layer of {(b, h, '*', d)} {like.dtype}"
                )
            mine, theirs = reference.tensors(), q.tensors()
            if set(mine) != set(theirs) or any(mine[r].dtype != theirs[r].dtype for r in mine):
                got = {r: str(t.dtype) for r, t in theirs.items()}
                want = {r: str(t.dtype) for r, t in mine.items()}
                raise ValueError(f"block tensors {got}; this stream's quantization gives {want}")
            for role, t in theirs.items():
                state_check.finite(t, f"block {role}")
        if self.staging is not None:
            most = 1 if self.axis == "token" else self.group_size
            state_check.tensor(self.staging, "staging", like.dtype, (b, h, None, d))
            if self.axis == "token" or self.staging.shape[2] >= most:
                raise ValueError(
                    f"staging holds {self.staging.shape[2]} tokens; a {self.axis}-grouped stream stages fewer than "
                    f"{most if self.axis == 'channel' else 1}"
                )

    def _reference_block(self, like: torch.Tensor) -> QTensor:
        """What quantizing one group of zeros shaped like ``like`` gives (the block type, bits and metadata dtypes)."""
        b, h, _, d = like.shape
        zeros = like.new_zeros((b, h, self.group_size if self.axis == "channel" else 1, d))
        held, self.q = self.q, None
        try:
            return self._quantize(zeros)
        finally:
            self.q = held

    @property
    def num_staged(self) -> int:
        return 0 if self.staging is None else self.staging.shape[2]


class QuantizedStore(DemotedStore):
    """Keys and values of demoted tokens, quantized once each, with their positions."""

    def __init__(self, action: Quantize, backend: Backend, layer_idx: int) -> None:
        self.action = action
        self.layer_idx = layer_idx
        self.k = QuantizedStream(backend, action.keys)
        self.v = QuantizedStream(backend, action.values)
        self.positions = torch.empty(1, 0, dtype=POSITION_DTYPE)
        #: what :meth:`parts` last built, with the objects it built them from
        self._parts: Derived | None = None

    def _check_finite(self, x: torch.Tensor, what: str) -> None:
        if not torch.isfinite(x).all():
            bad = int((~torch.isfinite(x)).sum())
            raise NonFiniteError(
                f"{bad} non-finite value(s) (NaN/Inf) in the {what} of layer {self.layer_idx} reached the "
                "quantizer; quantizing them would corrupt their whole group. Fix the model inputs/dtype "
                "(e.g. fp16 overflow), or pass check_finite=False to skip this check."
            )

    def _prepare(
        self, stream: QuantizedStream, x: torch.Tensor, what: str
    ) -> tuple[QTensor | None, torch.Tensor | None]:
        """:meth:`QuantizedStream.prepare`, the metadata checked when ``check_finite`` is on."""
        try:
            block, staging = stream.prepare(x)
        except MetadataOverflowError as exc:
            raise MetadataOverflowError(f"{what} of layer {self.layer_idx}: {exc}") from None
        if block is not None and self.action.check_finite:
            # whatever the backend checks itself: finite input (checked in add) must not come back as
            # non-finite scales or minimums
            meta = {role: t for role, t in block.tensors().items() if t.is_floating_point()}
            if meta and not bool(torch.isfinite(torch.cat([t.reshape(-1) for t in meta.values()])).all()):
                narrowest = min((t.dtype for t in meta.values()), key=lambda d: torch.finfo(d).max)
                remedy = widen_remedy(narrowest, stream.backend.capabilities.meta_dtypes)
                quantized = x if stream.staging is None else torch.cat([stream.staging, x], dim=2)
                try:
                    check_metadata(stream.backend.name, quantized, meta, remedy)
                except MetadataOverflowError as exc:
                    raise MetadataOverflowError(f"{what} of layer {self.layer_idx}: {exc}") from None
        return block, staging

    def add(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        if self.action.check_finite:
            self._check_finite(keys, "keys")
            self._check_finite(values, "values")
        # both quantized before either is stored: an error leaves the store as it was
        k = self._prepare(self.k, keys, "keys")
        v = self._prepare(self.v, values, "values")
        self.k.commit(*k)
        self.v.commit(*v)
        self.positions = torch.cat([self.positions.to(positions.device), positions], dim=1)

    def keys(self) -> torch.Tensor:
        return self.k.read()

    def values(self) -> torch.Tensor:
        return self.v.read()

    def parts(self) -> list[Part]:
        """The stored tokens for fused attention without materialising them (:mod:`kvpolicy.layer.parts`).

        Returns
        -------
        list of Part
            The tokens after the first ``m`` at full precision (staged, or dequantized when the other
            stream still stages them; ``(batch, kv_heads, n - m, head_dim)``, fewer than ``group_size``
            tokens), then keys and values of the first ``m`` stored tokens, both quantized (``m`` = the
            smaller quantized count of the two streams). Either may be absent. The parts are kept
            (:class:`~kvpolicy.derived.Derived`) and given again until a stream's block or staging buffer or
            the positions are replaced: the dequantized tail, fewer tokens than one key group, is held between
            decode steps instead of being decoded at each.
        """
        # this runs at every fused decode step: the parts are built again only when what they are built from
        # was replaced since (a demotion, a batch move, a load; every change replaces these objects)
        k, v = self.k, self.v
        kq, vq, positions = k.q, v.q, self.positions
        built = self._parts
        if built is not None:
            was = built.sources
            if (
                was[0] is kq and was[1] is vq and was[2] is k.staging and was[3] is v.staging and was[4] is positions
                and was[5] is k.backend
            ):  # fmt: skip
                return list(built.value)
        nk, nv = (0 if kq is None else kq.shape[2]), (0 if vq is None else vq.shape[2])
        m = min(nk, nv)
        out: list[Part] = []
        if positions.shape[-1] != m:
            # a stream whose quantized tokens all lie before m holds the tail in its staging buffer alone
            keys = k.staging if nk == m and k.staging is not None else k.read_from(m)
            values = v.staging if nv == m and v.staging is not None else v.read_from(m)
            out.append(Part(keys, values, None, positions[:, m:]))
        if m:
            quantized = (kq if nk == m else kq.narrow(0, m), vq if nv == m else vq.narrow(0, m))
            out.append(Part(*quantized, k.backend, positions[:, :m]))
        self._parts = Derived((kq, vq, k.staging, v.staging, positions, k.backend), tuple(out))
        return out

    def awaits_first_block(self) -> bool:
        """Whether a centred stream holds nothing and was given no centre yet."""
        return any(s.centre and s.q is None and s.first_centre is None for s in (self.k, self.v))

    def take_first_block(self, probe: DemotedStore) -> None:
        """Each centred stream that holds nothing yet takes the centre ``probe``'s stream (a
        :class:`QuantizedStore` of the same action) set from its first block."""
        for mine, theirs in zip((self.k, self.v), (probe.k, probe.v), strict=True):  # type: ignore[attr-defined]
            if mine.centre and mine.q is None and theirs.stream_centre is not None:
                mine.first_centre = theirs.stream_centre

    def staged_key_positions(self) -> torch.Tensor:
        """Positions whose keys still wait in the full-precision staging buffer."""
        return self.positions[:, self.k.num_quantized :]

    def staged_value_positions(self) -> torch.Tensor:
        """Positions whose values still wait in the full-precision staging buffer."""
        return self.positions[:, self.v.num_quantized :]

    def nbytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for stream in (self.k, self.v):
            for role, n in stream.nbytes().items():
                out[role] = out.get(role, 0) + n
        out["positions"] = self.positions.numel() * self.positions.element_size()
        return out

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.k.map_batch(fn)
        self.v.map_batch(fn)

    def state_dict(self) -> dict[str, Any]:
        return {"keys": self.k.state_dict(), "values": self.v.state_dict(), "positions": self.positions}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state_check.entries(state, "store", ("keys", "values", "positions"))
        self.k.load_state_dict(state["keys"])
        self.v.load_state_dict(state["values"])
        self.positions = state_check.tensor(state["positions"], "store positions", POSITION_DTYPE, (None, None))

    def validate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        for name, stream, like in (("keys", self.k, keys), ("values", self.v, values)):
            try:
                stream.validate(like)
            except ValueError as exc:
                raise ValueError(f"the {name} stream: {exc}") from None
            held = stream.num_quantized + stream.num_staged
            if held != len(self):
                raise ValueError(f"the {name} stream holds {held} tokens for {len(self)} positions")
