"""Packed min-max blocks: asymmetric min-max groups with real bit packing (the ``"minmax"`` scheme).

Codes are packed ``8 // bits`` to a ``uint8`` (3 bits: eight codes to three bytes); each group
stores a scale and a minimum, by default 16-bit (``meta_dtype="auto"``: ``bfloat16`` for
``bfloat16`` inputs, ``float16`` otherwise; bits per element ``bits + 32 / G``), or in the dtype
``meta_dtype`` names (``"float16"``, ``"bfloat16"``, ``"float32"``: ``bits + 64 / G``).

Rounding of the metadata is directed so the error bound survives it: the minimum is rounded down and
the scale up, so the representable range ``[min16, min16 + (2**bits - 1) * s16]`` always covers the
group, and ``|x - x_hat| <= s16 / 2`` (plus the rounding of the output dtype).

Where finite input can overflow the metadata dtype (float32 / float64 input with float16 metadata:
a group minimum below -65504 or a scale above 65504; see
:func:`~kvpolicy.formats.base.metadata_may_overflow`), the metadata is checked after the cast and
:class:`~kvpolicy.errors.MetadataOverflowError` raised instead of storing NaN / Inf.

The format: :class:`MinMax` (the spec, its reference quantizer :meth:`MinMax.quantize`) and
:class:`PackedTensor` (the block, owning dequantize, cat, narrow, select, its saved state
``packed-v1`` and its attention halves). The ``torch``, ``cpu`` and ``triton`` backends store it bit for
bit; ``cpu`` and ``triton`` add kernels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvpolicy import state_check
from kvpolicy.errors import ConfigError
from kvpolicy.formats.base import (
    AXES,
    FITS,
    FP16_MAX,
    META_TORCH_DTYPES,
    Format,
    QTensor,
    backend_meta_dtypes,
    backend_name,
    check_meta_dtype_option,
    check_metadata,
    in_dtype,
    meta_dtype,
    metadata_may_overflow,
    resolve_meta_dtype,
    widen_remedy,
)

__all__ = [
    "FP16_MAX", "META_TORCH_DTYPES", "MSE_ROUNDS", "MinMax", "PackedTensor", "dequantize_groups", "fit_range",
    "meta_dtype", "metadata_check", "pack", "per_head_views", "quantize_groups", "quantize_packed",
    "resolve_meta_dtype", "unpack",
]  # fmt: skip


@dataclass
class PackedTensor(QTensor):
    """Bit-packed codes with per-group scale and minimum.

    Attributes
    ----------
    codes : torch.Tensor
        ``uint8``. Token axis: ``(batch, kv_heads, tokens, head_dim // G, G * bits // 8)``.
        Channel axis: ``(batch, kv_heads, tokens // G, head_dim, G * bits // 8)``.
    scales, zeros : torch.Tensor
        The codes' shape without the last dimension, in the metadata dtype (``float16``,
        ``bfloat16`` or ``float32``: see :func:`resolve_meta_dtype`).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int
    axis: str
    shape: tuple[int, int, int, int]
    dtype: torch.dtype

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scales": self.scales, "zeros": self.zeros}

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> PackedTensor:
        codes, scales, zeros = fn(self.codes), fn(self.scales), fn(self.zeros)
        return PackedTensor(
            codes, scales, zeros, self.bits, self.group_size, self.axis,
            (codes.shape[0], *self.shape[1:]), self.dtype,
        )  # fmt: skip

    def narrow(self, start: int, length: int) -> PackedTensor:
        """Tokens ``[start, start + length)`` as a view (per-channel blocks: whole groups only)."""
        per = 1 if self.axis == "token" else self.group_size
        if start % per or length % per or start < 0 or length < 0 or start + length > self.shape[2]:
            raise ValueError(
                f"narrow(start={start}, length={length}) on a {self.axis}-grouped block of {self.shape[2]} tokens "
                f"(group_size={self.group_size}): the range must lie inside the block, in whole groups"
            )
        sl = slice(start // per, (start + length) // per)
        return PackedTensor(
            self.codes[:, :, sl], self.scales[:, :, sl], self.zeros[:, :, sl], self.bits, self.group_size, self.axis,
            (*self.shape[:2], length, self.shape[3]), self.dtype,
        )  # fmt: skip

    def dequantize(self) -> torch.Tensor:
        """``(batch, kv_heads, tokens, head_dim)`` in :attr:`dtype` (float16 clamped to ``±65504``: see
        :func:`~kvpolicy.formats.base.in_dtype`)."""
        out = _ungrouped(dequantize_groups(self), self.axis, self.shape)
        return out if self.dtype == torch.float32 else in_dtype(out, self.dtype)

    @classmethod
    def cat(cls, blocks: list[QTensor]) -> PackedTensor:  # type: ignore[override]
        """Blocks of one configuration along the token axis (``torch.cat`` of codes, scales, minimums)."""
        if len(blocks) == 1:
            return blocks[0]  # type: ignore[return-value]
        first: PackedTensor = blocks[0]  # type: ignore[assignment]
        shape = (*first.shape[:2], sum(b.shape[2] for b in blocks), first.shape[3])
        return PackedTensor(
            torch.cat([b.codes for b in blocks], dim=2),  # type: ignore[attr-defined]
            torch.cat([b.scales for b in blocks], dim=2),  # type: ignore[attr-defined]
            torch.cat([b.zeros for b in blocks], dim=2),  # type: ignore[attr-defined]
            first.bits, first.group_size, first.axis, shape, first.dtype,
        )  # fmt: skip

    def scores(self, query: torch.Tensor) -> torch.Tensor:
        """``query · k̂`` from the codes. Keys grouped per channel (group ``g``, channel ``c``: scale ``s``,
        minimum ``z``) score as ``(q ⊙ s_g) · codes + q · z_g``, so no dequantized key is formed (about
        8 % faster than dequantizing them at 2k–8k tokens on CPU); keys grouped per token are
        dequantized group by group, in float32 (no round trip through the block's dtype)."""
        b, h, nq, _ = query.shape
        if self.axis == "channel":  # codes (B, H, n/G, D, G): scores of each group's G tokens at once
            codes = unpack(self.codes, self.bits).float()
            qs = query.unsqueeze(2) * self.scales.float().unsqueeze(3)  # (B, H, n/G, q, D)
            bias = torch.matmul(self.zeros.float(), query.transpose(-1, -2))  # (B, H, n/G, q)
            return torch.matmul(qs, codes).add_(bias.unsqueeze(-1)).transpose(2, 3).reshape(b, h, nq, self.shape[2])
        k = _ungrouped(dequantize_groups(self), "token", self.shape)
        return torch.matmul(query, k.transpose(-1, -2))

    def mix(self, probs: torch.Tensor) -> torch.Tensor:
        """``probs @ v̂`` over the values dequantized group by group in float32. Measured and not adopted:
        folding the scales as :meth:`scores` does (``(p ⊙ s) · codes + p · z``: no faster, and the two
        sums cancel in float32) and unpacking through a 256-entry lookup table (``torch.take``: no
        faster than the shifts in context)."""
        return torch.matmul(probs, _ungrouped(dequantize_groups(self), self.axis, self.shape))

    layouts: ClassVar[tuple[str, ...]] = ("packed-v1",)

    def state(self) -> dict:
        """This block as JSON values and tensors (layout ``packed-v1``; the ``torch``, ``cpu`` and
        ``triton`` backends share it, so a block saved by one loads into any of them)."""
        return {
            "layout": "packed-v1", "codes": self.codes, "scales": self.scales, "zeros": self.zeros, "bits": self.bits,
            "group_size": self.group_size, "axis": self.axis, "shape": list(self.shape),
            "dtype": str(self.dtype).removeprefix("torch."),
        }  # fmt: skip

    @classmethod
    def from_state(cls, state: dict) -> PackedTensor:
        """The block :meth:`state` described, its tensor shapes checked."""
        names = ("layout", "codes", "scales", "zeros", "bits", "group_size", "axis", "shape", "dtype")
        state_check.entries(state, "packed block", names)
        if state["layout"] != "packed-v1":
            raise ValueError(f"block layout {state['layout']!r:.40} is not 'packed-v1'")
        bits = state_check.choice(state["bits"], "block bits", (1, 2, 3, 4, 8))
        group = state_check.integer(state["group_size"], "block group_size", 1)
        if group * bits % 8:
            raise ValueError(f"a block of {bits}-bit codes in groups of {group} does not fill whole bytes")
        axis = state_check.choice(state["axis"], "block axis", AXES)
        b, h, n, d = state_check.shape4(state["shape"], "a block's shape")
        dtype = state_check.float_dtype(state["dtype"], "a block's dtype")
        if (d if axis == "token" else n) % group:
            raise ValueError(f"a {axis}-grouped block of shape {(b, h, n, d)} does not split into groups of {group}")
        lead = (b, h, n, d // group) if axis == "token" else (b, h, n // group, d)
        codes = state_check.tensor(state["codes"], "block codes")
        scales = state_check.tensor(state["scales"], "block scales", tuple(META_TORCH_DTYPES.values()))
        zeros = state_check.tensor(state["zeros"], "block zeros", scales.dtype)
        expected = (*lead, group * bits // 8)
        if tuple(codes.shape) != expected or tuple(scales.shape) != lead or tuple(zeros.shape) != lead:
            raise ValueError(
                f"block tensors have shapes codes {tuple(codes.shape)}, scales {tuple(scales.shape)}, zeros "
                f"{tuple(zeros.shape)}; a {axis}-grouped block of shape {(b, h, n, d)} needs {expected} and {lead}"
            )
        if codes.dtype != torch.uint8:
            raise ValueError(f"block codes must be uint8; got {codes.dtype}")
        return PackedTensor(codes, scales, zeros, bits, group, axis, (b, h, n, d), dtype)


def _inner_contiguous(t: torch.Tensor) -> bool:
    """Whether each (batch, head) slice of ``t`` is one contiguous block."""
    expected = 1
    for size, stride in zip(reversed(t.shape[2:]), reversed(t.stride()[2:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def per_head_views(q: PackedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, scales and minimums of ``q`` as attention kernels read them: batch and head strides are
    free (token slices of a larger container are read in place), each (batch, head) slice is one
    contiguous block (anything else is copied)."""
    codes, scales, zeros = q.codes, q.scales, q.zeros
    if not _inner_contiguous(codes):
        codes = codes.contiguous()
    if scales.stride() != zeros.stride() or not _inner_contiguous(scales):
        scales, zeros = scales.contiguous(), zeros.contiguous()
    return codes, scales, zeros


def metadata_check(backend: Any, x: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
    """:func:`~kvpolicy.backends.base.check_metadata` of freshly quantized min-max metadata, run only
    where finite ``x`` can overflow it (:func:`~kvpolicy.backends.base.metadata_may_overflow`; no cost,
    no synchronisation otherwise).

    Parameters
    ----------
    backend : Backend or str
        The backend the error names; its ``capabilities.meta_dtypes`` are the remedies offered (a name
        alone: every ``meta_dtype`` of :data:`~kvpolicy.backends.base.META_DTYPES`).
    x : torch.Tensor
        The input just quantized, any shape.
    scales, zeros : torch.Tensor
        Its groups' scales and minimums, in the metadata dtype.

    Raises
    ------
    MetadataOverflowError
        If finite ``x`` gave a non-finite scale or minimum.
    """
    if metadata_may_overflow(x.dtype, scales.dtype):
        remedy = widen_remedy(scales.dtype, backend_meta_dtypes(backend))
        check_metadata(backend_name(backend), x, {"scales": scales, "zeros": zeros}, remedy)


def _round_down(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    y = x.to(dtype)
    return torch.where(y.float() > x, torch.nextafter(y, torch.full_like(y, -float("inf"))), y)


def _round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    y = x.to(dtype)
    return torch.where(y.float() < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``uint8`` codes along the last dimension, ``8 // bits`` per byte (lowest bits first).

    3 bits: each run of eight codes becomes three bytes, code ``j`` at bits ``3j .. 3j + 2`` of the
    little-endian 24-bit word (the last dimension must be a multiple of 8); ``n * 3 / 8`` bytes.
    """
    if bits == 3:
        c = codes.view(*codes.shape[:-1], codes.shape[-1] // 8, 8).to(torch.int32)
        word = c[..., 0].clone()
        for j in range(1, 8):
            word |= c[..., j] << (3 * j)
        out = torch.stack([(word >> (8 * i)) & 0xFF for i in range(3)], dim=-1).to(torch.uint8)
        return out.reshape(*codes.shape[:-1], codes.shape[-1] // 8 * 3)
    per = 8 // bits
    if per == 1:
        return codes
    c = codes.view(*codes.shape[:-1], codes.shape[-1] // per, per)
    out = c[..., 0].clone()
    for j in range(1, per):
        out |= c[..., j] << (bits * j)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``(..., n)`` bytes to ``(..., n * 8 // bits)`` codes."""
    if bits == 3:
        b = packed.view(*packed.shape[:-1], packed.shape[-1] // 3, 3).to(torch.int32)
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        codes = torch.stack([(word >> (3 * j)) & 7 for j in range(8)], dim=-1).to(torch.uint8)
        return codes.reshape(*packed.shape[:-1], packed.shape[-1] // 3 * 8)
    per = 8 // bits
    if per == 1:
        return packed
    mask = (1 << bits) - 1
    # one shift-and-mask per code slot: several times faster on CPU than a broadcast over a shift vector
    codes = torch.stack([(packed >> (bits * j)) & mask for j in range(per)], dim=-1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def _grouped(x: torch.Tensor, group_size: int, axis: str) -> torch.Tensor:
    """``(B, H, n, D)`` -> groups on the last dimension (see :class:`PackedTensor`).

    Raises
    ------
    ValueError
        If the grouped dimension (``D`` along ``"token"``, ``n`` along ``"channel"``) is not a multiple of
        ``group_size``.
    """
    b, h, n, d = x.shape
    size, what = (d, "head_dim") if axis == "token" else (n, "the token count")
    if size % group_size:
        raise ValueError(
            f"min-max groups of group_size={group_size} along axis={axis!r} need {what} to be a multiple of "
            f"{group_size}; got {size}"
        )
    if axis == "token":
        return x.reshape(b, h, n, d // group_size, group_size)
    return x.reshape(b, h, n // group_size, group_size, d).transpose(-1, -2)


def _ungrouped(g: torch.Tensor, axis: str, shape: tuple[int, int, int, int]) -> torch.Tensor:
    if axis == "token":
        return g.reshape(shape)
    return g.transpose(-1, -2).reshape(shape)


#: alternating least-squares rounds of ``fit="mse"`` (docs/explanation/quantization.md, "Fitted ranges")
MSE_ROUNDS = 4


def quantize_groups(
    g: torch.Tensor, bits: int, mdtype: torch.dtype, fit: str = "minmax", *, backend: Any = "torch"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric quantization of the last dimension of ``g`` on a uniform grid of ``2**bits`` points.

    ``fit="minmax"``: the grid spans each group's extremes, so every element is within half a step
    of its code. ``fit="mse"``: the grid's minimum and step are refitted for the least squared error
    (:func:`fit_range`); extreme elements may then be clamped to the grid's ends. Each group keeps
    whichever of the two stores the smaller squared error (computed in float32 from the stored
    metadata), so a fitted group never holds more error than its min-max grid would.

    Metadata range: a group whose min-max grid does not fit ``mdtype`` (its minimum, rounded down, below
    ``-finfo(mdtype).max``, or its scale ``(max - min) / (2**bits - 1)``, rounded up, above
    ``finfo(mdtype).max``; e.g. float32 groups reaching about ±65504 with float16 metadata) is refused
    with :class:`~kvpolicy.errors.MetadataOverflowError`, whichever ``fit``, rather than returned as
    ``inf`` metadata: the check the built-in backends' ``quantize`` runs (:func:`metadata_check`). It
    runs where finite input can overflow ``mdtype`` (``mdtype`` holds smaller magnitudes than
    ``g.dtype``: one reduction over the metadata and one host synchronisation); elsewhere the metadata
    holds every group (float16 input: ``(max - min) / 3 <= 43669``) except groups within a factor of
    about 2 of float32's maximum (``max - min`` overflows float32 itself), which are left to the caller
    (a cache's ``Quantize(check_finite=True)`` checks them). Non-finite ``g`` is not refused: its
    groups come back with non-finite metadata.

    Parameters
    ----------
    g : torch.Tensor
        ``(..., n)`` floating point: groups of ``n`` elements on the last dimension.
    bits : int
        Code width, 2 to 8.
    mdtype : torch.dtype
        The floating-point dtype scales and minimums are stored in.
    fit : {"minmax", "mse"}
        How each group's range is chosen (:data:`~kvpolicy.backends.base.FITS`).
    backend : Backend or str
        The backend an overflow error names (and whose ``meta_dtypes`` its remedy offers).

    Returns
    -------
    codes : torch.Tensor
        ``uint8`` codes in ``[0, 2**bits - 1]``, same shape as ``g``.
    scales, zeros : torch.Tensor
        ``g.shape[:-1]`` in ``mdtype``.

    Raises
    ------
    ConfigError
        If ``bits``, ``mdtype`` or ``fit`` is not one allowed.
    MetadataOverflowError
        If finite ``g`` has a group whose min-max grid does not fit ``mdtype`` (see above).
    """
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ConfigError(f"quantize_groups: bits must be an integer from 2 to 8 (uint8 codes); got bits={bits!r}")
    if not isinstance(mdtype, torch.dtype) or not mdtype.is_floating_point:
        raise ConfigError(f"quantize_groups: mdtype must be a floating-point torch.dtype; got mdtype={mdtype!r}")
    if fit not in FITS:
        raise ConfigError(f"quantize_groups: fit must be one of {list(FITS)}; got fit={fit!r}")
    qmax = (1 << bits) - 1
    gf = g.float()
    lo = gf.amin(dim=-1)
    hi = gf.amax(dim=-1)
    codes, scales, zeros = _encode(gf, lo, hi, qmax, mdtype)
    # the min-max grid is refused or kept before any fitting: a fitted grid is chosen only where its
    # (finite) error is below the min-max grid's, so what passes here comes back finite either way
    metadata_check(backend, g, scales, zeros)
    if fit == "minmax":
        return codes, scales, zeros
    lo_f, step_f = fit_range(gf, lo, (hi - lo) / qmax, qmax, MSE_ROUNDS)
    codes_f, scales_f, zeros_f = _encode(gf, lo_f, lo_f + qmax * step_f, qmax, mdtype)
    better = _squared_error(gf, codes_f, scales_f, zeros_f) < _squared_error(gf, codes, scales, zeros)
    return (torch.where(better.unsqueeze(-1), codes_f, codes), torch.where(better, scales_f, scales),
            torch.where(better, zeros_f, zeros))  # fmt: skip


def fit_range(
    gf: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, qmax: int, rounds: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Refit each group's grid ``lo + step · c`` (``c`` in ``0..qmax``) for the least squared error.

    Alternating least squares (Lloyd's iteration for a uniform grid): round every element to its
    nearest grid point, then solve the 2 × 2 least-squares problem for ``lo`` and ``step`` given
    those codes. Neither half raises the squared error, so it falls from the start's. A group whose
    codes are all equal, or whose refit step is not positive or finite, keeps its previous grid.

    Parameters
    ----------
    gf : torch.Tensor
        ``(..., n)`` float32, the groups.
    lo, step : torch.Tensor
        ``(...)``: the starting grid (min-max: the minimum and ``(max − min) / qmax``).
    qmax : int
        The top code.
    rounds : int
        Iterations.

    Returns
    -------
    lo, step : torch.Tensor
        ``(...)`` float32, the refitted grid.
    """
    n = gf.shape[-1]
    sum_x = gf.sum(dim=-1)
    for _ in range(rounds):
        inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
        c = ((gf - lo.unsqueeze(-1)) * inv.unsqueeze(-1)).round_().clamp_(0, qmax)
        sum_c = c.sum(dim=-1)
        den = n * (c * c).sum(dim=-1) - sum_c * sum_c
        ok = den > 0
        new_step = (n * (c * gf).sum(dim=-1) - sum_c * sum_x) / torch.where(ok, den, torch.ones_like(den))
        new_lo = (sum_x - new_step * sum_c) / n
        ok &= (new_step > 0) & torch.isfinite(new_step) & torch.isfinite(new_lo)
        step = torch.where(ok, new_step, step)
        lo = torch.where(ok, new_lo, lo)
    return lo, step


def _encode(
    gf: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, qmax: int, mdtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes and metadata of the grid from ``lo`` to ``hi``: the minimum rounded down and the scale
    rounded up to ``mdtype``, so the stored grid still spans ``[lo, hi]``."""
    zeros = _round_down(lo, mdtype)
    z = zeros.float()
    scales = _round_up((hi - z) / qmax, mdtype)
    s = scales.float()
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    codes = ((gf - z.unsqueeze(-1)) * inv.unsqueeze(-1)).round_().clamp_(0, qmax).to(torch.uint8)
    return codes, scales, zeros


def _squared_error(gf: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Per group, ``Σ (zero + scale · code − x)²`` in float32 from the stored metadata."""
    back = zeros.float().unsqueeze(-1) + scales.float().unsqueeze(-1) * codes.float()
    return (back - gf).square_().sum(dim=-1)


def dequantize_groups(q: PackedTensor) -> torch.Tensor:
    """float32 values of ``q`` in its grouped layout (see :class:`PackedTensor`)."""
    codes = unpack(q.codes, q.bits).float()
    return codes.mul_(q.scales.float().unsqueeze(-1)).add_(q.zeros.float().unsqueeze(-1))


def quantize_packed(
    backend: Any, x: torch.Tensor, bits: int, group_size: int, axis: str, mdt: torch.dtype, fit: str
) -> PackedTensor:
    """Min-max groups of ``x`` (:func:`quantize_groups`) packed into a :class:`PackedTensor`, their
    metadata in ``mdt`` checked for overflow in the name of ``backend`` (by :func:`quantize_groups`): the
    ``torch`` backend's ``quantize``, and any backend storing its format that runs this code (``cpu``;
    ``triton`` for ``fit="mse"``)."""
    shape = tuple(x.shape)
    codes, scales, zeros = quantize_groups(_grouped(x, group_size, axis), bits, mdt, fit, backend=backend)
    # contiguous storage: unpacking a transposed (per-channel) view is markedly slower on CPU
    packed = pack(codes, bits).contiguous()
    return PackedTensor(packed, scales.contiguous(), zeros.contiguous(), bits, group_size, axis, shape, x.dtype)  # type: ignore[arg-type]


#: the grouping axis of each role when none is given (KIVI's: keys per channel, values per token)
DEFAULT_AXIS = {"key": "channel", "value": "token"}
#: group size by grouping axis when none is given: 128 tokens per channel, 64 channels per token;
#: docs/explanation/quantization.md measures the alternatives (with min-max key ranges, 64-token groups lose less
#: than 128-token ones; with fitted key ranges, the default, 128-token groups lose less than min-max
#: 64-token groups, and hold fewer bytes from about 4,000 tokens on)
DEFAULT_GROUP_SIZE = {"channel": 128, "token": 64}
#: how keys' groups choose their range when no fit is given (docs/explanation/quantization.md, "Fitted ranges")
DEFAULT_KEY_FIT = "mse"
#: the fit of each role when none is given
DEFAULT_FIT = {"key": DEFAULT_KEY_FIT, "value": "minmax"}


@dataclass(frozen=True)
class MinMax(Format):
    """Asymmetric min-max groups, bit-packed (:class:`PackedTensor`).

    Parameters
    ----------
    bits : int
        Code width, 1 to 8 (which widths a backend packs: its ``capabilities.bits``; the reference packs
        2, 3, 4 and 8).
    group_size : int
        Elements sharing one scale and minimum: channels of one token (``axis="token"``) or tokens of
        one channel (``axis="channel"``).
    axis : {"token", "channel"}
        The grouping axis.
    fit : {"minmax", "mse"}
        How each group's range is chosen (:func:`quantize_groups`).
    meta_dtype : {"auto", "float16", "bfloat16", "float32"}
        The dtype of scales and minimums (:func:`~kvpolicy.formats.base.resolve_meta_dtype`).
    """

    bits: int
    group_size: int  # type: ignore[assignment]
    axis: str = "token"  # type: ignore[assignment]
    fit: str = "minmax"  # type: ignore[assignment]
    meta_dtype: str = "auto"

    name: ClassVar[str] = "minmax"
    block: ClassVar[type[QTensor]] = PackedTensor
    grouped: ClassVar[bool] = True
    bits_allowed: ClassVar[tuple[int, ...]] = (1, 2, 3, 4, 5, 6, 7, 8)

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= 8:
            raise ConfigError(f"MinMax: bits must be an int between 1 and 8; got bits={self.bits!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ConfigError(f"MinMax: group_size must be a positive integer; got group_size={self.group_size!r}")
        if self.axis not in AXES:
            raise ConfigError(f"MinMax: axis must be one of {list(AXES)}; got axis={self.axis!r}")
        if self.fit not in FITS:
            raise ConfigError(f"MinMax: fit must be one of {list(FITS)}; got fit={self.fit!r}")
        check_meta_dtype_option("MinMax", self.meta_dtype)

    @classmethod
    def for_role(cls, role: str, options: dict[str, Any]) -> tuple[MinMax, tuple[str, ...]]:
        """The role's format, with KIVI's axes (:data:`DEFAULT_AXIS`), the group size of the axis
        (:data:`DEFAULT_GROUP_SIZE`) and fitted key ranges (:data:`DEFAULT_KEY_FIT`) where not given; the
        defaults filled that :meth:`serving` may replace: the group size, and the keys' fit."""
        axis = options.get("axis", DEFAULT_AXIS[role])
        defaults = {"axis": axis, "group_size": DEFAULT_GROUP_SIZE.get(axis, 1), "fit": DEFAULT_FIT[role]}
        filled = [o for o in ("fit", "group_size") if o not in options and (o != "fit" or role == "key")]
        return cls(**{**defaults, **options}), tuple(filled)

    def serving(
        self, backend: Any, role: str, head_dim: int | None, defaulted: tuple[str, ...]
    ) -> tuple[MinMax, tuple[str, ...], tuple[str, ...]]:
        """Replace a defaulted fit the backend does not serve by ``"minmax"``, and a defaulted per-token group
        size that does not divide the head dim by the largest divisor of it below, a multiple of the backend's
        ``group_size_multiple`` (head_dim 48: 48, 80: 40, 96: 48), when one exists."""
        fmt, replaced, notes = self, [], []
        if "fit" in defaulted and self.fit != "minmax" and not backend.serves(self, role):
            plain = dataclasses.replace(self, fit="minmax")
            if backend.serves(plain, role):
                fmt = plain
                replaced.append("fit")
                notes.append(f"{role}_fit='minmax' (backend {backend.name!r} does not fit ranges with the default "
                             f"{self.fit!r})")  # fmt: skip
        if "group_size" in defaulted and head_dim is not None and self.axis == "token" and head_dim % self.group_size:
            mult = backend.capabilities.group_size_multiple
            fitting = [g for g in range(mult, min(self.group_size, head_dim) + 1, mult) if head_dim % g == 0]
            if fitting:
                fmt = dataclasses.replace(fmt, group_size=fitting[-1])
                replaced.append("group_size")
                notes.append(f"{role}_group_size={fitting[-1]} (the default {self.group_size} does not divide the "
                             f"{role} head_dim {head_dim})")  # fmt: skip
        return fmt, tuple(replaced), tuple(notes)

    @classmethod
    def examples(cls, backend: Any) -> list[MinMax]:
        """Every width and axis the backend's capabilities list, in groups of 32 (or the smallest multiple of
        its granularity dividing 64)."""
        caps = backend.capabilities
        mult = max(caps.group_size_multiple, 8)
        group = 32 if 32 % mult == 0 else next(g for g in range(mult, 65, mult) if 64 % g == 0)
        return [cls(bits, group, axis) for bits in caps.bits for axis in caps.axes]

    def quantize(self, x: torch.Tensor, backend: Any = "torch", centre: torch.Tensor | None = None) -> PackedTensor:
        """Min-max groups of ``x`` packed into a :class:`PackedTensor` (:func:`quantize_packed`).

        Raises
        ------
        ConfigError
            If a centre is given (min-max groups carry their own zero-point), or 3-bit groups do not
            hold whole runs of eight codes.
        MetadataOverflowError
            If finite ``x`` gives a non-finite scale or minimum in the metadata dtype.
        """
        name = backend_name(backend)
        if centre is not None:
            raise ConfigError(f"backend {name!r}: a centre applies to scheme='codebook' only; got scheme='minmax'")
        if self.bits == 3 and self.group_size % 8:
            raise ConfigError(
                f"backend {name!r} packs 3-bit codes eight to three bytes: group_size must be a multiple of 8 "
                f"with bits=3; got group_size={self.group_size}"
            )
        mdt = resolve_meta_dtype(self.meta_dtype, x.dtype)
        return quantize_packed(backend, x, self.bits, self.group_size, self.axis, mdt, self.fit)
