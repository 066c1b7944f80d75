"""Compiled encode and decode of codebook blocks behind a Hadamard rotation (numba), for the presets' formats.

The reference path (:mod:`kvpolicy_lmcache.kvparts`) rotates with a matrix product and quantizes with
kvpolicy's own :meth:`~kvpolicy.formats.Codebook.quantize`, one whole-tensor operation after another. This
path does the same per vector in one compiled pass: the rotation as a fast Walsh-Hadamard transform with
the transform's random signs (``O(D log D)``), the key centre, the norm, the Lloyd-Max cells, the norm of
the reconstruction and the bit packing; decoding likewise. It writes exactly the tensors kvpolicy's block
holds (packed codes as :func:`kvpolicy.formats.packed.pack` lays them out, one-byte or 16-bit scales from
kvpolicy's own :func:`~kvpolicy.formats.codebook.store_scales`, the centre in the metadata dtype, the scale
base), so payloads are the same format whichever path wrote them. Float rounding differs from the matrix
product's in the last bits, so a coordinate within rounding of a cell boundary can take the neighbouring
cell (the guarantee kvpolicy's codebook states for any two computations), and a decoded value can differ
in the last bit of its dtype. ``tests/test_fast.py`` checks both against the reference.

One chunk is one thread's work (no threads of its own: a thread pool beside torch's would compete with it
for the same cores); LMCache's serde workers (``"max_workers"`` in the adapter's ``"serde"`` entry) encode
and decode chunks in parallel.

:func:`plan` says whether a pair of formats and a transform are served here: codebook keys and values
(centred keys or not, 8- or 16-bit scales, 2-4 bits) behind a transform whose matrix is a randomized
block Hadamard one (checked entry by entry, never assumed from its name).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
import torch

from kvpolicy.formats import Codebook, Format
from kvpolicy.formats.base import resolve_meta_dtype
from kvpolicy.formats.codebook import lloyd_max, store_scales
from kvpolicy.transforms.base import Transform


@dataclass(frozen=True)
class Rotation:
    """A block Hadamard rotation ``R = diag(signs) · H / √block`` (``H`` Sylvester, block-diagonal)."""

    signs: np.ndarray  # (head_dim,) float32, ±1
    block: int


def rotation(transform: Transform, head_dim: int) -> Rotation | None:
    """The rotation ``transform`` applies to ``head_dim`` channels, if its matrix is a randomized block
    Hadamard one (``None`` otherwise: no ``matrix``, or any entry off)."""
    matrix = getattr(transform, "matrix", None)
    if matrix is None:
        return None
    r = matrix(head_dim).double()
    block = head_dim & -head_dim  # the largest power of two dividing head_dim, as kvpolicy's Hadamard builds it
    index = torch.arange(head_dim)
    signs = torch.sign(r[index, (index // block) * block])
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    rebuilt = (signs[:, None] * torch.block_diag(*[h] * (head_dim // block)) / math.sqrt(block)).float()
    if not torch.equal(rebuilt, matrix(head_dim)):
        return None
    return Rotation(signs.float().numpy().copy(), block)


def serves(keys: Format, values: Format) -> bool:
    """Whether both formats are codebook ones (any width, centre, scale width)."""
    return type(keys) is Codebook and type(values) is Codebook and not values.centre


@numba.njit(inline="always")
def _fwht(y, block):
    """In-place fast Walsh-Hadamard transform of ``y`` in blocks of ``block`` (Sylvester order, unscaled)."""
    n = y.shape[0]
    h = 1
    while h < block:
        for i in range(0, n, 2 * h):
            for j in range(i, i + h):
                a = y[j]
                b = y[j + h]
                y[j] = a + b
                y[j + h] = a - b
        h *= 2


@numba.njit(inline="always")
def _pack(codes, bits, out):
    """kvpolicy's packing: ``8 // bits`` codes per byte, lowest bits first; 3 bits: eight codes in three bytes."""
    d = codes.shape[0]
    if bits == 3:
        for g in range(d // 8):
            word = 0
            for j in range(8):
                word |= np.int32(codes[8 * g + j]) << (3 * j)
            out[3 * g] = word & 0xFF
            out[3 * g + 1] = (word >> 8) & 0xFF
            out[3 * g + 2] = (word >> 16) & 0xFF
    else:
        per = 8 // bits
        for g in range(d // per):
            byte = 0
            for j in range(per):
                byte |= np.int32(codes[per * g + j]) << (bits * j)
            out[g] = byte


@numba.njit(inline="always")
def _unpack(packed, bits, out):
    d = out.shape[0]
    if bits == 3:
        for g in range(d // 8):
            word = np.int32(packed[3 * g]) | (np.int32(packed[3 * g + 1]) << 8) | (np.int32(packed[3 * g + 2]) << 16)
            for j in range(8):
                out[8 * g + j] = (word >> (3 * j)) & 7
    else:
        per = 8 // bits
        mask = (1 << bits) - 1
        for g in range(d // per):
            byte = np.int32(packed[g])
            for j in range(per):
                out[per * g + j] = (byte >> (bits * j)) & mask


@numba.njit(cache=False)
def _encode(x, centre, signs, block, edges, table, bits, codes, norms, recon):  # pragma: no cover - compiled
    """``x`` (L, T, H, D) float32 -> codes (L, H, T, D·bits/8) uint8, ``‖R x − μ‖`` and ``‖C[codes]‖`` (L, H, T)."""
    n_layers, tokens, heads, d = x.shape
    scale = np.float32(1.0 / math.sqrt(block))
    root = np.float32(math.sqrt(d))
    tiny = np.float32(1.1754944e-38)
    for lh in range(n_layers * heads):
        layer = lh // heads
        head = lh % heads
        y = np.empty(d, np.float32)
        c = np.empty(d, np.uint8)
        for t in range(tokens):
            for i in range(d):
                y[i] = x[layer, t, head, i] * signs[i]
            _fwht(y, block)
            total = np.float32(0.0)
            for i in range(d):
                v = y[i] * scale - centre[layer, head, i]
                y[i] = v
                total += v * v
            norm = np.float32(math.sqrt(total))
            factor = root / max(norm, tiny)
            energy = np.float32(0.0)
            for i in range(d):
                u = y[i] * factor
                k = 0  # the number of edges <= u (ties at an edge go up), without branches
                for e in range(edges.shape[0]):
                    k += np.int32(u >= edges[e])
                c[i] = k
                energy += table[k] * table[k]
            _pack(c, bits, codes[layer, head, t])
            norms[layer, head, t] = norm
            recon[layer, head, t] = np.float32(math.sqrt(energy))


@numba.njit(cache=False)
def _decode(codes, scales, centre, signs, block, table, bits, out):  # pragma: no cover - compiled
    """codes (L, H, T, ·), scales (L, H, T), centre (L, H, D) -> ``Rᵀ(μ + s · C[codes])`` in ``out`` (L, T, H, D)."""
    n_layers, heads, tokens, _ = codes.shape
    d = out.shape[3]
    scale = np.float32(1.0 / math.sqrt(block))
    for lh in range(n_layers * heads):
        layer = lh // heads
        head = lh % heads
        y = np.empty(d, np.float32)
        c = np.empty(d, np.int32)
        for t in range(tokens):
            _unpack(codes[layer, head, t], bits, c)
            s = scales[layer, head, t]
            for i in range(d):
                y[i] = table[c[i]] * s + centre[layer, head, i]
            _fwht(y, block)
            for i in range(d):
                out[layer, t, head, i] = y[i] * scale * signs[i]


def _tables(bits: int) -> tuple[np.ndarray, np.ndarray]:
    centroids, boundaries, _ = lloyd_max(bits)
    return np.asarray(boundaries, np.float32), np.asarray(centroids, np.float32)


def encode(fmt: Codebook, rot: Rotation, x: torch.Tensor, chunk_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of one role's block, by section name, as kvpolicy's format stores them.

    Parameters
    ----------
    fmt : Codebook
        The role's format (its ``meta_dtype`` already resolved for the chunk's dtype).
    rot : Rotation
        The transform's rotation.
    x : torch.Tensor
        ``(layers, tokens, heads, head_dim)`` float32, contiguous: one role of a chunk.
    chunk_dtype : torch.dtype
        The chunk's dtype (what the metadata dtype resolves against).

    Raises
    ------
    NonFiniteError, MetadataOverflowError
        As kvpolicy's quantizer does (NaN or Inf input; scales or a centre beyond the metadata dtype).
    """
    layers, tokens, heads, d = x.shape
    mdtype = resolve_meta_dtype(fmt.meta_dtype, chunk_dtype)
    centre = None
    mu = torch.zeros(layers, heads, d)
    if fmt.centre:
        # the mean of the rotated keys is the rotation of their mean (a linear map): one pass over the tokens
        mean = x.mean(dim=1)  # (L, H, D)
        rotated = _rotate_rows(mean, rot)
        centre = rotated.to(mdtype).unsqueeze(2).contiguous()  # (L, H, 1, D), rounded as kvpolicy stores it
        mu = centre.float()[:, :, 0].contiguous()
    edges, table = _tables(fmt.bits)
    codes = torch.empty(layers, heads, tokens, d * fmt.bits // 8, dtype=torch.uint8)
    norms = torch.empty(layers, heads, tokens)
    recon = torch.empty(layers, heads, tokens)
    _encode(x.numpy(), mu.numpy(), rot.signs, rot.block, edges, table, fmt.bits, codes.numpy(), norms.numpy(),
            recon.numpy())  # fmt: skip
    exact = norms / recon
    if not bool(torch.isfinite(exact).all()):
        from kvpolicy.errors import NonFiniteError

        raise NonFiniteError("kvpolicy codec: vectors holding NaN or Inf reached the quantizer")
    scales, base = store_scales(x, exact, mdtype, centre, "torch", None, fmt.norm_bits)
    out = {"codes": codes, "scales": scales}
    if centre is not None:
        out["centre"] = centre
    if base is not None:
        out["scale_base"] = base
    return out


def decode(block, rot: Rotation, out: torch.Tensor) -> None:
    """Write ``Rᵀ(μ + s · C[codes])`` of a checked codebook ``block`` into ``out`` ``(L, T, H, D)`` float32."""
    layers, heads, _, d = block.shape
    scales = block.scale_values().contiguous()
    mu = block.centre.float()[:, :, 0].contiguous() if block.centre is not None else torch.zeros(layers, heads, d)
    _, table = _tables(block.bits)
    _decode(block.codes.contiguous().numpy(), scales.numpy(), mu.numpy(), rot.signs, rot.block, table, block.bits,
            out.numpy())  # fmt: skip


def _rotate_rows(rows: torch.Tensor, rot: Rotation) -> torch.Tensor:
    """``rows @ R`` for ``(..., D)`` rows (the centre: a few vectors), computed in float64, returned in float32."""
    y = rows.double() * torch.from_numpy(rot.signs).double()
    d = y.shape[-1]
    h = 1
    y = y.clone()
    while h < rot.block:
        v = y.reshape(*y.shape[:-1], d // (2 * h), 2, h)
        a, b = v[..., 0, :].clone(), v[..., 1, :].clone()
        v[..., 0, :] = a + b
        v[..., 1, :] = a - b
        h *= 2
    return (y / math.sqrt(rot.block)).float()


__all__ = ["Rotation", "decode", "encode", "rotation", "serves"]
