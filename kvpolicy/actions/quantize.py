"""The ``"quantize"`` action: demoted tokens are quantized once, when demoted, and never again.

A :class:`Quantize` action holds one format spec per role (:attr:`Quantize.keys`, :attr:`Quantize.values`,
:mod:`kvpolicy.formats`); its flat keywords (``bits``, ``key_bits``, ``group_size``, ``scheme``...) are
shortcuts that build those specs, every default filled in one place (:meth:`Quantize.__init__`).
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
from kvpolicy.backends.base import AXES, FITS, META_DTYPES, Backend, QTensor, check_metadata, widen_remedy
from kvpolicy.errors import ConfigError, MetadataOverflowError, NonFiniteError
from kvpolicy.formats.base import Format
from kvpolicy.formats.codebook import check_norm_bits
from kvpolicy.layer.parts import Part
from kvpolicy.policies.base import check_int
from kvpolicy.positions import POSITION_DTYPE

#: group size by grouping axis when none is given: 128 tokens per channel, 64 channels per token;
#: docs/explanation/quantization.md measures the alternatives (with min-max key ranges, 64-token groups lose less
#: than 128-token ones; with fitted key ranges, the default, 128-token groups lose less than min-max
#: 64-token groups, and hold fewer bytes from about 4,000 tokens on)
DEFAULT_GROUP_SIZE = {"channel": 128, "token": 64}
#: how min-max key groups choose their range when neither ``fit`` nor ``key_fit`` is given (values:
#: ``"minmax"``); docs/explanation/quantization.md, "Fitted ranges"
DEFAULT_KEY_FIT = "mse"
#: code width when neither ``bits`` nor a per-kind width is given
DEFAULT_BITS = 2
#: the quantization scheme when none is given
DEFAULT_SCHEME = "minmax"
#: the grouping axis of each kind when none is given (KIVI's: keys per channel, values per token)
DEFAULT_AXIS = {"key": "channel", "value": "token"}
#: role field -> the prefix of its shortcut keywords
ROLES = {"keys": "key", "values": "value"}
#: shorthand keyword -> the per-kind keywords it stands for
SHORTHANDS = {
    "bits": ("key_bits", "value_bits"), "group_size": ("key_group_size", "value_group_size"),
    "scheme": ("key_scheme", "value_scheme"), "fit": ("key_fit", "value_fit"),
}  # fmt: skip
#: the role options Quantize's defaults may fill (not given by the caller): only these may :meth:`Quantize.serving`
#: replace
DEFAULTABLE = ("keys.fit", "keys.group_size", "values.group_size")


def _scheme_class(param: str, value: object) -> type[Format]:
    """The format class a scheme keyword names: a built-in format's name, or a :class:`Format` class."""
    if isinstance(value, type) and issubclass(value, Format):
        return value
    if isinstance(value, str) and value in formats.BUILTIN:
        return formats.BUILTIN[value]
    raise ConfigError(
        f"Quantize: {param} must be one of {list(formats.BUILTIN)} or a Format class; got {param}={value!r} (a "
        f"format a plugin registers is named through CompressedCache(..., {param}=NAME) or CacheSpec.resolve, "
        "which look it up in the registry; or pass its spec, keys=MyFormat(...))"
    )


@dataclass(frozen=True, eq=False, init=False)
class Quantize(Action):
    """Quantize demoted tokens: keys and values each to a format (:mod:`kvpolicy.formats`).

    ``Quantize(keys=MinMax(bits=3, group_size=128, axis="channel", fit="mse"), values=Codebook(bits=2))``
    gives each role's format whole; the flat keywords below are shortcuts that build the same specs
    (``Quantize(key_bits=3, key_fit="mse", value_scheme="codebook")`` is the action above), with the
    defaults of the parameters they leave out. A role given whole takes no shortcut of its own
    (``keys=`` with ``key_bits=`` is an error), and the shared shortcuts (``bits``, ``scheme``...) then
    apply to the other role alone.

    Parameters
    ----------
    keys, values : Format, optional
        The format of keys and of values (:class:`~kvpolicy.formats.MinMax`,
        :class:`~kvpolicy.formats.Codebook` or a format a plugin registers), exactly as given: none of
        the defaults below is applied to it, and :meth:`serving` never changes it.
    bits : int, optional
        Code width of keys and values alike (the shorthand for ``key_bits`` and ``value_bits``);
        default 2. Which widths exist depends on the backend (``torch``: 2, 3, 4, 8).
    group_size : int, optional
        Elements sharing one scale and minimum, for keys and values alike (the shorthand for
        ``key_group_size`` and ``value_group_size``). ``"token"`` axis: channels of one token
        (must divide ``head_dim``); ``"channel"`` axis: tokens of one channel. ``None``: each
        tensor kind's default by its axis, :data:`DEFAULT_GROUP_SIZE`: 128 tokens per channel (the
        keys' default axis), 64 channels per token (the values'). A default per-token group that does
        not divide the head dim becomes the largest one below it that does (:meth:`serving`; the
        cache's ``repr`` shows it); a group size given explicitly is never changed.
    key_group_size, value_group_size : int, optional
        The group size of keys or values alone. Given together with a different ``group_size``
        they are a :class:`~kvpolicy.errors.ConfigError`. When both kinds are grouped per channel,
        one size must divide the other (tokens are read back in whole groups of both).
    key_bits, value_bits : int, optional
        The code width of keys or values alone (keys usually need more: see docs/explanation/quantization.md).
        Given together with a different ``bits`` they are a :class:`~kvpolicy.errors.ConfigError`;
        a pair the backend lacks is refused with the pairs it has.
    key_axis, value_axis : {"channel", "token"}, optional
        Grouping axis of keys and values; defaults :data:`DEFAULT_AXIS`, KIVI's (keys per channel,
        values per token): on SmolLM2-135M at 2 bits with the log policy, per-token keys raise
        next-token loss far more than per-channel keys. Per-channel tokens wait in a full-precision
        staging buffer until ``group_size`` of them are demoted, then are quantized once, in demotion
        order. A kind whose format has no groups (codebook) ignores its axis.
    check_finite : bool
        Raise :class:`~kvpolicy.errors.NonFiniteError` if NaN or Inf reaches the quantizer, or comes
        out of it in the stored metadata (one reduction over the demoted tokens and one over their
        scales and minimums; switch off for speed once a model is known good).
    meta_dtype : {"auto", "float16", "bfloat16", "float32"}, optional
        The dtype of each group's scale and minimum; default ``"auto"``: the backend's default
        (``torch``, ``cpu``, ``triton``: ``bfloat16`` for ``bfloat16`` inputs, ``float16`` otherwise).
        float16 holds magnitudes up to 65504 only: float32 keys or values beyond it raise
        :class:`~kvpolicy.errors.MetadataOverflowError` whatever ``check_finite`` says, and
        ``"float32"`` (32 more bits per group) or ``"bfloat16"`` (same bytes, 8-bit significand)
        stores them. Which values a backend accepts: ``Backend.capabilities.meta_dtypes``.
    scheme : {"minmax", "codebook"} or Format class, optional
        How keys and values alike are quantized (the shorthand for ``key_scheme`` and
        ``value_scheme``); default ``"minmax"``. ``"codebook"``: one scale per token and head plus
        ``bits``-bit indices into the Lloyd-Max codebook of the standard normal distribution
        (:mod:`kvpolicy.formats.codebook`; ``bits + 16 / head_dim`` bits per element, no zero-point).
        It assumes rotated, near-Gaussian coordinates: a cache refuses it without a rotation
        (``transform="hadamard"``). Group size and axis do not apply to a codebook kind (giving a
        group size for it is an error); ``meta_dtype`` sets the dtype of its scales. Widths: 2, 3 or 4
        bits. A scheme names a format (:mod:`kvpolicy.formats`): built directly, ``Quantize`` takes the
        built-in names or a format class; through :class:`~kvpolicy.CompressedCache` or
        :meth:`~kvpolicy.spec.CacheSpec.resolve` the name of any format registered through the
        ``kvpolicy_register_formats`` hook is accepted too (its
        :meth:`~kvpolicy.formats.base.Format.from_options` builds it from these parameters).
    key_scheme, value_scheme : {"minmax", "codebook"} or Format class, optional
        The scheme of keys or values alone; contradicting ``scheme`` is a ConfigError.
    key_centre : bool, optional
        Codebook keys only: quantize each key minus a centre ``μ`` (per batch row and head), the mean
        of the first keys the layer demotes (usually the prompt's), stored once in the metadata dtype
        and shared by every later key, so the codebook spends its cells on how keys differ rather
        than on the offset they share. Costs ``head_dim`` metadata values per row, head and layer;
        the fused path reads it at no extra pass (:mod:`kvpolicy.formats.codebook`). Measured in
        docs/explanation/quantization.md. Needs keys in a centred format (``key_scheme="codebook"``)
        and a backend whose capabilities list ``codebook_centre`` (``torch``, ``cpu``, ``triton``). Any centre is
        exact (it is stored and added back); how much it helps depends on how well the first block
        stands for later keys: a left-padded row's mean includes its padding tokens' keys, and a first
        demotion of a few tokens gives a noisy mean. Values are never centred.
    norm_bits : {16, 8}, optional
        Codebook kinds only: the bits of each vector's scale (default 16, the metadata dtype). 8 stores
        a one-byte log-scale code (``bits + 8 / head_dim`` bits per element instead of
        ``bits + 16 / head_dim``): each scale within 0.54 % of its exact value for vectors within a
        factor 7.9 of the longest of their batch row and head, within 2.75 % down to a factor of about
        120; shorter ones are stored as zeros (:mod:`kvpolicy.formats.scale_codes`). Applies to every
        codebook kind (with a min-max kind beside it, to the codebook kind alone; with no codebook kind
        it is an error). Needs a backend whose capabilities list 8 in ``codebook_norm_bits``
        (``torch``, ``cpu``).
    fit : {"minmax", "mse"}, optional
        How each min-max group's range is chosen, for keys and values alike (the shorthand for
        ``key_fit`` and ``value_fit``). Default: ``"mse"`` for keys, ``"minmax"`` for values
        (:data:`DEFAULT_KEY_FIT`). ``"minmax"``: the group's extremes, so
        every element is within half a step of its code (KIVI, LogQuant, transformers' caches).
        ``"mse"``: the range of least squared error, found by a few rounds of alternating least
        squares from the min-max start; the extremes of a group may be clamped to the grid's ends,
        and a group keeps its min-max grid where that stores less error. Same bytes, same kernels.
        Fitting both kinds cuts SmolLM2-135M's next-token KL 1.9× with 2-bit keys and raises it
        1.7–2.2× with 3- or 4-bit keys (held-out texts): the values are what lose, so fit the keys
        alone (``key_fit``; docs/explanation/quantization.md, "Fitted ranges"). Applies to min-max
        kinds (codebook kinds ignore it: given with both kinds codebook it is an error); backends
        whose ``capabilities.fits`` list it: ``torch``, ``cpu``, ``triton``. On a backend without it
        (``quanto``, ``hqq``) the keys' default becomes ``"minmax"`` (:meth:`serving`; the cache's ``repr``
        shows it), while ``"mse"`` given explicitly is refused.
    key_fit, value_fit : {"minmax", "mse"}, optional
        The fit of keys or values alone; contradicting ``fit`` is a ConfigError. Default: keys
        ``"mse"``, values ``"minmax"``. Fitted values raise SmolLM2's KL 2.4× where fitted keys alone
        cut it 3.5× at 2 bits (calibration texts; docs/explanation/quantization.md).
    defaulted : sequence of str, optional
        Which options of the role formats the defaults filled (:data:`DEFAULTABLE`, e.g.
        ``"keys.fit"``): the only ones :meth:`serving` may replace. Computed from the shortcuts; given
        only when the formats are (a saved spec, :func:`dataclasses.replace`).

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
    name_parameters: ClassVar[dict[str, str]] = dict.fromkeys(("scheme", "key_scheme", "value_scheme"), "formats")

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
        given = {
            "bits": bits, "group_size": group_size, "key_axis": key_axis, "value_axis": value_axis,
            "meta_dtype": meta_dtype, "key_group_size": key_group_size, "value_group_size": value_group_size,
            "key_bits": key_bits, "value_bits": value_bits, "scheme": scheme, "key_scheme": key_scheme,
            "value_scheme": value_scheme, "key_centre": key_centre, "fit": fit, "key_fit": key_fit,
            "value_fit": value_fit, "norm_bits": norm_bits,
        }  # fmt: skip
        given = {name: value for name, value in given.items() if value is not None}
        if given.get("key_centre") is False:
            del given["key_centre"]  # the old default, written by saved specs of older versions
        if not isinstance(check_finite, bool):
            raise ConfigError(f"Quantize: check_finite must be a bool; got check_finite={check_finite!r}")
        whole = {"keys": keys, "values": values}
        for role, fmt in whole.items():
            if fmt is not None and not isinstance(fmt, Format):
                raise ConfigError(
                    f"Quantize: {role} must be a format spec (kvpolicy.formats.MinMax(...), Codebook(...)); "
                    f"got {role}={fmt!r}"
                )
        _check_shortcuts(given)
        for role, kind in ROLES.items():
            own = sorted(p for p in given if p.startswith(f"{kind}_"))
            if whole[role] is not None and own:
                raise ConfigError(
                    f"Quantize: {role}={whole[role]!r} gives the {kind}s' format whole; {own} would set it again. "
                    f"Give {role}= alone, or the {kind}_* keywords"
                )
        shared = sorted(p for p in given if not p.startswith(("key_", "value_")))
        if keys is not None and values is not None and shared:
            raise ConfigError(
                f"Quantize: keys= and values= give both formats whole, so {shared} would apply to neither; drop "
                f"{' and '.join(shared)}, or set them inside the formats"
            )
        classes = {role: type(whole[role]) if whole[role] is not None else _scheme_class(*_scheme(given, kind))
                   for role, kind in ROLES.items()}  # fmt: skip
        built: dict[str, Format] = {}
        filled: set[str] = set()
        for role, kind in ROLES.items():
            if whole[role] is not None:
                built[role] = whole[role]  # type: ignore[assignment]
                continue
            other = classes["values" if role == "keys" else "keys"]
            built[role] = _role_format(kind, classes[role], other, given, filled)
        if "norm_bits" in given and not any(_has_norm_bits(type(f)) for f in built.values()):
            raise ConfigError(
                f"Quantize: norm_bits={given['norm_bits']!r} sets the width of per-vector scales; neither kind is "
                f"quantized with scheme='codebook' or 'lattice' (keys: {built['keys'].name!r}, values: "
                f"{built['values'].name!r}). Pass scheme='codebook' or 'lattice', or drop norm_bits"
            )
        if defaulted is not None:
            if isinstance(defaulted, str) or not isinstance(defaulted, (tuple, list)):
                raise ConfigError(f"Quantize: defaulted must be a list of {list(DEFAULTABLE)}; got {defaulted!r}")
            unknown = [d for d in defaulted if d not in DEFAULTABLE]
            if unknown:
                raise ConfigError(f"Quantize: defaulted names {unknown}; it may name {list(DEFAULTABLE)}")
            filled = set(defaulted)
        if getattr(built["values"], "centre", False):
            raise ConfigError(
                f"Quantize: values={built['values']!r} is centred; only keys are (the fused path adds a key "
                "centre to the scores, and has no term for a value centre). Use centre=False for the values"
            )
        kf, vf = built["keys"], built["values"]
        if kf.grouped and vf.grouped and kf.axis == vf.axis == "channel":
            small, big = sorted((kf.group_size, vf.group_size))
            if big % small:
                raise ConfigError(
                    f"Quantize: keys and values both grouped per channel need one group size to divide the "
                    f"other (tokens are read back in whole groups of both); got key_group_size={kf.group_size}, "
                    f"value_group_size={vf.group_size}"
                )
        object.__setattr__(self, "keys", kf)
        object.__setattr__(self, "values", vf)
        object.__setattr__(self, "check_finite", check_finite)
        object.__setattr__(self, "defaulted", tuple(d for d in DEFAULTABLE if d in filled))
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
        # the shortcut form where the shortcuts build this action: the group sizes in effect, one
        # ``group_size`` when they agree; meta_dtype only
        # when set; the scheme only when a kind is not min-max (its group size and axis are then left out);
        # fit when it is not "minmax", or when it is and the default is not. Otherwise each role's format, whole.
        shown = self._shortcut_form()
        if shown is None:
            return f"Quantize(keys={self.keys!r}, values={self.values!r}, check_finite={self.check_finite!r})"
        return f"Quantize({', '.join(f'{k}={v!r}' for k, v in shown)})"

    def _shortcut_form(self) -> list[tuple[str, Any]] | None:
        """The shortcut keywords, in the repr's order, that build an action equal to this one (``None``:
        none do, e.g. keys and values with different metadata dtypes, or a format with parameters of its own)."""
        k, v = self.keys, self.values
        out: list[tuple[str, Any]] = []
        out += [("bits", k.bits)] if k.bits == v.bits else [("key_bits", k.bits), ("value_bits", v.bits)]
        if (k.name, v.name) == ("minmax", "minmax"):
            if k.group_size == v.group_size:
                out.append(("group_size", k.group_size))
            else:
                out += [("key_group_size", k.group_size), ("value_group_size", v.group_size)]
            out += [("key_axis", k.axis), ("value_axis", v.axis), ("check_finite", self.check_finite)]
        else:
            out += [("scheme", k.name)] if k.name == v.name else [("key_scheme", k.name), ("value_scheme", v.name)]
            for kind, fmt in self.roles():
                if fmt.grouped:
                    out += [(f"{kind}_group_size", fmt.group_size), (f"{kind}_axis", fmt.axis)]
            if k.centre:
                out.append(("key_centre", True))
            if any(getattr(f, "norm_bits", 16) != 16 for f in (k, v)):
                # the width off the default (a min-max role has none; two differing widths fail the check below)
                out.append(("norm_bits", next(f.norm_bits for f in (k, v) if getattr(f, "norm_bits", 16) != 16)))
            out.append(("check_finite", self.check_finite))
        if k.meta_dtype != "auto":
            out.append(("meta_dtype", k.meta_dtype))
        if k.fit == v.fit:
            out += [] if k.fit == "minmax" else [("fit", k.fit)]
        else:
            out += [(f"{kind}_fit", fmt.fit) for kind, fmt in self.roles() if fmt.fit != "minmax"]
        # a min-max fit is left out (as before fits existed) unless the keywords shown would build another
        # fit in its place (keys are fitted by default): then it is shown too, so the repr builds this action
        classes = {k.name: type(k), v.name: type(v)}
        kwargs = {key: classes[val] if key.endswith("scheme") else val for key, val in out}
        plain = [(f"{kind}_fit", fmt.fit) for kind, fmt in self.roles() if fmt.fit == "minmax"]
        # the fewest min-max fits named first: none, each role's alone, then both
        options = [[], *([p] for p in plain), *([plain] if len(plain) > 1 else [])]
        for extra in options:
            try:
                rebuilt = Quantize(**kwargs, **dict(extra))
            except (ConfigError, TypeError, ValueError):
                continue
            if rebuilt == self:
                return out + extra
        return None

    # ------------------------------------------------------------------ the Action hooks
    def check_backend(self, backend: Backend) -> None:
        caps = backend.capabilities
        mult = caps.group_size_multiple
        for kind, fmt in self.roles():
            if not fmt.grouped:
                backend.check_scheme(fmt.name, fmt.bits, role=kind)
        for kind, fmt in self.roles():
            norm = getattr(fmt, "norm_bits", 16)
            if norm not in caps.codebook_norm_bits:
                raise ConfigError(
                    f"backend {backend.name!r} does not read {fmt.name} {kind}s with norm_bits={norm}; it supports "
                    f"norm_bits in {list(caps.codebook_norm_bits)} (norm_bits=8: backends 'torch', 'cpu' and 'triton')"
                )
        if self.keys.centre and not caps.codebook_centre:
            raise ConfigError(
                f"backend {backend.name!r} does not store centred codebook blocks (key_centre=True); backends "
                "whose capabilities list codebook_centre do (torch, cpu, triton)"
            )
        for kind, fmt in self.roles():
            if fmt.grouped and fmt.group_size % mult:
                raise ConfigError(
                    f"backend {backend.name!r} needs group sizes that are multiples of {mult}; got "
                    f"{self._param(kind, 'group_size')}={fmt.group_size}"
                )
        k, v = self.keys, self.values
        pairs = caps.bit_pairs if caps.bit_pairs is not None else tuple(itertools.product(caps.bits, caps.bits))
        if k.grouped and v.grouped and k.bits != v.bits and (k.bits, v.bits) not in pairs:
            raise ConfigError(
                f"backend {backend.name!r} does not support key_bits={k.bits}, value_bits={v.bits}; "
                f"it supports (key_bits, value_bits) in {[tuple(p) for p in pairs]}"
            )
        for kind, fmt in self.roles():
            if fmt.grouped:
                backend.check(bits=fmt.bits, group_size=fmt.group_size, axis=fmt.axis, role=kind)
        for meta in dict.fromkeys((k.meta_dtype, v.meta_dtype)):
            backend.check_meta_dtype(meta)
        for kind, fmt in self.roles():
            if fmt.fit not in caps.fits:
                param = self._param(kind, "fit").removesuffix(" (default)")
                default = " (the default for min-max keys)" if f"{kind}s.fit" in self.defaulted else ""
                raise ConfigError(
                    f"backend {backend.name!r} does not fit min-max ranges with {param}={fmt.fit!r}{default}; it "
                    f"supports fit in {list(caps.fits)} (fit='mse': backends 'torch', 'cpu' and 'triton'). Pass "
                    f"{param}={caps.fits[0]!r} to use backend {backend.name!r}"
                )

    def serving(
        self, backend: Backend, key_dim: int | None = None, value_dim: int | None = None
    ) -> tuple[Quantize, tuple[str, ...]]:
        """Replace the defaults ``backend`` or the head dims cannot serve (see :meth:`Action.serving`).

        Only options :attr:`defaulted` names are replaced (a format given whole, or an option given as a
        shortcut, never is):

        - the keys' default fit (:data:`DEFAULT_KEY_FIT`, ``"mse"``) on a backend whose
          ``capabilities.fits`` lack it (``quanto``, ``hqq``): ``key_fit="minmax"``;
        - a per-token kind's default group size (64 channels for values) that does not divide its
          head dim: the largest divisor of the head dim below it that is a multiple of the backend's
          ``group_size_multiple`` (head_dim 48: 48, 80: 40, 96: 48), when one exists.
        """
        new = {"keys": self.keys, "values": self.values}
        left = set(self.defaulted)
        notes: list[str] = []
        fits = backend.capabilities.fits
        if "keys.fit" in left and self.keys.fit == DEFAULT_KEY_FIT and DEFAULT_KEY_FIT not in fits:
            new["keys"] = dataclasses.replace(self.keys, fit="minmax")
            left.discard("keys.fit")
            notes.append(
                f"key_fit='minmax' (backend {backend.name!r} does not fit ranges with the default {DEFAULT_KEY_FIT!r})"
            )
        mult = backend.capabilities.group_size_multiple
        for (role, kind), dim in zip(ROLES.items(), (key_dim, value_dim), strict=True):
            fmt = new[role]
            if (dim is None or f"{role}.group_size" not in left or not fmt.grouped or fmt.axis != "token"
                    or dim % fmt.group_size == 0):  # fmt: skip
                continue
            fitting = [g for g in range(mult, min(fmt.group_size, dim) + 1, mult) if dim % g == 0]
            if fitting:
                new[role] = dataclasses.replace(fmt, group_size=fitting[-1])
                left.discard(f"{role}.group_size")
                notes.append(
                    f"{kind}_group_size={fitting[-1]} (the default {fmt.group_size} does not divide the {kind} "
                    f"head_dim {dim})"
                )
        if not notes:
            return self, ()
        return self._derived(new["keys"], new["values"], tuple(left)), tuple(notes)

    def with_widths(self, key_bits: int, value_bits: int) -> Quantize:
        """This action with keys of ``key_bits`` and values of ``value_bits`` bits (a layer's own widths)."""
        keys, values = dataclasses.replace(self.keys, bits=key_bits), dataclasses.replace(self.values, bits=value_bits)
        return self._derived(keys, values, self.defaulted)

    def check_transform(self, transform: Any) -> None:
        """A codebook kind needs rotated data: refuse the identity transform (see the class docstring)."""
        kinds = [(kind, fmt) for kind, fmt in self.roles() if fmt.needs_rotation]
        if kinds and getattr(transform, "identity", False):
            raise ConfigError(
                f"Quantize: scheme={kinds[0][1].name!r} for the {' and '.join(k for k, _ in kinds)}s assumes rotated "
                "coordinates (close to Gaussian, which its Lloyd-Max codebook is built for); without a rotation the "
                "few outlier channels of keys take whole codebook cells. Pass transform='hadamard', or use "
                f"scheme='minmax'; got transform={transform.name!r}"
            )

    def check_head_dim(self, head_dim: int, multiple: int = 4, role: str | None = None) -> None:
        """Per-token groups split each token's channels: ``group_size`` must divide ``head_dim``.

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
                        f"{fmt.head_dim_multiple} (their indices pack into whole bytes); got head_dim={head_dim}"
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


def _scheme(given: dict[str, Any], kind: str) -> tuple[str, Any]:
    """``(parameter, value)`` of ``kind``'s scheme, :data:`DEFAULT_SCHEME` when none is given."""
    param, value = _pick(given, kind, "scheme")
    return param, DEFAULT_SCHEME if value is None else value


def _pick(given: dict[str, Any], kind: str, option: str) -> tuple[str, Any]:
    """``(parameter, value)`` of ``kind``'s ``option``: its own keyword, else the shorthand, else ``None``."""
    own = f"{kind}_{option}"
    if own in given:
        return own, given[own]
    return (option, given[option]) if option in given else (own, None)


def _role_format(kind: str, cls: type[Format], other: type[Format], given: dict[str, Any], filled: set[str]) -> Format:
    """The format the shortcuts ``given`` describe for ``kind`` (``"key"``/``"value"``) in scheme ``cls``
    (``other``: the other kind's), the defaults filled (their options added to ``filled``)."""
    role = f"{kind}s"
    bits_param, bits = _pick(given, kind, "bits")
    bits = DEFAULT_BITS if bits is None else bits
    if cls.bits_allowed and bits not in cls.bits_allowed:
        raise ConfigError(
            f"Quantize: {bits_param}={bits} with scheme={cls.name!r}; it supports bits in {list(cls.bits_allowed)}"
        )
    meta = given.get("meta_dtype", "auto")
    param, group = _pick(given, kind, "group_size")
    fit_param, fit = _pick(given, kind, "fit")
    if not cls.grouped:
        # a shared group size or fit applies to the grouped kind; given for none, or a kind's own, it is an error
        if group is not None and (param != "group_size" or not other.grouped):
            raise ConfigError(
                f"Quantize: {kind}s quantized with scheme={cls.name!r} hold one scale per token and head; a group "
                f"size does not apply to them (got {param}={group})"
            )
        if fit not in (None, "minmax") and (fit_param != "fit" or not other.grouped):
            if fit_param == "fit":
                raise ConfigError(
                    f"Quantize: fit={fit!r} chooses the range of min-max groups; both keys and values use "
                    f"scheme={cls.name!r} (one scale per vector, no range to fit). Drop fit, or quantize a "
                    "kind with scheme='minmax'"
                )
            raise ConfigError(
                f"Quantize: {kind}_fit={fit!r} chooses the range of min-max groups; the {kind}s use "
                f"scheme={cls.name!r} (one scale per vector, no range to fit)"
            )
        centre = bool(given.get("key_centre", False)) if kind == "key" else False
        if centre and not cls.centred:
            raise ConfigError(
                "Quantize: key_centre=True centres codebook keys; the keys' scheme is "
                f"{cls.name!r}, whose blocks take no centre. Pass key_scheme='codebook', or drop key_centre"
            )
        if "norm_bits" in given and _has_norm_bits(cls):
            return cls.from_options(bits, None, "token", "minmax", meta, centre, norm_bits=given["norm_bits"])
        return cls.from_options(bits, None, "token", "minmax", meta, centre)
    if kind == "key" and given.get("key_centre"):
        raise ConfigError(
            "Quantize: key_centre=True centres codebook keys; the keys' scheme is "
            f"{cls.name!r} (min-max groups carry their own zero-point). Pass key_scheme='codebook', "
            "or drop key_centre"
        )
    axis = given.get(f"{kind}_axis", DEFAULT_AXIS[kind])
    if group is None:
        group = DEFAULT_GROUP_SIZE[axis]
        filled.add(f"{role}.group_size")
    if fit is None:
        fit = DEFAULT_KEY_FIT if kind == "key" else "minmax"
        if kind == "key":
            filled.add("keys.fit")
    return cls.from_options(bits, group, axis, fit, meta, False)


def _has_norm_bits(cls: type[Format]) -> bool:
    """Whether a format class has a ``norm_bits`` parameter (the width of a per-vector scale)."""
    return dataclasses.is_dataclass(cls) and any(f.name == "norm_bits" for f in dataclasses.fields(cls))


def _check_shortcuts(given: dict[str, Any]) -> None:
    """Each shortcut keyword of ``Quantize`` of the right kind and range, and no kind's own contradicting
    its shorthand."""
    for param in ("bits", "key_bits", "value_bits", "group_size", "key_group_size", "value_group_size"):
        if param in given:
            check_int(param, given[param], 1, "Quantize")
            if param.endswith("bits") and given[param] > 8:
                raise ConfigError(f"Quantize: {param} must be between 1 and 8; got {param}={given[param]!r}")
    for param in ("key_axis", "value_axis"):
        if param in given and given[param] not in AXES:
            raise ConfigError(f"Quantize: {param} must be one of {list(AXES)}; got {param}={given[param]!r}")
    for param in ("scheme", "key_scheme", "value_scheme"):
        if param in given:
            _scheme_class(param, given[param])
    for param in ("fit", "key_fit", "value_fit"):
        if param in given and given[param] not in FITS:
            raise ConfigError(f"Quantize: {param} must be one of {list(FITS)}; got {param}={given[param]!r}")
    for short, kinds in SHORTHANDS.items():
        for param in kinds:
            if short in given and param in given and given[param] != given[short]:
                a = _scheme_class(short, given[short]) if short == "scheme" else given[short]
                b = _scheme_class(param, given[param]) if short == "scheme" else given[param]
                if a != b:
                    raise ConfigError(
                        f"Quantize: {short}={given[short]!r} (the shorthand for both) contradicts "
                        f"{param}={given[param]!r}; give {short} alone, or {' and '.join(kinds)}"
                    )
    if "key_centre" in given and not isinstance(given["key_centre"], bool):
        raise ConfigError(f"Quantize: key_centre must be a bool; got key_centre={given['key_centre']!r}")
    if "norm_bits" in given:
        check_norm_bits("Quantize", "norm_bits", given["norm_bits"])
    meta = given.get("meta_dtype", "auto")
    if not isinstance(meta, str) or meta not in META_DTYPES:
        raise ConfigError(f"Quantize: meta_dtype must be one of {list(META_DTYPES)}; got meta_dtype={meta!r}")


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
        #: quantized around, when set before it arrives (:meth:`kvpolicy.segments.LayerSegments.release`
        #: sets the mean of the first block an unsplit demotion would have made); ``None`` otherwise, and
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
            smaller quantized count of the two streams). Either may be absent.
        """
        # (num_quantized and len(self), inlined: this runs at every fused decode step)
        kq, vq = self.k.q, self.v.q
        nk, nv = (0 if kq is None else kq.shape[2]), (0 if vq is None else vq.shape[2])
        m = min(nk, nv)
        basis = self.basis  # None: a transformed store rebases the parts (TransformedStore.parts)
        out: list[Part] = []
        if self.positions.shape[-1] != m:
            # a stream whose quantized tokens all lie before m holds the tail in its staging buffer alone
            keys = self.k.staging if nk == m and self.k.staging is not None else self.k.read_from(m)
            values = self.v.staging if nv == m and self.v.staging is not None else self.v.read_from(m)
            out.append(Part(keys, values, None, basis, self.positions[:, m:]))
        if m:
            quantized = (kq if nk == m else kq.narrow(0, m), vq if nv == m else vq.narrow(0, m))
            out.append(Part(*quantized, self.k.backend, basis, self.positions[:, :m]))
        return out

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
