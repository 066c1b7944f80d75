"""Lattice blocks: a per-vector norm and indices into a D4 lattice codebook (the ``"lattice"`` scheme).

The codebook scheme (:mod:`kvpolicy.formats.codebook`) quantizes every rotated coordinate on its own.
This scheme quantizes them four at a time: each key or value vector of ``head_dim`` channels is cut
into ``head_dim / 4`` sub-vectors, and each sub-vector becomes the index of one of ``2**(4 · bits)``
points of the four-dimensional lattice D4 (integer vectors whose coordinates sum to an even number,
the densest lattice packing in four dimensions): 256 points at 2 bits per coordinate, 4096 at 3.
Per token and head a block stores

- one scale ``s`` (in the metadata dtype, 16 bits by default), and
- ``head_dim / 4`` indices of ``4 · bits`` bits each (stored as ``head_dim`` digits of ``bits`` bits,
  packed as the codebook's indices are),

and reconstructs ``x̂ = s · P[codes]``, ``P`` the table of lattice points. To quantize, ``x`` is scaled
to unit variance per coordinate (``u = x · √D / ‖x‖``) and by a fixed factor ``β`` (:data:`BETA`),
every sub-vector of ``β · u`` takes the nearest point of ``P``, and ``s = ‖x‖ / ‖P[codes]‖`` (the
codebook's norm correction: the reconstruction keeps the vector's norm).

The table: the ``2**(4 · bits)`` points of the lattice (shifted by ``(1, 0, 0, 0)`` at 2 bits) nearest
the origin, ties broken by coordinates in lexicographic order (:func:`lattice_points`). Shaping the
codebook as a ball suits the Gaussian coordinates of rotated vectors better than the Voronoi region
of a coarse lattice (a nested-lattice code, whose far points waste indices and whose overload wraps
around); ``β`` (the ball's radius against the data's) is set for the least mean squared error on
Gaussian data (:data:`BETA`; ``docs/explanation/quantization.md`` lists the measurements). The
nearest point is found exactly: the nearest point of the lattice (Conway & Sloane's algorithm for
D_n, :func:`nearest_dn`) is the nearest codeword when it lies in the table, which a lookup over a
small box says; a sub-vector whose lattice point lies outside is searched against the whole table.

Decode attention reads the codes without forming the history (:func:`key_scores`, :func:`value_mix`,
the product-quantization lookup): per query and sub-vector a table of ``q_g · P[c]`` over every
codeword ``c``, gathered by each key's indices and summed (times the key's scale); values accumulate
their probabilities (times the value's scale) per sub-vector and codeword, then multiply the table
``P``. A block may hold a centre as codebook blocks do (``Quantize(key_centre=True)``), read the same way.

Bits per element are ``bits + 16 / head_dim`` (2.25 at 2 bits with ``head_dim=64``), as for the
codebook. Guarantee: every sub-vector of ``β · u`` is stored as a nearest point of the table (ties,
which Gaussian data meets with probability zero, go to the point the search meets first).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvpolicy import state_check
from kvpolicy.errors import ConfigError
from kvpolicy.formats.base import (
    QTensor,
)
from kvpolicy.formats.codebook import ScaledBlock, ScaledFormat, saved_scale_base, store_scales, unit_variance
from kvpolicy.formats.packed import pack, unpack

#: bits per coordinate the lattice scheme serves
LATTICE_BITS = (2, 3)
#: the lattice's dimension: sub-vectors of this many channels share one index
DIM = 4
#: ``bits -> (β, shift)``: the table is the ``2**(4 · bits)`` points of ``D4 + shift`` nearest the origin,
#: and a unit-variance sub-vector is multiplied by ``β`` before its nearest point is taken. ``β`` gives the
#: least mean squared error on Gaussian vectors (``head_dim=64``, norm-corrected scales; a local minimum on a
#: grid of 0.025, checked by the tests); the shift at 2 bits makes the 256 points a union of whole shells
#: around a deep hole of D4 (symmetric), which measured 3 % below the unshifted table's error.
TABLES: dict[int, tuple[float, tuple[int, int, int, int]]] = {2: (1.225, (1, 0, 0, 0)), 3: (2.15, (0, 0, 0, 0))}
#: coordinates of the membership box (``[-BOX, BOX]`` each); every table point lies inside it
BOX = 8


def nearest_dn(x: torch.Tensor) -> torch.Tensor:
    """The nearest point of the lattice D_n (integer vectors with an even sum) to each row of ``x``.

    Conway & Sloane's algorithm: round every coordinate; if the sum is odd, round the coordinate with
    the largest rounding error the other way. ``x`` ``(..., n)`` float; returns the points, same shape and
    dtype (a nearest point; at a tie, one of them).
    """
    f = torch.round(x)
    err = x - f
    k = err.abs().argmax(dim=-1, keepdim=True)
    step = torch.where(err.gather(-1, k) >= 0, 1.0, -1.0).to(x.dtype)
    odd = torch.remainder(f.sum(dim=-1, keepdim=True), 2) != 0
    return torch.where(odd, f.scatter_add(-1, k, step), f)


def _shift(bits: int, device: torch.device | str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(TABLES[bits][1], dtype=dtype, device=device)


def nearest_lattice(y: torch.Tensor, bits: int) -> torch.Tensor:
    """The nearest point of ``D4 + shift`` (:data:`TABLES` at ``bits``) to each row of ``y`` ``(..., 4)``."""
    a = _shift(bits, y.device, y.dtype)
    return nearest_dn(y - a) + a


@functools.cache
def lattice_points(bits: int) -> tuple[tuple[int, ...], ...]:
    """The table ``P``: the ``2**(4 · bits)`` points of ``D4 + shift`` nearest the origin (integer vectors),
    in increasing norm, ties in lexicographic order of the coordinates."""
    if bits not in LATTICE_BITS:
        raise ConfigError(f"lattice: bits must be one of {list(LATTICE_BITS)}; got bits={bits!r}")
    shift = TABLES[bits][1]
    parity = sum(shift) % 2
    box = range(-BOX, BOX + 1)
    pts = [p for p in itertools.product(box, repeat=DIM) if sum(p) % 2 == parity]
    pts.sort(key=lambda p: (sum(c * c for c in p), p))
    chosen = pts[: 1 << (DIM * bits)]
    # the box holds every point of the next shell too: the table is the true nearest set
    assert sum(c * c for c in pts[len(chosen)]) <= BOX * BOX
    return tuple(chosen)


@functools.cache
def _tables(bits: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P, lookup)``: the points ``(N, 4)`` float32, and ``(2·BOX + 1)**4`` int64 table indices of the
    box's points (``-1``: not in the table). Cached: never inference tensors, whatever mode the first call
    came in."""
    with torch.inference_mode(False):
        pts = torch.tensor(lattice_points(bits), dtype=torch.int64)
        side = 2 * BOX + 1
        lookup = torch.full((side**DIM,), -1, dtype=torch.int64)
        lookup[_box_key(pts)] = torch.arange(len(pts))
        return pts.float().to(device), lookup.to(device)


def _box_key(p: torch.Tensor) -> torch.Tensor:
    """The flat box index of integer points ``(..., 4)`` inside ``[-BOX, BOX]**4``."""
    side = 2 * BOX + 1
    key = torch.zeros(p.shape[:-1], dtype=torch.int64, device=p.device)
    for j in range(DIM):
        key = key * side + (p[..., j] + BOX)
    return key


def points(bits: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The table ``P``: ``(2**(4 · bits), 4)`` float32 on ``device``."""
    return _tables(bits, str(torch.device(device)))[0]


def nearest_index(y: torch.Tensor, bits: int) -> torch.Tensor:
    """The index into ``P`` of the nearest table point to each row of ``y`` ``(..., 4)``: int64 ``(...)``.

    The nearest lattice point when the table holds it (then no table point is nearer); otherwise (a
    sub-vector beyond the table's ball) a search over the whole table.
    """
    table, lookup = _tables(bits, str(y.device))
    p = nearest_lattice(y.float(), bits).to(torch.int64)
    inside = (p.abs() <= BOX).all(dim=-1)
    idx = torch.where(inside, lookup[_box_key(p.clamp(-BOX, BOX))], -1)
    far = idx < 0
    if bool(far.any()):
        rows = y.float()[far]
        idx[far] = torch.cdist(rows, table).argmin(dim=-1)
    return idx


def index_digits(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """Indices ``(..., G)`` as ``4`` digits of ``bits`` bits each, lowest first: ``(..., 4 · G)`` uint8."""
    shifts = torch.arange(DIM, device=idx.device) * bits
    digits = (idx.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return digits.reshape(*idx.shape[:-1], -1).to(torch.uint8)


def digits_index(digits: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`index_digits`: ``(..., 4 · G)`` digits to ``(..., G)`` int64 indices."""
    d = digits.long().reshape(*digits.shape[:-1], -1, DIM)
    shifts = torch.arange(DIM, device=digits.device) * bits
    return (d << shifts).sum(dim=-1)


@dataclass
class LatticeTensor(ScaledBlock):
    """Packed D4 table indices with one scale per vector and an optional centre (the storage of
    :class:`~kvpolicy.formats.codebook.ScaledBlock`): ``codes`` hold every sub-vector's index as four
    digits of ``bits`` bits (:func:`index_digits`), ``scales`` are ``‖x − μ‖ / ‖P[codes]‖``."""

    layouts: ClassVar[tuple[str, ...]] = ("lattice-d4-v1", "lattice-d4-v2")  # LAYOUTS

    def unit_vectors(self) -> torch.Tensor:
        """The table points ``P[codes]`` (:func:`unit_vectors`)."""
        return unit_vectors(self)

    def table(self) -> torch.Tensor:
        """The table ``P``, ``(2**(4 · bits), 4)`` (:func:`points`)."""
        return points(self.bits, self.codes.device)

    def scores(self, query: torch.Tensor) -> torch.Tensor:
        """Per-sub-vector lookup tables of the query against ``P``, gathered by the codes (:func:`key_scores`)."""
        return key_scores(query, self)

    def mix(self, probs: torch.Tensor) -> torch.Tensor:
        """Probabilities summed per sub-vector and codeword, times ``P`` (:func:`value_mix`)."""
        return value_mix(probs, self)

    def state(self) -> dict:
        """:func:`state`."""
        return state(self)

    @classmethod
    def from_state(cls, saved: dict) -> LatticeTensor:
        """The block :meth:`state` described (:func:`from_state`)."""
        return from_state(saved)


def check_head_dim(head_dim: int, bits: int) -> None:
    """Raise :class:`ConfigError` unless ``head_dim`` is a multiple of 8 (:attr:`Lattice.head_dim_multiple`):
    whole D4 sub-vectors of 4 channels, whose digits pack into whole bytes at every width."""
    if head_dim % Lattice.head_dim_multiple:
        raise ConfigError(
            f"lattice: head_dim={head_dim} does not split into sub-vectors of the D4 lattice's dimension {DIM} "
            f"packed into whole bytes at bits={bits}; head_dim must be a multiple of {Lattice.head_dim_multiple}"
        )


def quantize(x: torch.Tensor, bits: int, mdtype: torch.dtype, backend: Any = "torch",
             remedy: Callable[[torch.dtype], str] | None = None,
             centre: torch.Tensor | None = None, norm_bits: int = 16) -> LatticeTensor:  # fmt: skip
    """Quantize ``x`` ``(batch, kv_heads, tokens, head_dim)`` to a :class:`LatticeTensor`.

    Parameters
    ----------
    x : torch.Tensor
        The vectors, in the rotated basis (their coordinates close to Gaussian).
    bits : int
        Bits per coordinate, one of :data:`LATTICE_BITS`; ``head_dim`` must be a multiple of 8.
    mdtype : torch.dtype
        The dtype of the per-vector scales (and the centre).
    backend : Backend or str
        The backend (or its name) error messages name.
    remedy : callable, optional
        ``remedy(mdtype)``: what to do when a scale overflows ``mdtype``.
    centre : torch.Tensor, optional
        ``μ``, ``(batch, kv_heads, 1, head_dim)``: quantize ``x − μ`` and keep ``μ`` (stored in ``mdtype``;
        the rounded ``μ`` is the one subtracted).
    norm_bits : {16, 8}
        16: scales in ``mdtype``; 8: one-byte log-scale codes (as the codebook's,
        :func:`~kvpolicy.formats.codebook.store_scales`).

    Raises
    ------
    ConfigError
        If ``head_dim`` is not a multiple of 8 (:func:`check_head_dim`).
    MetadataOverflowError
        If a finite vector's scale, or the centre, does not fit ``mdtype`` (checked as the codebook checks).
    NonFiniteError
        With 8-bit norms, a vector holding NaN or Inf.
    """
    b, h, n, d = x.shape
    check_head_dim(d, bits)
    table, _ = _tables(bits, str(x.device))
    u, norm, centre = unit_variance(x, mdtype, centre, "lattice")
    idx = nearest_index(u.mul_(TABLES[bits][0]).reshape(b, h, n, d // DIM, DIM), bits)  # (B, H, n, G)
    recon_norm = torch.linalg.vector_norm(table[idx].reshape(b, h, n, d), dim=-1)
    # a zero vector may take the zero point (unshifted table): its scale is 0, not 0 / 0
    exact = torch.where(recon_norm > 0, norm / recon_norm.clamp_min(1e-30), 0.0)
    scales, base = store_scales(x, exact, mdtype, centre, backend, remedy, norm_bits)
    codes = pack(index_digits(idx, bits), bits).contiguous()
    shape: tuple[int, int, int, int] = (b, h, n, d)
    return LatticeTensor(codes, scales, bits, shape, x.dtype, centre, base)


def indices(q: LatticeTensor) -> torch.Tensor:
    """Every sub-vector's index into ``P``: ``(batch, kv_heads, tokens, head_dim / 4)`` int64."""
    return digits_index(unpack(q.codes, q.bits), q.bits)


def unit_vectors(q: LatticeTensor) -> torch.Tensor:
    """The table points ``P[codes]``: ``(batch, kv_heads, tokens, head_dim)`` float32."""
    return points(q.bits, q.codes.device)[indices(q)].reshape(*q.codes.shape[:3], q.shape[3])


def key_scores(query: torch.Tensor, keys: LatticeTensor) -> torch.Tensor:
    """``query · k̂`` for every key from the codes by table lookup: ``s · Σ_g T[g, c_g] + q · μ`` with
    ``T[g, c] = q_g · P[c]`` (``q_g`` the query's ``g``-th sub-vector); no key is reconstructed.

    ``query`` ``(B, H, nq, D)`` float32 (already scaled); returns ``(B, H, nq, n)`` float32.
    """
    b, h, nq, d = query.shape
    n, groups = keys.shape[2], d // DIM
    table = points(keys.bits, query.device)  # (N, 4)
    size = table.shape[0]
    lut = torch.matmul(query.reshape(b, h, nq, groups, DIM), table.T).reshape(b, h, nq, groups * size)
    offsets = torch.arange(groups, device=query.device) * size
    flat = (indices(keys) + offsets).reshape(b, h, 1, n * groups).expand(b, h, nq, n * groups)
    scores = lut.gather(-1, flat).reshape(b, h, nq, n, groups).sum(dim=-1)
    scores = scores.mul_(keys.scale_values().unsqueeze(-2))
    if keys.centre is None:
        return scores
    return scores.add_(torch.matmul(query, keys.centre.float().transpose(-1, -2)))


def value_mix(probs: torch.Tensor, values: LatticeTensor) -> torch.Tensor:
    """``probs @ v̂`` from the codes: the weights ``p · s`` summed per sub-vector and codeword, times ``P``,
    plus ``μ``; no value is reconstructed. ``probs`` ``(B, H, nq, n)`` float32, each row summing to one."""
    b, h, nq, n = probs.shape
    d = values.shape[3]
    groups = d // DIM
    table = points(values.bits, probs.device)
    size = table.shape[0]
    weights = (probs * values.scale_values().unsqueeze(-2)).unsqueeze(-1).expand(b, h, nq, n, groups)
    offsets = torch.arange(groups, device=probs.device) * size
    flat = (indices(values) + offsets).reshape(b, h, 1, n * groups).expand(b, h, nq, n * groups)
    acc = probs.new_zeros((b, h, nq, groups * size)).scatter_add_(-1, flat, weights.reshape(b, h, nq, n * groups))
    out = torch.matmul(acc.reshape(b, h, nq, groups, size), table).reshape(b, h, nq, d)
    return out if values.centre is None else out.add_(values.centre.float())


#: saved block layouts: ``lattice-d4-v1`` with scales in the metadata dtype, ``lattice-d4-v2`` with
#: one-byte scales and their ``scale_base`` (a reader that knows only v1 refuses it)
LAYOUTS = ("lattice-d4-v1", "lattice-d4-v2")


def state(q: LatticeTensor) -> dict:
    """``q`` as JSON values and tensors (layout ``lattice-d4-v1``, or ``lattice-d4-v2`` with one-byte
    scales; a centre, when held, under ``centre``)."""
    out = {
        "layout": LAYOUTS[0], "codes": q.codes, "scales": q.scales, "bits": q.bits, "shape": list(q.shape),
        "dtype": str(q.dtype).removeprefix("torch."),
    }  # fmt: skip
    if q.centre is not None:
        out["centre"] = q.centre
    if q.scale_base is not None:
        out.update(layout=LAYOUTS[1], scale_base=q.scale_base)
    return out


def from_state(saved: dict) -> LatticeTensor:
    """The block :meth:`LatticeTensor.state` described, every entry checked (it comes from a file).

    Raises
    ------
    ValueError
        Naming the entry: a missing or unknown entry, a width, shape or dtype that does not fit.
    """
    state_check.entries(
        saved, "lattice block", ("layout", "codes", "scales", "bits", "shape", "dtype"), ("centre", "scale_base")
    )
    layout = state_check.choice(saved["layout"], "block layout", LAYOUTS)
    bits = state_check.choice(saved["bits"], "lattice block bits", LATTICE_BITS)
    b, h, n, d = state_check.shape4(saved["shape"], "a block's shape")
    dtype = state_check.float_dtype(saved["dtype"], "a block's dtype")
    if d % 8:
        raise ValueError(f"a lattice block's head_dim must be a multiple of 8; got {d}")
    codes = state_check.tensor(saved["codes"], "block codes", torch.uint8, (b, h, n, d * bits // 8))
    scales = state_check.tensor(saved["scales"], "block scales")
    base = None
    if layout == LAYOUTS[1]:
        base = saved_scale_base(saved, (b, h, n), layout)
        if tuple(scales.shape) != (b, h, n):
            raise ValueError(f"{layout} block scales must have shape {(b, h, n)}; got {tuple(scales.shape)}")
    else:
        if "scale_base" in saved:
            raise ValueError(f"a {layout} block has no scale_base ({LAYOUTS[1]} blocks do)")
        if tuple(scales.shape) != (b, h, n) or scales.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(
                f"lattice block scales must be float16, bfloat16 or float32 of shape {(b, h, n)}; got "
                f"{scales.dtype} {tuple(scales.shape)}"
            )
    centre = saved.get("centre")
    centre_dtypes = (torch.float16, torch.bfloat16, torch.float32) if base is not None else (scales.dtype,)
    if centre is not None and (
        not isinstance(centre, torch.Tensor) or tuple(centre.shape) != (b, h, 1, d) or centre.dtype not in centre_dtypes
    ):
        got = f"{centre.dtype} {tuple(centre.shape)}" if isinstance(centre, torch.Tensor) else type(centre).__name__
        want = "a float tensor" if base is not None else str(scales.dtype)
        raise ValueError(f"a lattice block's centre must be {want} of shape {(b, h, 1, d)}; got {got}")
    # every index names a table point: 4 digits of `bits` bits span exactly the 2**(4 bits) entries
    return LatticeTensor(codes, scales, bits, (b, h, n, d), dtype, centre, base)


@dataclass(frozen=True)
class Lattice(ScaledFormat):
    """D4 lattice indices with one scale per vector (:class:`LatticeTensor`), optionally around a centre;
    ``bits`` (bits per coordinate, one of :data:`LATTICE_BITS`: each sub-vector of four channels takes one of
    ``2**(4 · bits)`` lattice points), ``meta_dtype``, ``centre`` and ``norm_bits`` as for
    :class:`~kvpolicy.formats.codebook.ScaledFormat`."""

    name: ClassVar[str] = "lattice"
    block: ClassVar[type[QTensor]] = LatticeTensor
    point_dim: ClassVar[int] = DIM
    bits_allowed: ClassVar[tuple[int, ...]] = LATTICE_BITS

    def quantize_scaled(
        self, x: torch.Tensor, mdtype: torch.dtype, backend: str, remedy: Callable[[torch.dtype], str],
        centre: torch.Tensor | None,
    ) -> LatticeTensor:  # fmt: skip
        """:func:`quantize`."""
        return quantize(x, self.bits, mdtype, backend, remedy, centre, self.norm_bits)
