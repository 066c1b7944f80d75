"""The ``"quantize"`` action: demoted tokens are quantized once, when demoted, and never again."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvpolicy import formats, state_check
from kvpolicy.actions.base import Action, DemotedStore
from kvpolicy.backends.base import AXES, FITS, META_DTYPES, SCHEMES, Backend, QTensor, check_metadata, widen_remedy
from kvpolicy.errors import ConfigError, MetadataOverflowError, NonFiniteError
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


#: shorthand parameter -> the per-kind parameters it sets
SHORTHANDS = {"bits": ("key_bits", "value_bits"), "group_size": ("key_group_size", "value_group_size")}
#: the quantization scheme when none is given
DEFAULT_SCHEME = "minmax"
#: a codebook kind's multiple of head_dim (indices of 2, 3 or 4 bits pack into whole bytes)
CODEBOOK_HEAD_DIM_MULTIPLE = 8


def _registered_format(name: object) -> bool:
    """Whether ``name`` is a format registered beyond the built-ins (``Quantize(scheme=name)``)."""
    if not isinstance(name, str):
        return False
    try:
        formats.format_class(name)
    except ConfigError:
        return False
    return True


def _scheme_names() -> list[str]:
    """The scheme names ``Quantize`` takes: the built-in formats', then those plugins register."""
    from kvpolicy import registry

    return [*SCHEMES, *(n for n in registry.names("formats") if n not in SCHEMES)]


def _grouped(scheme: str) -> bool:
    """Whether the format ``scheme`` names has groups (``group_size`` and ``axis`` apply)."""
    return formats.format_class(scheme).grouped


def _first(*values: int | None) -> int:
    """The first value given: a kind's own, else the shorthand, else the default."""
    return next(v for v in values if v is not None)


@dataclass(frozen=True, eq=False)
class Quantize(Action):
    """Quantize demoted tokens to ``bits``: asymmetric min-max groups of ``group_size``, or a codebook.

    Parameters
    ----------
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
    key_axis, value_axis : {"channel", "token"}
        Grouping axis of keys and values. Defaults follow KIVI (keys per channel, values per
        token): on SmolLM2-135M at 2 bits with the log policy, per-token keys raise next-token
        loss far more than per-channel keys. Per-channel tokens wait in a full-precision staging
        buffer until ``group_size`` of them are demoted, then are quantized once, in demotion order.
    check_finite : bool
        Raise :class:`~kvpolicy.errors.NonFiniteError` if NaN or Inf reaches the quantizer, or comes
        out of it in the stored metadata (one reduction over the demoted tokens and one over their
        scales and minimums; switch off for speed once a model is known good).
    meta_dtype : {"auto", "float16", "bfloat16", "float32"}
        The dtype of each group's scale and minimum. ``"auto"``: the backend's default (``torch``,
        ``cpu``, ``triton``: ``bfloat16`` for ``bfloat16`` inputs, ``float16`` otherwise). float16
        holds magnitudes up to 65504 only: float32 keys or values beyond it raise
        :class:`~kvpolicy.errors.MetadataOverflowError` whatever ``check_finite`` says, and
        ``"float32"`` (32 more bits per group) or ``"bfloat16"`` (same bytes, 8-bit significand)
        stores them. Which values a backend accepts: ``Backend.capabilities.meta_dtypes``.
    scheme : {"minmax", "codebook"}, optional
        How keys and values alike are quantized (the shorthand for ``key_scheme`` and
        ``value_scheme``); default ``"minmax"``. ``"codebook"``: one scale per token and head plus
        ``bits``-bit indices into the Lloyd-Max codebook of the standard normal distribution
        (:mod:`kvpolicy.formats.codebook`; ``bits + 16 / head_dim`` bits per element, no zero-point).
        It assumes rotated, near-Gaussian coordinates: a cache refuses it without a rotation
        (``transform="hadamard"``). Group size and axis do not apply to a codebook kind (giving one
        for it is an error); ``meta_dtype`` sets the dtype of its scales. Widths: 2, 3 or 4 bits
        (``torch`` and ``cpu`` backends). A scheme is the name of a format (:mod:`kvpolicy.formats`):
        any format registered through the ``kvpolicy_register_formats`` hook is accepted too (its
        spec's :meth:`~kvpolicy.formats.base.Format.from_options` builds it from these parameters).
    key_scheme, value_scheme : {"minmax", "codebook"}, optional
        The scheme of keys or values alone; contradicting ``scheme`` is a ConfigError.
    key_centre : bool
        Codebook keys only: quantize each key minus a centre ``μ`` (per batch row and head), the mean
        of the first keys the layer demotes (usually the prompt's), stored once in the metadata dtype
        and shared by every later key, so the codebook spends its cells on how keys differ rather
        than on the offset they share. Costs ``head_dim`` metadata values per row, head and layer;
        the fused path reads it at no extra pass (:mod:`kvpolicy.backends.codebook`). Measured in
        docs/explanation/quantization.md. Needs ``key_scheme="codebook"`` and a backend whose capabilities list
        ``codebook_centre`` (``torch``, ``cpu``). Any centre is exact (it is stored and added back);
        how much it helps depends on how well the first block stands for later keys: a left-padded
        row's mean includes its padding tokens' keys, and a first demotion of a few tokens gives a
        noisy mean.
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
    """

    bits: int | None = None
    group_size: int | None = None
    key_axis: str = "channel"
    value_axis: str = "token"
    check_finite: bool = True
    meta_dtype: str = "auto"
    key_group_size: int | None = None
    value_group_size: int | None = None
    key_bits: int | None = None
    value_bits: int | None = None
    scheme: str | None = None
    key_scheme: str | None = None
    value_scheme: str | None = None
    key_centre: bool = False
    fit: str | None = None
    key_fit: str | None = None
    value_fit: str | None = None

    name = "quantize"

    def __post_init__(self) -> None:
        for short, kinds in SHORTHANDS.items():
            for param in (short, *kinds):
                value = getattr(self, param)
                if value is not None:
                    check_int(param, value, 1, "Quantize")
                    if short == "bits" and value > 8:
                        raise ConfigError(f"Quantize: {param} must be between 1 and 8; got {param}={value!r}")
            given = getattr(self, short)
            for param in kinds:
                own = getattr(self, param)
                if given is not None and own is not None and own != given:
                    raise ConfigError(
                        f"Quantize: {short}={given} (the shorthand for both) contradicts {param}={own}; give "
                        f"{short} alone, or {' and '.join(kinds)}"
                    )
        for param in ("key_axis", "value_axis"):
            value = getattr(self, param)
            if value not in AXES:
                raise ConfigError(f"Quantize: {param} must be one of {list(AXES)}; got {param}={value!r}")
        self._check_schemes()
        if self.key_method == self.value_method == "minmax" and self.key_axis == self.value_axis == "channel":
            small, big = sorted((self.key_group, self.value_group))
            if big % small:
                raise ConfigError(
                    f"Quantize: keys and values both grouped per channel need one group size to divide the "
                    f"other (tokens are read back in whole groups of both); got key_group_size={self.key_group}, "
                    f"value_group_size={self.value_group}"
                )
        if not isinstance(self.key_centre, bool):
            raise ConfigError(f"Quantize: key_centre must be a bool; got key_centre={self.key_centre!r}")
        if self.key_centre and self.key_method != "codebook":
            raise ConfigError(
                "Quantize: key_centre=True centres codebook keys; the keys' scheme is "
                f"{self.key_method!r} (min-max groups carry their own zero-point). Pass key_scheme='codebook', "
                "or drop key_centre"
            )
        self._check_fits()
        if not isinstance(self.check_finite, bool):
            raise ConfigError(f"Quantize: check_finite must be a bool; got check_finite={self.check_finite!r}")
        if not isinstance(self.meta_dtype, str) or self.meta_dtype not in META_DTYPES:
            raise ConfigError(
                f"Quantize: meta_dtype must be one of {list(META_DTYPES)}; got meta_dtype={self.meta_dtype!r}"
            )

    def _check_choice(self, short: str, allowed: tuple[str, ...]) -> None:
        """``short`` and its per-kind forms (``key_<short>``, ``value_<short>``): each one of ``allowed``,
        and neither kind's own contradicting the shorthand."""
        kinds = (f"key_{short}", f"value_{short}")
        for param in (short, *kinds):
            value = getattr(self, param)
            if value is not None and value not in allowed and not (short == "scheme" and _registered_format(value)):
                known = list(allowed) if short != "scheme" else _scheme_names()
                raise ConfigError(f"Quantize: {param} must be one of {known}; got {param}={value!r}")
        given = getattr(self, short)
        for param in kinds:
            own = getattr(self, param)
            if given is not None and own is not None and own != given:
                raise ConfigError(
                    f"Quantize: {short}={given!r} (the shorthand for both) contradicts {param}={own!r}; give "
                    f"{short} alone, or {' and '.join(kinds)}"
                )

    def _check_fits(self) -> None:
        self._check_choice("fit", FITS)
        for kind in ("key", "value"):
            own = getattr(self, f"{kind}_fit")
            method = getattr(self, f"{kind}_method")
            if own not in (None, "minmax") and not _grouped(method):
                raise ConfigError(
                    f"Quantize: {kind}_fit={own!r} chooses the range of min-max groups; the {kind}s use "
                    f"scheme={method!r} (one scale per vector, no range to fit)"
                )
        if self.fit not in (None, "minmax") and not (_grouped(self.key_method) or _grouped(self.value_method)):
            raise ConfigError(
                f"Quantize: fit={self.fit!r} chooses the range of min-max groups; both keys and values use "
                f"scheme={self.key_method!r} (one scale per vector, no range to fit). Drop fit, or quantize a "
                "kind with scheme='minmax'"
            )

    @property
    def key_fitting(self) -> str:
        """How the keys' min-max groups choose their range (``"minmax"`` for codebook keys)."""
        if not _grouped(self.key_method):
            return "minmax"
        return self.key_fit or self.fit or DEFAULT_KEY_FIT

    @property
    def value_fitting(self) -> str:
        """How the values' min-max groups choose their range (``"minmax"`` for codebook values)."""
        if not _grouped(self.value_method):
            return "minmax"
        return self.value_fit or self.fit or "minmax"

    def _fit_repr(self) -> list[str]:
        # one fit= when both kinds agree, nothing for min-max (reprs, and so result ids, from before the
        # parameter existed stay as they were)
        k, v = self.key_fitting, self.value_fitting
        if k == v:
            return [] if k == "minmax" else [f"fit={k!r}"]
        return [f"{kind}_fit={f!r}" for kind, f in (("key", k), ("value", v)) if f != "minmax"]

    def _check_schemes(self) -> None:
        self._check_choice("scheme", SCHEMES)
        for kind in ("key", "value"):
            method = getattr(self, f"{kind}_method")
            if _grouped(method):
                continue
            other = "value" if kind == "key" else "key"
            given = getattr(self, f"{kind}_group_size")
            if given is None and not _grouped(getattr(self, f"{other}_method")):
                given = self.group_size
            if given is not None:
                raise ConfigError(
                    f"Quantize: {kind}s quantized with scheme={method!r} hold one scale per token and head; a group "
                    f"size does not apply to them (got {self._group_param(kind)}={given})"
                )

    @property
    def key_method(self) -> str:
        """The keys' quantization scheme (``"minmax"`` or ``"codebook"``)."""
        return self.key_scheme or self.scheme or DEFAULT_SCHEME

    @property
    def value_method(self) -> str:
        """The values' quantization scheme (``"minmax"`` or ``"codebook"``)."""
        return self.value_scheme or self.scheme or DEFAULT_SCHEME

    @property
    def key_width(self) -> int:
        """The keys' code width in bits."""
        return _first(self.key_bits, self.bits, DEFAULT_BITS)

    @property
    def value_width(self) -> int:
        """The values' code width in bits."""
        return _first(self.value_bits, self.bits, DEFAULT_BITS)

    @property
    def key_group(self) -> int:
        """The keys' group size in effect."""
        return _first(self.key_group_size, self.group_size, DEFAULT_GROUP_SIZE[self.key_axis])

    @property
    def value_group(self) -> int:
        """The values' group size in effect."""
        return _first(self.value_group_size, self.group_size, DEFAULT_GROUP_SIZE[self.value_axis])

    def _kind_layout(self, kind: str) -> tuple:
        """``(scheme, group size, axis)`` of one kind as it quantizes (a codebook kind has neither)."""
        method = getattr(self, f"{kind}_method")
        if not _grouped(method):
            return (method, None, None)
        return ("minmax", getattr(self, f"{kind}_group"), getattr(self, f"{kind}_axis"))

    def _canonical(self) -> tuple:
        return (self.key_width, self.value_width, self._kind_layout("key"), self._kind_layout("value"),
                self.check_finite, self.meta_dtype, self.key_centre, self.key_fitting, self.value_fitting)  # fmt: skip

    def __eq__(self, other: object) -> bool:
        # equal when they quantize alike: Quantize() == Quantize(key_group_size=128, value_group_size=64)
        return isinstance(other, Quantize) and self._canonical() == other._canonical()

    def __hash__(self) -> int:
        return hash(("quantize", *self._canonical()))

    def __repr__(self) -> str:
        # the repr names a cache in results (and their cell ids): the group sizes in effect, one
        # ``group_size`` when they agree; meta_dtype only when set (caches described before the
        # parameter existed used the default); the scheme only when a kind uses the codebook (its group
        # size and axis are then left out); fit only when it is not "minmax" (likewise)
        if (self.key_method, self.value_method) != ("minmax", "minmax"):
            return self._codebook_repr()
        if self.key_group == self.value_group:
            groups = f"group_size={self.key_group!r}"
        else:
            groups = f"key_group_size={self.key_group!r}, value_group_size={self.value_group!r}"
        if self.key_width == self.value_width:
            widths = f"bits={self.key_width!r}"
        else:
            widths = f"key_bits={self.key_width!r}, value_bits={self.value_width!r}"
        shown = [widths, groups]
        shown += [f"{name}={getattr(self, name)!r}" for name in ("key_axis", "value_axis", "check_finite")]
        if self.meta_dtype != "auto":
            shown.append(f"meta_dtype={self.meta_dtype!r}")
        shown += self._fit_repr()
        return f"Quantize({', '.join(shown)})"

    def _codebook_repr(self) -> str:
        if self.key_width == self.value_width:
            shown = [f"bits={self.key_width!r}"]
        else:
            shown = [f"key_bits={self.key_width!r}", f"value_bits={self.value_width!r}"]
        if self.key_method == self.value_method:
            shown.append(f"scheme={self.key_method!r}")
        else:
            shown += [f"key_scheme={self.key_method!r}", f"value_scheme={self.value_method!r}"]
        for kind in ("key", "value"):
            if _grouped(getattr(self, f"{kind}_method")):
                shown += [f"{kind}_group_size={getattr(self, f'{kind}_group')!r}",
                          f"{kind}_axis={getattr(self, f'{kind}_axis')!r}"]  # fmt: skip
        if self.key_centre:
            shown.append("key_centre=True")
        shown.append(f"check_finite={self.check_finite!r}")
        if self.meta_dtype != "auto":
            shown.append(f"meta_dtype={self.meta_dtype!r}")
        shown += self._fit_repr()
        return f"Quantize({', '.join(shown)})"

    def _group_param(self, kind: str) -> str:
        """The parameter that set ``kind``'s group size, as the user wrote it."""
        own = f"{kind}_group_size"
        if getattr(self, own) is None and self.group_size is not None:
            return "group_size"
        return own if getattr(self, own) is not None else f"{own} (default)"

    def check_backend(self, backend: Backend) -> None:
        mult = backend.capabilities.group_size_multiple
        minmax = [kind for kind in ("key", "value") if _grouped(getattr(self, f"{kind}_method"))]
        for kind in ("key", "value"):
            if kind not in minmax:
                backend.check_scheme(getattr(self, f"{kind}_method"), getattr(self, f"{kind}_width"), role=kind)
        if self.key_centre and not backend.capabilities.codebook_centre:
            raise ConfigError(
                f"backend {backend.name!r} does not store centred codebook blocks (key_centre=True); backends "
                "whose capabilities list codebook_centre do (torch, cpu)"
            )
        for kind, group in (("key", self.key_group), ("value", self.value_group)):
            if kind not in minmax:
                continue
            if group % mult:
                raise ConfigError(
                    f"backend {backend.name!r} needs group sizes that are multiples of {mult}; got "
                    f"{self._group_param(kind)}={group}"
                )
        caps = backend.capabilities
        pairs = caps.bit_pairs if caps.bit_pairs is not None else tuple(itertools.product(caps.bits, caps.bits))
        if len(minmax) == 2 and self.key_width != self.value_width and (self.key_width, self.value_width) not in pairs:
            raise ConfigError(
                f"backend {backend.name!r} does not support key_bits={self.key_width}, value_bits={self.value_width}; "
                f"it supports (key_bits, value_bits) in {[tuple(p) for p in pairs]}"
            )
        if "key" in minmax:
            backend.check(bits=self.key_width, group_size=self.key_group, axis=self.key_axis, role="key")
        if "value" in minmax:
            backend.check(bits=self.value_width, group_size=self.value_group, axis=self.value_axis, role="value")
        backend.check_meta_dtype(self.meta_dtype)
        fits = backend.capabilities.fits
        for kind in ("key", "value"):
            fit = getattr(self, f"{kind}_fitting")
            if fit not in fits:
                own = getattr(self, f"{kind}_fit")
                param = f"{kind}_fit" if own is not None or self.fit is None else "fit"
                default = " (the default for min-max keys)" if own is None and self.fit is None else ""
                raise ConfigError(
                    f"backend {backend.name!r} does not fit min-max ranges with {param}={fit!r}{default}; it supports "
                    f"fit in {list(fits)} (fit='mse': backends 'torch', 'cpu' and 'triton'). Pass "
                    f"{param}={fits[0]!r} to use backend {backend.name!r}"
                )

    def serving(
        self, backend: Backend, key_dim: int | None = None, value_dim: int | None = None
    ) -> tuple[Quantize, tuple[str, ...]]:
        """Replace the defaults ``backend`` or the head dims cannot serve (see :meth:`Action.serving`).

        - The keys' default fit (:data:`DEFAULT_KEY_FIT`, ``"mse"``) on a backend whose
          ``capabilities.fits`` lack it (``quanto``, ``hqq``): ``key_fit="minmax"``.
        - A per-token kind's default group size (64 channels for values) that does not divide its
          head dim: the largest divisor of the head dim below it that is a multiple of the backend's
          ``group_size_multiple`` (head_dim 48: 48, 80: 40, 96: 48), when one exists.
        """
        changes: dict[str, Any] = {}
        notes: list[str] = []
        fits = backend.capabilities.fits
        if (self.key_method == "minmax" and self.key_fit is None and self.fit is None
                and DEFAULT_KEY_FIT not in fits):  # fmt: skip
            changes["key_fit"] = "minmax"
            notes.append(
                f"key_fit='minmax' (backend {backend.name!r} does not fit ranges with the default {DEFAULT_KEY_FIT!r})"
            )
        mult = backend.capabilities.group_size_multiple
        for kind, dim in (("key", key_dim), ("value", value_dim)):
            group = getattr(self, f"{kind}_group")
            defaulted = getattr(self, f"{kind}_group_size") is None and self.group_size is None
            if (dim is None or not defaulted or getattr(self, f"{kind}_method") != "minmax"
                    or getattr(self, f"{kind}_axis") != "token" or dim % group == 0):  # fmt: skip
                continue
            fitting = [g for g in range(mult, min(group, dim) + 1, mult) if dim % g == 0]
            if fitting:
                changes[f"{kind}_group_size"] = fitting[-1]
                notes.append(
                    f"{kind}_group_size={fitting[-1]} (the default {group} does not divide the {kind} head_dim {dim})"
                )
        if not changes:
            return self, ()
        return dataclasses.replace(self, **changes), tuple(notes)

    def check_transform(self, transform: Any) -> None:
        """A codebook kind needs rotated data: refuse the identity transform (see the class docstring)."""
        methods = {kind: getattr(self, f"{kind}_method") for kind in ("key", "value")}
        kinds = [kind for kind, method in methods.items() if formats.format_class(method).needs_rotation]
        if kinds and getattr(transform, "identity", False):
            scheme = methods[kinds[0]]
            raise ConfigError(
                f"Quantize: scheme={scheme!r} for the {' and '.join(kinds)}s assumes rotated coordinates (close to "
                "Gaussian, which its Lloyd-Max codebook is built for); without a rotation the few outlier channels "
                "of keys take whole codebook cells. Pass transform='hadamard', or use scheme='minmax'; got "
                f"transform={transform.name!r}"
            )

    def check_head_dim(self, head_dim: int, multiple: int = 4, role: str | None = None) -> None:
        """Per-token groups split each token's channels: ``group_size`` must divide ``head_dim``.

        ``multiple`` is the backend's group-size granularity, used to suggest valid sizes. ``role``
        (``"key"`` or ``"value"``) checks that tensor kind's axis only (models whose keys and values
        have different head dims); ``None`` checks both.
        """
        kinds = {
            "key": (self.key_axis, self.key_group),
            "value": (self.value_axis, self.value_group),
        }
        for kind, (axis, group) in kinds.items():
            if role not in (None, kind):
                continue
            method = getattr(self, f"{kind}_method")
            if not _grouped(method):
                multiple_of = formats.format_class(method).head_dim_multiple
                if head_dim % multiple_of:
                    raise ConfigError(
                        f"Quantize: {kind}s with scheme={method!r} need a head_dim that is a multiple of "
                        f"{multiple_of} (their indices pack into whole bytes); got head_dim={head_dim}"
                    )
                continue
            if axis != "token" or head_dim % group == 0:
                continue
            divisors = [g for g in range(multiple, head_dim + 1, multiple) if head_dim % g == 0]
            what = f"the {role} head_dim" if role else "head_dim"
            raise ConfigError(
                f"Quantize: {self._group_param(kind)}={group} does not divide {what}={head_dim} "
                f"(per-token groups split each token's channels); choose one of {divisors}"
            )

    def new_store(self, backend: Backend, layer_idx: int) -> QuantizedStore:
        return QuantizedStore(self, backend, layer_idx)


class QuantizedStream:
    """Append-only quantized storage of one tensor kind (keys or values) of one layer.

    Tokens are quantized in the order they are appended. With ``axis="channel"`` they first wait
    in ``staging`` (full precision) until a whole group of ``group_size`` tokens is there. The
    parameters name the stream's format (:attr:`fmt`, built by the format ``scheme`` names), which
    ``backend.quantize`` is handed with every block. A stream whose format has no groups (codebook)
    quantizes every token on arrival (``axis="token"``, no ``group_size``).
    """

    def __init__(
        self, backend: Backend, bits: int, group_size: int | None, axis: str, meta_dtype: str = "auto",
        scheme: str = DEFAULT_SCHEME, centre: bool = False, fit: str = "minmax",
    ) -> None:  # fmt: skip
        self.backend = backend
        kind = formats.format_class(scheme)
        self.fit = fit if kind.grouped else "minmax"
        self.bits = bits
        self.scheme = scheme
        self.centre = centre
        self.group_size = group_size if kind.grouped else None
        self.axis = axis if kind.grouped else "token"
        self.meta_dtype = meta_dtype
        #: what this stream stores: the format spec every block is quantized to
        self.fmt = kind.from_options(bits, self.group_size, self.axis, self.fit, meta_dtype, centre)
        self.q: QTensor | None = None
        self.staging: torch.Tensor | None = None
        #: ``centre``: the float32 centre ``(batch, kv_heads, 1, head_dim)`` the first block is quantized
        #: around; ``None`` until the first block is committed (it is then that block's mean), unless set
        #: before it arrives (:meth:`kvpolicy.segments.LayerSegments.release` sets the mean of the first
        #: block an unsplit demotion would have made)
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
            if self.q is None and self.centre and self.first_centre is None:
                self.first_centre = self._proposed_centre
            self.q = block if self.q is None else self.backend.cat([self.q, block])
        self.staging = staging

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
        if self.q is not None and start < self.q.num_tokens:
            block = self.q if start == 0 else self.q.narrow(start, self.q.num_tokens - start)
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
        if self.q is not None:
            self.q = self.q.map_batch(fn)
        if self.staging is not None:
            self.staging = fn(self.staging)

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
        self.k = QuantizedStream(
            backend, action.key_width, action.key_group, action.key_axis, action.meta_dtype, action.key_method,
            action.key_centre, action.key_fitting,
        )  # fmt: skip
        self.v = QuantizedStream(
            backend, action.value_width, action.value_group, action.value_axis, action.meta_dtype, action.value_method,
            fit=action.value_fitting,
        )  # fmt: skip
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

    def attention_parts(self) -> tuple[tuple[QTensor, QTensor] | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """The stored tokens split for attention without materialising them (:mod:`kvpolicy.fused`).

        Returns
        -------
        quantized : (QTensor, QTensor) or None
            Keys and values of the first ``m`` stored tokens, both quantized (``m`` = the smaller
            quantized count of the two streams).
        tail : (torch.Tensor, torch.Tensor) or None
            Keys and values of the remaining tokens at full precision (staged, or dequantized when the
            other stream still stages them): ``(batch, kv_heads, n - m, head_dim)``, fewer than
            ``group_size`` tokens.
        """
        nk, nv = self.k.num_quantized, self.v.num_quantized
        m = min(nk, nv)
        quantized = None
        if m:
            kq = self.k.q if nk == m else self.k.q.narrow(0, m)
            vq = self.v.q if nv == m else self.v.q.narrow(0, m)
            quantized = (kq, vq)
        tail = (self.k.read_from(m), self.v.read_from(m)) if len(self) > m else None
        return quantized, tail

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
