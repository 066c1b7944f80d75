"""Codebook blocks: a per-vector norm and Lloyd-Max indices (the ``"codebook"`` scheme).

After a randomized rotation (``transform="hadamard"``) the coordinates of a key or value vector are
close to Gaussian, with a variance set by the vector's norm. The codebook scheme stores, per token
and head,

- one scale ``s`` (in the metadata dtype, 16 bits by default), and
- ``head_dim`` indices of ``bits`` bits each into the Lloyd-Max codebook ``C`` of the standard
  normal distribution (the scalar quantizer with the least mean squared error for it),

and reconstructs ``x̂ = s · C[codes]``. To quantize, ``x`` is scaled to unit variance per coordinate
(``u = x · √D / ‖x‖``), each coordinate takes the nearest centroid, and ``s = ‖x‖ / ‖C[codes]‖``: the
reconstruction keeps the vector's norm exactly (the *norm correction*; without it ``s = ‖x‖ / √D``
and the reconstruction's norm is biased low by the quantization's lost energy). There is no
per-group zero-point: bits per element are ``bits + 16 / head_dim`` (2.25 at 2 bits with
``head_dim=64``), against ``bits + 32 / G`` for min-max groups of ``G``.

With ``norm_bits=8`` (:class:`Codebook`, and any :class:`ScaledFormat`) the scale is a one-byte log-scale code
instead (``bits + 8 / head_dim`` bits per element, plus one 16-bit base per batch row and head of a stream,
:attr:`ScaledBlock.scale_base`; :mod:`kvpolicy.formats.scale_codes`).

This is TurboQuant's MSE stage (arXiv 2504.19874) with the norm correction of vLLM's implementation.
Decode attention reads the codes directly (:func:`attend`): scores are the rotated query against the
centroid values, times each key's scale; the output is the probabilities times each value's scale
against the value centroids.

A block may also hold a *centre* ``μ`` (one vector per batch row and head, in the metadata dtype),
subtracted before quantizing and added back: ``x̂ = μ + s · C[codes]``. Keys share a large offset
that RoPE turns only slowly (their outlier channels), which otherwise costs the codebook its
resolution; a stream centres every block on the mean of its first block (``Quantize(key_centre=True)``,
see docs/explanation/quantization.md). Attention reads a centred block at no extra pass: a key centre adds
``q · μ`` to every score of the block, which leaves the block's softmax unchanged and shifts its
log-sum-exp; a value centre adds ``μ`` to the block's output (its probabilities sum to one).

Guarantee: each coordinate of ``u`` goes to the centroid of the Lloyd-Max cell it lies in (ties at a
boundary go up); float noise in the rotation can move a coordinate that lies within rounding of a
boundary to the neighbouring cell, so the codes of two runs that differ in float noise agree except
at such coordinates.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvpolicy import state_check
from kvpolicy.errors import ConfigError, MetadataOverflowError, NonFiniteError
from kvpolicy.formats.base import (
    Format,
    QTensor,
    backend_meta_dtypes,
    backend_name,
    check_bits,
    check_meta_dtype_option,
    check_metadata,
    in_dtype,
    metadata_may_overflow,
    resolve_meta_dtype,
    widen_remedy,
)
from kvpolicy.formats.packed import pack, unpack
from kvpolicy.formats.scale_codes import BASE_MAX, BASE_MIN, decode_scales, encode_scales, rebase

#: code widths the codebook scheme serves
CODEBOOK_BITS = (2, 3, 4)
#: widths of the per-vector scale: the metadata dtype (16 bits) or a one-byte log-scale code
NORM_BITS = (16, 8)
#: Lloyd iterations: the cells of a 4-bit codebook settle to float64 precision well before this
_ITERATIONS = 3000


def _pdf(x: float) -> float:
    return 0.0 if math.isinf(x) else math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


@functools.cache
def lloyd_max(bits: int) -> tuple[tuple[float, ...], tuple[float, ...], float]:
    """The Lloyd-Max quantizer of the standard normal distribution with ``2**bits`` levels.

    Computed by Lloyd's iteration with exact Gaussian cell integrals (float64): boundaries are the
    midpoints of neighbouring centroids, centroids the conditional means of their cells.

    Returns
    -------
    centroids : tuple of float
        ``2**bits`` levels, increasing, symmetric about 0.
    boundaries : tuple of float
        ``2**bits - 1`` cell boundaries, increasing.
    mse : float
        The expected squared error ``E[(X - Q(X))²]`` for ``X ~ N(0, 1)`` (2 bits: 0.1175, 3 bits:
        0.03454, 4 bits: 0.009497).
    """
    if bits not in CODEBOOK_BITS:
        raise ConfigError(f"codebook: bits must be one of {list(CODEBOOK_BITS)}; got bits={bits!r}")
    levels = 1 << bits
    # start from the centres of equal-probability cells
    centroids = [math.sqrt(2.0) * _erfinv(2.0 * (i + 0.5) / levels - 1.0) for i in range(levels)]
    for _ in range(_ITERATIONS):
        edges = [-math.inf, *((a + b) / 2 for a, b in itertools.pairwise(centroids)), math.inf]
        centroids = [(_pdf(lo) - _pdf(hi)) / (_cdf(hi) - _cdf(lo)) for lo, hi in itertools.pairwise(edges)]
    edges = [-math.inf, *((a + b) / 2 for a, b in itertools.pairwise(centroids)), math.inf]
    cells = zip(centroids, itertools.pairwise(edges), strict=True)
    energy = sum((_cdf(hi) - _cdf(lo)) * c * c for c, (lo, hi) in cells)
    return tuple(centroids), tuple(edges[1:-1]), 1.0 - energy


def _erfinv(y: float) -> float:
    """Inverse error function by Newton's method (only seeds the Lloyd iteration)."""
    x = 0.0
    for _ in range(60):
        x -= (math.erf(x) - y) / (2.0 / math.sqrt(math.pi) * math.exp(-x * x))
    return x


#: ``(bits, device)`` -> the codebook's centroids and cell boundaries, float32, built at their first use and
#: held from then on: never inference tensors, whatever mode that use came in, and a plain dict, which
#: ``torch.compile`` reads (a traced step finds the tables an eager step built, inputs of its graph) instead
#: of tracing their construction
_TABLES: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _tables(bits: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Centroids ``(2**bits,)`` and boundaries ``(2**bits - 1,)`` on ``device`` (a device's string), held in
    :data:`_TABLES`."""
    found = _TABLES.get((bits, device))
    if found is None:
        centroids, boundaries, _ = lloyd_max(bits)
        with torch.inference_mode(False):
            found = _TABLES[(bits, device)] = (
                torch.tensor(centroids, dtype=torch.float32, device=device),
                torch.tensor(boundaries, dtype=torch.float32, device=device),
            )
    return found


def centroids(bits: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The codebook ``C``: ``(2**bits,)`` float32 on ``device``."""
    return _tables(bits, str(torch.device(device)))[0]


@dataclass
class ScaledBlock(QTensor):
    """Per-token codes with one scale per vector and an optional centre shared by the block's tokens: the
    storage of codebook blocks (:class:`CodebookTensor`) and of any format whose codes index a table
    (:meth:`table`), whose subclasses say what the codes mean.

    Attributes
    ----------
    codes : torch.Tensor
        ``uint8``, ``(batch, kv_heads, tokens, head_dim * bits // 8)`` (packed as
        `~kvpolicy.formats.packed.pack` packs).
    scales : torch.Tensor
        ``(batch, kv_heads, tokens)`` in the metadata dtype; with 8-bit norms (:attr:`scale_base` set)
        ``uint8`` one-byte log-scale codes of them (:func:`~kvpolicy.formats.scale_codes.encode_scales`).
    centre : torch.Tensor or None
        ``(batch, kv_heads, 1, head_dim)`` in the metadata dtype: ``μ``, shared by every token of the
        block (``None``: no centre, ``μ = 0``).
    scale_base : torch.Tensor or None
        ``(batch, kv_heads, 1)`` int16: ``β`` of the one-byte scale codes, shared by every token of a
        batch row and head (``None``: scales held in the metadata dtype).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    bits: int
    shape: tuple[int, int, int, int]
    dtype: torch.dtype
    centre: torch.Tensor | None = None
    scale_base: torch.Tensor | None = None

    @property
    def norm_bits(self) -> int:
        """Bits of each stored scale: 8 (one-byte log-scale codes) or 16 (the metadata dtype; 32 with
        float32 metadata)."""
        return 8 if self.scale_base is not None else 16

    def tensors(self) -> dict[str, torch.Tensor]:
        """Codes and scales; the centre, an offset shared by every token, under ``zeros`` (the
        zero-points of memory reports); the one-byte scales' base under ``scale_base``."""
        out = {"codes": self.codes, "scales": self.scales}
        if self.centre is not None:
            out["zeros"] = self.centre
        if self.scale_base is not None:
            out["scale_base"] = self.scale_base
        return out

    def scale_values(self) -> torch.Tensor:
        """The scales ``s`` as float32 ``(batch, kv_heads, tokens)`` (one-byte codes decoded)."""
        if self.scale_base is None:
            return self.scales.float()
        return decode_scales(self.scales, self.scale_base)

    def unit_vectors(self) -> torch.Tensor:
        """The vectors the codes name before scaling: ``(batch, kv_heads, tokens, head_dim)`` float32."""
        raise NotImplementedError(f"{type(self).__name__} does not implement unit_vectors()")

    def table(self) -> torch.Tensor:
        """The table the codes index, float32 on the codes' device: ``(2**bits,)`` values, one code per
        channel (:func:`~kvpolicy.formats.packed.pack`-ed), or ``(2**(k * bits), k)`` points, one index per
        ``k`` channels stored as ``k`` digits of ``bits`` bits, lowest first, packed alike. What a kernel
        that reads scaled table codes (the ``cpu`` backend's) decodes them with."""
        raise NotImplementedError(f"{type(self).__name__} does not implement table()")

    def dequantize(self) -> torch.Tensor:
        """``μ + s · unit_vectors()`` in :attr:`dtype` (float16 clamped to ``±65504``)."""
        return in_dtype(scaled(self.unit_vectors(), self), self.dtype)

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> ScaledBlock:
        codes, scales = fn(self.codes), fn(self.scales)
        centre = None if self.centre is None else fn(self.centre)
        base = None if self.scale_base is None else fn(self.scale_base)
        return type(self)(codes, scales, self.bits, (codes.shape[0], *self.shape[1:]), self.dtype, centre, base)

    def select(self, index: torch.Tensor) -> ScaledBlock:
        """Tokens ``index`` (a 1-D index into the token axis), in that order; the centre is kept."""
        shape = (*self.shape[:2], int(index.numel()), self.shape[3])
        return type(self)(
            self.codes.index_select(2, index), self.scales.index_select(2, index), self.bits, shape, self.dtype,
            self.centre, self.scale_base,
        )  # fmt: skip

    def narrow(self, start: int, length: int) -> ScaledBlock:
        """Tokens ``[start, start + length)`` as a view (any range: every token stands alone)."""
        if start < 0 or length < 0 or start + length > self.shape[2]:
            raise ValueError(f"narrow(start={start}, length={length}) on a block of {self.shape[2]} tokens")
        sl = slice(start, start + length)
        return type(self)(
            self.codes[:, :, sl], self.scales[:, :, sl], self.bits, (*self.shape[:2], length, self.shape[3]),
            self.dtype, self.centre, self.scale_base,
        )  # fmt: skip

    @classmethod
    def cat(cls, blocks: list[QTensor]) -> ScaledBlock:  # type: ignore[override]
        """Blocks of one width and one centre concatenated along the token axis.

        Blocks of one-byte scales are re-expressed around the largest base of each batch row and head
        (:func:`~kvpolicy.formats.scale_codes.rebase`: the codes quantizing all their vectors together
        gives).

        Raises
        ------
        ValueError
            If the blocks differ in width, scale width or centre (a stream keeps one).
        """
        if len(blocks) == 1:
            return blocks[0]  # type: ignore[return-value]
        first: ScaledBlock = blocks[0]  # type: ignore[assignment]
        for b in blocks[1:]:
            assert isinstance(b, ScaledBlock)
            same = (b.centre is None) == (first.centre is None) and (
                b.centre is None or b.centre is first.centre or torch.equal(b.centre, first.centre)  # type: ignore[arg-type]
            )
            if b.bits != first.bits:
                raise ValueError(f"{cls.__name__}: blocks of {first.bits} and {b.bits} bits cannot be concatenated")
            if not same:
                raise ValueError(
                    f"{cls.__name__}: blocks with different centres cannot be concatenated (a stream keeps one)"
                )
            if b.norm_bits != first.norm_bits:
                raise ValueError(
                    f"{cls.__name__}: blocks with {first.norm_bits}-bit and {b.norm_bits}-bit norms cannot be "
                    "concatenated"
                )
        shape = (*first.shape[:2], sum(b.shape[2] for b in blocks), first.shape[3])
        parts: list[ScaledBlock] = blocks  # type: ignore[assignment]
        base = None
        if first.scale_base is not None:
            base = torch.stack([b.scale_base for b in parts]).amax(dim=0)  # type: ignore[misc]
            scales = torch.cat([rebase(b.scales, b.scale_base, base) for b in parts], dim=2)  # type: ignore[arg-type]
        else:
            scales = torch.cat([b.scales for b in parts], dim=2)
        return cls(
            torch.cat([b.codes for b in parts], dim=2), scales, first.bits, shape, first.dtype, first.centre, base
        )


@dataclass
class CodebookTensor(ScaledBlock):
    """Bit-packed Lloyd-Max indices with one scale per vector (:class:`ScaledBlock`): ``scales`` are
    ``‖x − μ‖ / ‖C[codes]‖``."""

    def unit_vectors(self) -> torch.Tensor:
        """The centroid vectors ``C[codes]`` (:func:`unit_vectors`)."""
        return unit_vectors(self)

    def table(self) -> torch.Tensor:
        """The codebook ``C``, ``(2**bits,)`` (:func:`centroids`)."""
        return centroids(self.bits, self.codes.device)

    def scores(self, query: torch.Tensor) -> torch.Tensor:
        """The query against the centroid values times each key's scale, plus ``q · μ`` (:func:`key_scores`)."""
        return key_scores(query, self)

    def mix(self, probs: torch.Tensor) -> torch.Tensor:
        """The probabilities times each value's scale against the value centroids, plus ``μ`` (:func:`value_mix`)."""
        return value_mix(probs, self)

    layouts: ClassVar[tuple[str, ...]] = ("codebook-v1", "codebook-v2", "codebook-v3")

    def state(self) -> dict:
        """:func:`state`."""
        return state(self)

    @classmethod
    def from_state(cls, saved: dict) -> CodebookTensor:
        """:func:`from_state`."""
        return from_state(saved)


def scales_may_overflow(dtype: torch.dtype, mdtype: torch.dtype) -> bool:
    """Whether finite vectors of ``dtype`` can give scales (or a centre) beyond the range of ``mdtype``.

    Always with float16 metadata: a scale ``‖x − μ‖ / ‖C[codes]‖`` can exceed the largest coordinate
    (a vector of equal coordinates ``a`` scales by ``a / |c|``, ``c`` the centroid nearest 1: 0.7560 at
    3 bits, 0.9424 at 4), and ``x − μ`` can double it, so float16 vectors near ±65504 overflow float16
    scales. Otherwise where :func:`~kvpolicy.formats.base.metadata_may_overflow` says so: with
    bfloat16 or float32 metadata only vectors within a small factor of float32's maximum overflow
    (their norm overflows float32 itself), which are left to ``Quantize(check_finite=True)``.
    """
    return mdtype == torch.float16 or metadata_may_overflow(dtype, mdtype)


def unit_variance(
    x: torch.Tensor, mdtype: torch.dtype, centre: torch.Tensor | None, what: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``x − μ`` scaled to unit variance per coordinate, as a scaled-block quantizer starts.

    Parameters
    ----------
    x : torch.Tensor
        ``(batch, kv_heads, tokens, head_dim)``.
    mdtype : torch.dtype
        The metadata dtype the centre is stored in (the rounded centre is the one subtracted).
    centre : torch.Tensor or None
        ``(batch, kv_heads, 1, head_dim)``, or ``None``.
    what : str
        The format's name, for the message.

    Returns
    -------
    u : torch.Tensor
        ``(x − μ) · √D / ‖x − μ‖`` float32, same shape as ``x`` (zero vectors stay zero).
    norm : torch.Tensor
        ``‖x − μ‖``, ``(batch, kv_heads, tokens)`` float32.
    centre : torch.Tensor or None
        The centre in ``mdtype``, contiguous.
    """
    d = x.shape[-1]
    xf = x.float()
    if centre is not None:
        want = (*x.shape[:2], 1, d)
        if tuple(centre.shape) != want:
            raise ValueError(f"{what}: a centre for vectors of shape {tuple(x.shape)} has shape {want}; got "
                             f"{tuple(centre.shape)}")  # fmt: skip
        centre = centre.to(mdtype).contiguous()
        xf = xf - centre.float()
    norm = torch.linalg.vector_norm(xf, dim=-1)  # (B, H, n)
    u = xf * (math.sqrt(d) / norm.clamp_min(torch.finfo(torch.float32).tiny)).unsqueeze(-1)
    return u, norm, centre


def store_scales(
    x: torch.Tensor, exact: torch.Tensor, mdtype: torch.dtype, centre: torch.Tensor | None, backend: Any,
    remedy: Callable[[torch.dtype], str] | None, norm_bits: int = 16,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The scales of ``x`` as a scaled-block quantizer stores them, checked.

    Parameters
    ----------
    x : torch.Tensor
        The vectors quantized, ``(batch, kv_heads, tokens, head_dim)``.
    exact : torch.Tensor
        Their float32 scales, ``(batch, kv_heads, tokens)``.
    mdtype : torch.dtype
        The metadata dtype (of the scales with ``norm_bits=16``, of the centre always).
    centre : torch.Tensor or None
        The centre held, in ``mdtype``.
    backend : Backend or str
        The backend (or its name) error messages name.
    remedy : callable or None
        ``remedy(mdtype)`` says what to do on overflow (default:
        :func:`~kvpolicy.formats.base.widen_remedy` over ``backend``'s metadata dtypes).
    norm_bits : {16, 8}
        16: ``exact`` in ``mdtype``; 8: one-byte codes (:func:`~kvpolicy.formats.scale_codes.encode_scales`).

    Returns
    -------
    scales : torch.Tensor
        ``(batch, kv_heads, tokens)``: ``mdtype``, or ``uint8`` codes.
    base : torch.Tensor or None
        The codes' base, ``(batch, kv_heads, 1)`` int16 (``None`` with ``norm_bits=16``).

    Raises
    ------
    MetadataOverflowError
        If finite ``x`` gave non-finite scales or a non-finite centre, wherever that can happen
        (:func:`scales_may_overflow`); with 8-bit norms, a finite vector whose norm overflows float32.
    NonFiniteError
        With 8-bit norms, a vector holding NaN or Inf (a one-byte code has no NaN to store).
    """
    base = None
    if norm_bits == 8:
        scales, base = _one_byte_scales(x, exact, backend_name(backend))
    else:
        scales = exact.to(mdtype)
    if scales_may_overflow(x.dtype, mdtype):
        if remedy is not None:
            why = remedy(mdtype)
        else:
            why = widen_remedy(mdtype, ("float32",) if isinstance(backend, str) else backend_meta_dtypes(backend))
        meta = {} if base is not None else {"scales": scales}
        if centre is not None:
            meta["centre"] = centre
        check_metadata(backend_name(backend), x, meta, why)
    return scales.contiguous(), base


def _one_byte_scales(x: torch.Tensor, scales: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`encode_scales` of the float32 ``scales`` of ``x``; what a code cannot hold is refused with the
    error that says why (non-finite input, or a norm beyond float32)."""
    try:
        return encode_scales(scales)
    except ValueError as exc:
        if not bool(torch.isfinite(x).all()):
            raise NonFiniteError(
                f"backend {backend!r}: vectors holding NaN or Inf reached the quantizer; one-byte scales "
                "(norm_bits=8) have no code for a non-finite scale. Fix the model inputs/dtype, or keep "
                "Quantize(check_finite=True), which refuses them first"
            ) from None
        raise MetadataOverflowError(
            f"backend {backend!r}: finite vectors have a norm beyond float32's range (largest |value| "
            f"{float(x.detach().abs().amax()):.4g}): {exc}; one-byte scales (norm_bits=8) decode in float32. The "
            "model's keys/values are overflowing; check the model and the dtype it runs in"
        ) from None


def quantize(x: torch.Tensor, bits: int, mdtype: torch.dtype, backend: Any = "torch",
             remedy: Callable[[torch.dtype], str] | None = None,
             centre: torch.Tensor | None = None, norm_bits: int = 16) -> CodebookTensor:  # fmt: skip
    """Quantize ``x`` ``(batch, kv_heads, tokens, head_dim)`` to a :class:`CodebookTensor`.

    Parameters
    ----------
    x : torch.Tensor
        The vectors, in the rotated basis (their coordinates close to Gaussian).
    bits : int
        Index width, one of :data:`CODEBOOK_BITS`; ``head_dim * bits`` must be a multiple of 8.
    mdtype : torch.dtype
        The dtype of the per-vector scales.
    backend : Backend or str
        The backend (or its name) error messages name.
    remedy : callable, optional
        ``remedy(mdtype)``: what to do when a scale overflows ``mdtype`` (see
        :func:`~kvpolicy.formats.base.widen_remedy`).
    centre : torch.Tensor, optional
        ``μ``, ``(batch, kv_heads, 1, head_dim)``: quantize ``x − μ`` and keep ``μ`` (stored in
        ``mdtype``; the rounded ``μ`` is the one subtracted, so ``x̂ = μ + s · C[codes]`` holds for
        the stored ``μ``).
    norm_bits : {16, 8}
        16: scales in ``mdtype``; 8: one-byte log-scale codes of ``‖x − μ‖ / ‖C[codes]‖``
        (:mod:`kvpolicy.formats.scale_codes`, whose docstring gives the error bounds).

    Raises
    ------
    MetadataOverflowError
        If a finite vector's scale, or the centre, does not fit ``mdtype``; checked wherever it can
        (:func:`scales_may_overflow`: always with float16 metadata, float16 input included). With 8-bit
        norms: a finite vector whose norm overflows float32 (within a small factor of 3.4e38).
    NonFiniteError
        With 8-bit norms, a vector holding NaN or Inf (a one-byte code has no NaN to store).
    """
    d = x.shape[-1]
    if (d * bits) % 8 or (bits == 3 and d % 8):
        raise ConfigError(
            f"codebook: head_dim={d} with bits={bits} does not pack into whole bytes; head_dim must be a multiple of 8"
        )
    table, edges = _tables(bits, str(x.device))
    u, norm, centre = unit_variance(x, mdtype, centre, "codebook")
    codes = torch.bucketize(u, edges, right=True).to(torch.uint8)
    recon_norm = torch.linalg.vector_norm(table[codes.long()], dim=-1)
    exact = norm / recon_norm  # recon_norm > 0: no centroid is 0 at an even level count
    scales, base = store_scales(x, exact, mdtype, centre, backend, remedy, norm_bits)
    shape: tuple[int, int, int, int] = tuple(x.shape)  # type: ignore[assignment]
    return CodebookTensor(pack(codes, bits).contiguous(), scales, bits, shape, x.dtype, centre, base)


def unit_vectors(q: CodebookTensor) -> torch.Tensor:
    """The centroid vectors ``C[codes]``: ``(batch, kv_heads, tokens, head_dim)`` float32."""
    return centroids(q.bits, q.codes.device)[unpack(q.codes, q.bits).long()]


def scaled(unit: torch.Tensor, q: ScaledBlock) -> torch.Tensor:
    """``μ + s · unit`` in float32 (``unit``: ``q``'s unit vectors, ``(batch, kv_heads, tokens, head_dim)``,
    overwritten)."""
    out = unit.mul_(q.scale_values().unsqueeze(-1))
    return out if q.centre is None else out.add_(q.centre.float())


def dequantize(q: CodebookTensor) -> torch.Tensor:
    """``μ + s · C[codes]`` in float32, ``(batch, kv_heads, tokens, head_dim)``."""
    return scaled(unit_vectors(q), q)


def centre_score(query: torch.Tensor, keys: CodebookTensor) -> torch.Tensor | None:
    """``q · μ`` of a centred key block, ``(B, H, nq)`` float32 (``None`` for a block without a centre):
    what the centre adds to every score of the block, hence to its log-sum-exp.

    ``query`` ``(B, H, nq, D)`` float32 (already scaled).
    """
    if keys.centre is None:
        return None
    return torch.matmul(query, keys.centre.float().transpose(-1, -2)).squeeze(-1)


def key_scores(query: torch.Tensor, keys: CodebookTensor) -> torch.Tensor:
    """``query · k̂`` for every key from the codes: ``(q · C[codes]) · s + q · μ``.

    ``query`` ``(B, H, nq, D)`` float32 (already scaled); returns ``(B, H, nq, n)`` float32.
    """
    scores = torch.matmul(query, unit_vectors(keys).transpose(-1, -2)).mul_(keys.scale_values().unsqueeze(-2))
    shift = centre_score(query, keys)
    return scores if shift is None else scores.add_(shift.unsqueeze(-1))


def value_mix(probs: torch.Tensor, values: CodebookTensor) -> torch.Tensor:
    """``probs @ v̂`` from the codes: ``(probs · s) @ C[codes] + μ``; ``probs`` ``(B, H, nq, n)`` float32,
    each row summing to one (a block's own softmax: the centre enters once per row)."""
    out = torch.matmul(probs * values.scale_values().unsqueeze(-2), unit_vectors(values))
    return out if values.centre is None else out.add_(values.centre.float())


#: saved block layouts: ``codebook-v1`` without a centre, ``codebook-v2`` with one (a reader that
#: knows only v1 refuses a centred block instead of dropping its centre), ``codebook-v3`` with one-byte
#: scales and their ``scale_base`` (a centre optional; older readers refuse it instead of misreading
#: the codes as scales)
LAYOUTS = ("codebook-v1", "codebook-v2", "codebook-v3")


def state(q: CodebookTensor) -> dict:
    """``q`` as JSON values and tensors (layout ``codebook-v1``, ``codebook-v2`` with a centre, or
    ``codebook-v3`` with one-byte scales)."""
    out = {
        "layout": "codebook-v1", "codes": q.codes, "scales": q.scales, "bits": q.bits, "shape": list(q.shape),
        "dtype": str(q.dtype).removeprefix("torch."),
    }  # fmt: skip
    if q.centre is not None:
        out.update(layout="codebook-v2", centre=q.centre)
    if q.scale_base is not None:
        out.update(layout="codebook-v3", scale_base=q.scale_base)
    return out


def from_state(saved: dict) -> CodebookTensor:
    """The block :func:`state` described, its tensor shapes checked."""
    state_check.entries(
        saved, "codebook block", ("layout", "codes", "scales", "bits", "shape", "dtype"), ("centre", "scale_base")
    )
    layout = state_check.choice(saved["layout"], "block layout", LAYOUTS)
    bits = state_check.choice(saved["bits"], "codebook block bits", CODEBOOK_BITS)
    b, h, n, d = state_check.shape4(saved["shape"], "a block's shape")
    dtype = state_check.float_dtype(saved["dtype"], "a block's dtype")
    if d * bits % 8:
        raise ValueError(f"a codebook block of head_dim {d} at {bits} bits does not fill whole bytes")
    codes = state_check.tensor(saved["codes"], "block codes")
    scales = state_check.tensor(saved["scales"], "block scales")
    if tuple(codes.shape) != (b, h, n, d * bits // 8) or tuple(scales.shape) != (b, h, n):
        raise ValueError(
            f"codebook block tensors have shapes codes {tuple(codes.shape)}, scales {tuple(scales.shape)}; a block "
            f"of shape {(b, h, n, d)} at {bits} bits needs {(b, h, n, d * bits // 8)} and {(b, h, n)}"
        )
    if codes.dtype != torch.uint8:
        raise ValueError(f"block codes must be uint8; got {codes.dtype}")
    if layout == "codebook-v1" and "centre" in saved:
        raise ValueError("a codebook-v1 block has no centre (codebook-v2 blocks do)")
    if layout != "codebook-v3" and "scale_base" in saved:
        raise ValueError(f"a {layout} block has no scale_base (codebook-v3 blocks do)")
    centre = saved.get("centre")
    if (layout == "codebook-v2" or centre is not None) and (
        not isinstance(centre, torch.Tensor) or tuple(centre.shape) != (b, h, 1, d)
    ):
        got = tuple(centre.shape) if isinstance(centre, torch.Tensor) else type(centre).__name__
        raise ValueError(f"a {layout} block of shape {(b, h, n, d)} needs a centre of shape {(b, h, 1, d)}; got {got}")
    base = saved_scale_base(saved, (b, h, n), layout) if layout == "codebook-v3" else None
    if base is None and not scales.is_floating_point():
        raise ValueError(f"{layout} block scales must be floating point; got {scales.dtype}")
    return CodebookTensor(codes, scales, bits, (b, h, n, d), dtype, centre, base)


def saved_scale_base(saved: dict, shape: tuple[int, int, int], layout: str) -> torch.Tensor:
    """The ``scale_base`` of a saved block of one-byte scales (scales ``shape``, layout ``layout`` for
    the messages), checked: int16 ``(B, H, 1)`` within ``[BASE_MIN, BASE_MAX]``, its scales uint8."""
    b, h, _ = shape
    scales = saved["scales"]
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8:
        got = scales.dtype if isinstance(scales, torch.Tensor) else type(scales).__name__
        raise ValueError(f"{layout} block scales must be uint8 one-byte codes; got {got}")
    base = state_check.tensor(saved.get("scale_base"), "block scale_base")
    if base.dtype != torch.int16 or tuple(base.shape) != (b, h, 1):
        raise ValueError(
            f"a {layout} block needs an int16 scale_base of shape {(b, h, 1)}; got {base.dtype} {tuple(base.shape)}"
        )
    if base.numel() and not (int(base.min()) >= BASE_MIN and int(base.max()) <= BASE_MAX):
        raise ValueError(
            f"{layout} block scale_base holds values in [{int(base.min())}, {int(base.max())}]; one-byte scales "
            f"allow [{BASE_MIN}, {BASE_MAX}]"
        )
    return base


@dataclass(frozen=True)
class ScaledFormat(Format):
    """A format of :class:`ScaledBlock` blocks: one scale per vector, optionally around a centre; a
    subclass names its bits, its block and its quantizer (:meth:`quantize_scaled`).

    Parameters
    ----------
    bits : int
        Code width, one of the subclass's :attr:`~kvpolicy.formats.base.Format.bits_allowed`.
    meta_dtype : {"auto", "float16", "bfloat16", "float32"}
        The dtype of the per-vector scales (and the centre).
    centre : bool
        Whether blocks are quantized around a centre ``μ`` that :meth:`quantize` is given (a stream
        passes the mean of its first block).
    norm_bits : {16, 8}
        Bits of each vector's scale. 16: the scale in the metadata dtype (``bits + 16 / head_dim`` bits
        per element; 32 with ``meta_dtype="float32"``). 8: a one-byte log-scale code
        (``bits + 8 / head_dim``; :mod:`kvpolicy.formats.scale_codes`): ``log2 s`` on a grid of 1/64
        octave relative to the largest scale of its batch row and head in the stream, so each decoded
        scale is within 0.54 % of the norm-corrected scale for scales within 2.98 octaves of that largest,
        within 2.75 % down to about 6.9 octaves (1/16-octave steps there), and vectors shorter still
        (about 120 times shorter than the longest) are stored as zeros (off by no more than their own
        norm). The grid's base is held once per batch row and head (16 bits). ``meta_dtype`` then sets
        the centre's dtype alone.
    """

    bits: int
    meta_dtype: str = "auto"
    centre: bool = False
    norm_bits: int = 16

    backends: ClassVar[tuple[str, ...]] = ("torch", "cpu")
    options_added: ClassVar[tuple[str, ...]] = ("norm_bits",)
    #: channels per code index (the width of the rows of :meth:`ScaledBlock.table`; 1: a table of values)
    point_dim: ClassVar[int] = 1
    head_dim_multiple: ClassVar[int] = 8
    needs_rotation: ClassVar[bool] = True
    centred: ClassVar[bool] = True
    added_defaults: ClassVar[dict[str, object]] = {"norm_bits": 16}

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_bits(owner, self.bits, self.bits_allowed)
        check_meta_dtype_option(owner, self.meta_dtype)
        if not isinstance(self.centre, bool):
            raise ConfigError(f"{owner}: centre must be a bool; got centre={self.centre!r}")
        check_norm_bits(owner, "norm_bits", self.norm_bits)

    @classmethod
    def examples(cls, backend: Any) -> list[ScaledFormat]:
        """Every width, with scales in the metadata dtype and as one-byte codes."""
        return [cls(bits, norm_bits=norm) for norm in NORM_BITS for bits in cls.bits_allowed]

    def stored_scales(
        self, x: torch.Tensor, exact: torch.Tensor, centre: torch.Tensor | None, backend: Any = "torch"
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:func:`store_scales` of this format (its metadata dtype for ``x``'s dtype and its ``norm_bits``): the
        scales ``exact`` ``(batch, kv_heads, tokens)`` of ``x`` as a block of it holds them, and their base."""
        return store_scales(x, exact, self.metadata_dtype(x.dtype), centre, backend, None, self.norm_bits)

    def quantize(self, x: torch.Tensor, backend: Any = "torch", centre: torch.Tensor | None = None) -> ScaledBlock:
        """:meth:`quantize_scaled` with the scales in the metadata dtype (or one-byte codes, ``norm_bits=8``),
        centred on ``centre`` when given."""
        mdt = resolve_meta_dtype(self.meta_dtype, x.dtype)
        offered = backend_meta_dtypes(backend)
        return self.quantize_scaled(x, mdt, backend_name(backend), lambda d: widen_remedy(d, offered), centre)

    def quantize_scaled(
        self, x: torch.Tensor, mdtype: torch.dtype, backend: str, remedy: Callable[[torch.dtype], str],
        centre: torch.Tensor | None,
    ) -> ScaledBlock:  # fmt: skip
        """The format's quantizer, ``quantize(x, bits, mdtype, backend, remedy, centre, norm_bits)`` of its
        module."""
        raise NotImplementedError


def check_norm_bits(owner: str, param: str, value: object) -> None:
    """Raise :class:`ConfigError` unless ``value`` is one of :data:`NORM_BITS`."""
    if isinstance(value, bool) or value not in NORM_BITS:
        raise ConfigError(f"{owner}: {param} must be one of {list(NORM_BITS)}; got {param}={value!r}")


@dataclass(frozen=True)
class Codebook(ScaledFormat):
    """Lloyd-Max indices with one scale per vector (:class:`CodebookTensor`), optionally around a centre;
    ``bits`` (index width, one of :data:`CODEBOOK_BITS`), ``meta_dtype``, ``centre`` and ``norm_bits`` as for
    :class:`ScaledFormat`."""

    name: ClassVar[str] = "codebook"
    block: ClassVar[type[QTensor]] = CodebookTensor
    bits_allowed: ClassVar[tuple[int, ...]] = CODEBOOK_BITS

    def quantize_scaled(
        self, x: torch.Tensor, mdtype: torch.dtype, backend: str, remedy: Callable[[torch.dtype], str],
        centre: torch.Tensor | None,
    ) -> CodebookTensor:  # fmt: skip
        """:func:`quantize`."""
        return quantize(x, self.bits, mdtype, backend, remedy, centre, self.norm_bits)

    def cells(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """The codebook ``C`` ``(2**bits,)`` and its cell boundaries ``(2**bits - 1,)``, float32 on ``device``
        (:func:`lloyd_max`): a coordinate of unit variance takes the centroid of the cell it lies in."""
        return _tables(self.bits, str(torch.device(device)))
