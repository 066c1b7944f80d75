"""Everything the codec takes from kvpolicy, in one module: a preset's formats and rotation, and a role's
blocks to and from their tensors.

A codec named after a preset stores every token of a chunk as the preset stores the tokens it demotes
furthest: the formats of its action's last tier (``Quantize.keys`` / ``Quantize.values``) and its
rotation (``CacheSpec.transform``), without its token selection (a chunk carries no positions). Keys of a
centred format are centred per layer and head on the mean of the chunk's keys (a stream of one block).

Only public parts of kvpolicy are used: :meth:`kvpolicy.spec.CacheSpec.from_preset`, the registry's
presets, :class:`~kvpolicy.actions.quantize.Quantize` and :class:`~kvpolicy.actions.tiered.Tiered`
(``tiers``, ``keys``, ``values``, ``with_widths``, ``check_transform``), a transform's ``forward`` /
``inverse`` / ``check_head_dim``, a format's ``quantize``, a block's ``state`` / ``dequantize`` and
:func:`kvpolicy.formats.load_block`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from kvpolicy import formats, registry
from kvpolicy.actions.quantize import Quantize
from kvpolicy.actions.tiered import Tiered
from kvpolicy.errors import ConfigError
from kvpolicy.formats import Format, QTensor
from kvpolicy.policies.log import LogWindow
from kvpolicy.spec import CacheSpec
from kvpolicy.transforms.base import Transform

#: the metadata dtype ``meta_dtype="auto"`` means for a chunk of each dtype (kvpolicy's rule: bfloat16
#: metadata for bfloat16 tensors, float16 otherwise)
AUTO_META = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float16"}


@dataclass(frozen=True)
class Parts:
    """The formats and rotation of a codec.

    Attributes
    ----------
    keys, values : Format
        How each role is stored (one block per role and chunk group).
    transform : Transform
        The rotation applied to every vector first (``forward``) and undone last (``inverse``).
    """

    keys: Format
    values: Format
    transform: Transform

    def describe(self) -> dict[str, Any]:
        """The parts as JSON values: each format's and the transform's name and parameters."""
        return {
            "keys": _describe(self.keys),
            "values": _describe(self.values),
            "transform": _describe(self.transform),
        }

    def check_head_dim(self, head_dim: int) -> str | None:
        """Why vectors of ``head_dim`` channels cannot be stored (``None``: they can)."""
        try:
            self.transform.check_head_dim(head_dim)
            for role, fmt in (("key", self.keys), ("value", self.values)):
                if head_dim % fmt.head_dim_multiple:
                    return (
                        f"{role}s in format {fmt.name!r} need a head_dim that is a multiple of "
                        f"{fmt.head_dim_multiple}; got head_dim={head_dim}"
                    )
                if fmt.grouped and head_dim % fmt.group_size:
                    return f"{role} groups of {fmt.group_size} channels do not divide head_dim={head_dim}"
        except ConfigError as exc:
            return str(exc)
        return None


def _describe(part: Any) -> dict[str, Any]:
    return {"name": part.name, **dataclasses.asdict(part)}


def resolve(preset: str, overrides: dict[str, Any], key_bits: int | None, value_bits: int | None) -> Parts:
    """The parts of a codec named after ``preset``.

    Parameters
    ----------
    preset : str
        A registered kvpolicy preset (``"kvpolicy-3bit"``...) whose action quantizes every token it
        demotes: a :class:`Quantize`, or a :class:`Tiered` action (its last tier is taken).
    overrides : dict
        Parameters of the preset function (``seed``, ``norm_bits``...); each must be one it takes.
    key_bits, value_bits : int or None
        Code widths replacing the last tier's (``None``: the preset's).

    Raises
    ------
    ConfigError
        An unknown preset or parameter; a preset whose action does not quantize, whose formats group
        tokens along channels (a chunk's last part may hold fewer tokens than a group), or whose
        transform fits itself to a model (it would need the model's queries or a first block).
    """
    fn = registry.get("presets", preset)
    accepted = set(inspect.signature(fn).parameters)
    unknown = sorted(set(overrides) - accepted)
    if unknown:
        raise ConfigError(
            f"kvpolicy codec: preset {preset!r} takes no parameter {unknown[0]!r}; its parameters are "
            f"{sorted(accepted)}"
        )
    spec = CacheSpec.from_preset(preset, **overrides)
    action = spec.action
    if isinstance(action, Tiered):
        action = action.tiers[-1]
    if not isinstance(action, Quantize):
        raise ConfigError(
            f"kvpolicy codec: preset {preset!r} has action {spec.action.name!r}; a codec stores every token, so it "
            "needs a preset that quantizes (action 'quantize' or 'tiered'), e.g. 'kvpolicy-3bit'"
        )
    if key_bits is not None or value_bits is not None:
        action = action.with_widths(
            action.keys.bits if key_bits is None else key_bits,
            action.values.bits if value_bits is None else value_bits,
        )
    for role, fmt in action.roles():
        if fmt.grouped and fmt.axis != "token":
            raise ConfigError(
                f"kvpolicy codec: preset {preset!r} stores {role}s in {fmt.name!r} groups of {fmt.group_size} tokens "
                "along each channel; a chunk (and its last part) may hold any number of tokens, so the codec "
                "serves formats that store every token on its own (codebook or lattice, or per-token min-max)"
            )
    transform = spec.transform
    if transform.fits:
        raise ConfigError(
            f"kvpolicy codec: preset {preset!r} uses transform {transform.name!r}, which fits itself to a model "
            "(its queries or its first keys); a codec sees chunks alone. Use a preset with transform 'hadamard'"
        )
    action.check_transform(transform)
    return Parts(action.keys, action.values, transform)


def for_dtype(fmt: Format, dtype: torch.dtype) -> Format:
    """``fmt`` with ``meta_dtype="auto"`` replaced by the metadata dtype it means for chunks of ``dtype``
    (the codec quantizes float32 vectors, whose own ``"auto"`` would always be float16)."""
    if getattr(fmt, "meta_dtype", None) != "auto":
        return fmt
    return dataclasses.replace(fmt, meta_dtype=AUTO_META[dtype])  # type: ignore[type-var]


@dataclass(frozen=True)
class Section:
    """One tensor of a stored block: its entry in the block's state, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes it holds."""
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Template:
    """What a block of one format and shape stores: its tensors (:class:`Section`, in the order they are
    written) and the rest of its state (JSON values), the same for every input of that shape."""

    sections: tuple[Section, ...]
    meta: tuple[tuple[str, Any], ...]

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors."""
        return sum(s.nbytes for s in self.sections)


@functools.lru_cache(maxsize=64)
def template(fmt: Format, shape: tuple[int, int, int, int]) -> Template:
    """The :class:`Template` of ``fmt``'s blocks of ``shape`` ``(layers, heads, tokens, head_dim)``, read
    from a block of zeros (what is stored depends on the format and the shape, not on the values)."""
    zeros = torch.zeros(shape, dtype=torch.float32)
    centre = torch.zeros((*shape[:2], 1, shape[3])) if fmt.centre else None
    state = fmt.quantize(zeros, centre=centre).state()
    sections = tuple(
        Section(name, value.dtype, tuple(value.shape))
        for name, value in sorted(state.items())
        if isinstance(value, torch.Tensor)
    )
    meta = tuple((name, value) for name, value in sorted(state.items()) if not isinstance(value, torch.Tensor))
    return Template(sections, meta)


def quantize(fmt: Format, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of ``x`` ``(layers, heads, tokens, head_dim)`` float32 stored in ``fmt`` (keys of a
    centred format around the mean of their tokens), by section name."""
    centre = x.mean(dim=2, keepdim=True) if fmt.centre else None
    state = fmt.quantize(x, centre=centre).state()
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


def block(fmt: Format, tmpl: Template, tensors: dict[str, torch.Tensor]) -> QTensor:
    """The block of ``fmt`` that ``tensors`` (read from a payload, shaped as ``tmpl`` says) hold, checked
    by the format's own loader (:func:`kvpolicy.formats.load_block`).

    Raises
    ------
    ValueError
        If the format's checks refuse them, or a floating-point tensor holds NaN or Inf (no finite chunk
        gives one).
    """
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"its {name} hold NaN or Inf")
    return formats.load_block({**dict(tmpl.meta), **tensors}, fmt)


def kept_tokens(preset: str) -> tuple[int, int]:
    """How many of each chunk's first and last tokens a codec of ``preset`` keeps verbatim by default: what
    the preset's own policy always keeps at full precision, where it says so by position alone. The log
    policy (kvpolicy's presets, ``W = window``) keeps position 0 and the ``W`` most recent tokens: ``(1, W)``;
    any other policy: ``(0, 0)``."""
    policy = CacheSpec.from_preset(preset).policy
    if isinstance(policy, LogWindow):
        return (1, policy.window)
    return (0, 0)
