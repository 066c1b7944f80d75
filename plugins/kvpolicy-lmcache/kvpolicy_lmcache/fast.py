"""Compiled encode and decode of codebook blocks behind a Hadamard rotation (numba), for the presets' formats.

The reference path (:mod:`kvpolicy_lmcache.kvparts`) rotates with a matrix product and quantizes with
kvpolicy's own :meth:`~kvpolicy.formats.Codebook.quantize`, one whole-tensor operation after another.
This path does the same per vector in one compiled pass over tiles of :data:`TILE` tokens (each step runs
along contiguous rows of the tile, which the compiler vectorizes): the rotation as a fast Walsh-Hadamard
transform with the transform's random signs (``O(D log D)``), the key centre, the norm, the Lloyd-Max
cells, the norm of the reconstruction and the bit packing; decoding likewise, with bfloat16 read and
written by the kernel itself (rounded to nearest even, as torch casts). Every vector's arithmetic is that
of one vector alone, in the same order, so tiling changes no bit of a payload. It writes exactly the
tensors kvpolicy's block holds (packed codes as :func:`kvpolicy.formats.packed.pack` lays them out,
one-byte or 16-bit scales from kvpolicy's own :func:`~kvpolicy.formats.codebook.store_scales`, the centre
in the metadata dtype, the scale base), so payloads are the same format whichever path wrote them. Float
rounding differs from the matrix product's in the last bits, so a coordinate within rounding of a cell
boundary can take the neighbouring cell (the guarantee kvpolicy's codebook states for any two
computations), and a decoded value can differ in the last bit of its dtype. ``tests/test_fast.py`` checks
both against the reference.

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


#: tokens coded together: each step of the per-vector work runs over a tile of tokens at once, along
#: contiguous rows of ``TILE`` values (one channel of every token of the tile) that the compiler vectorizes;
#: every token's arithmetic is in the same order as one vector's alone
TILE = 64


@numba.njit(inline="always")
def _row(y, i):
    """Row ``i`` of a flat ``(channels, TILE)`` tile: channel ``i`` of each token of the tile."""
    return y[i * TILE : (i + 1) * TILE]


@numba.njit(inline="always")
def _packing(bits):
    """kvpolicy's packing of ``bits``-bit codes, lowest bits first: ``(codes, bytes)`` per packed group (3
    bits: eight codes in three bytes; else ``8 // bits`` codes in one)."""
    if bits == 3:
        return 8, 3
    return 8 // bits, 1


@numba.njit(inline="always")
def _fwht_tile(y, block, d):
    """In-place fast Walsh-Hadamard transform of the ``d`` rows of the tile ``y`` in blocks of ``block``
    channels (Sylvester order, unscaled)."""
    h = 1
    while h < block:
        for i in range(0, d, 2 * h):
            for j in range(i, i + h):
                ya = _row(y, j)
                yb = _row(y, j + h)
                for t in range(TILE):
                    a = ya[t]
                    b = yb[t]
                    ya[t] = a + b
                    yb[t] = a - b
        h *= 2


@numba.njit(cache=False)
def _encode(xf, xb, bf16, centre, signs, block, edges, table, bits, codes, norms, recon):  # pragma: no cover
    """``x`` (L, T, H, D) -> codes (L, H, T, D·bits/8) uint8, ``‖R x − μ‖`` and ``‖C[codes]‖`` (L, H, T).

    ``x`` is ``xb`` (bfloat16 bits as uint16) when ``bf16``, else ``xf`` (float32). A coordinate's code is
    the number of ``edges`` (the cells' boundaries) at or below it: ties at an edge go up."""
    if bf16:
        n_layers, tokens, heads, d = xb.shape
    else:
        n_layers, tokens, heads, d = xf.shape
    scale = np.float32(1.0 / math.sqrt(block))
    root = np.float32(math.sqrt(d))
    tiny = np.float32(1.1754944e-38)
    squares = table * table
    raw = np.zeros(d * TILE, np.uint32)
    y = raw.view(np.float32)
    c = np.zeros(d * TILE, np.int32)
    total = np.zeros(TILE, np.float32)
    factor = np.zeros(TILE, np.float32)
    energy = np.zeros(TILE, np.float32)
    u = np.zeros(TILE, np.float32)
    k = np.zeros(TILE, np.int32)
    word = np.zeros(TILE, np.int32)
    per, width = _packing(bits)
    for layer in range(n_layers):
        for head in range(heads):
            out = codes[layer, head]
            for t0 in range(0, tokens, TILE):
                n = min(TILE, tokens - t0)
                if n < TILE:
                    raw[:] = 0
                for t in range(n):
                    if bf16:
                        src = xb[layer, t0 + t, head]
                        for i in range(d):
                            raw[i * TILE + t] = np.uint32(src[i]) << 16
                    else:
                        srcf = xf[layer, t0 + t, head]
                        for i in range(d):
                            y[i * TILE + t] = srcf[i]
                for i in range(d):
                    yi = _row(y, i)
                    sign = signs[i]
                    for t in range(TILE):
                        yi[t] = yi[t] * sign
                _fwht_tile(y, block, d)
                total[:] = 0.0
                energy[:] = 0.0
                for i in range(d):
                    yi = _row(y, i)
                    mu = centre[layer, head, i]
                    for t in range(TILE):
                        v = yi[t] * scale - mu
                        yi[t] = v
                        total[t] += v * v
                for t in range(TILE):
                    norm = np.float32(math.sqrt(total[t]))
                    total[t] = norm
                    factor[t] = root / max(norm, tiny)
                for i in range(d):
                    yi = _row(y, i)
                    for t in range(TILE):
                        u[t] = yi[t] * factor[t]
                        k[t] = 0
                    for e in range(edges.shape[0]):
                        edge = edges[e]
                        for t in range(TILE):
                            k[t] += np.int32(u[t] >= edge)
                    ci = _row(c, i)
                    for t in range(TILE):
                        ci[t] = k[t]
                        energy[t] += squares[k[t]]
                for t in range(n):
                    norms[layer, head, t0 + t] = total[t]
                    recon[layer, head, t0 + t] = np.float32(math.sqrt(energy[t]))
                for g in range(d // per):
                    word[:] = 0
                    for j in range(per):
                        cj = _row(c, per * g + j)
                        shift = bits * j
                        for t in range(TILE):
                            word[t] |= cj[t] << shift
                    for t in range(n):
                        for b in range(width):
                            out[t0 + t, width * g + b] = (word[t] >> (8 * b)) & 0xFF


@numba.njit(cache=False)
def _decode(codes, scales, centre, signs, block, table, bits, outf, outb, bf16):  # pragma: no cover - compiled
    """codes (L, H, T, ·), scales (L, H, T), centre (L, H, D) -> ``Rᵀ(μ + s · C[codes])`` (L, T, H, D) in
    ``outb`` as bfloat16 bits (uint16, rounded to nearest even as torch rounds) when ``bf16``, else in
    ``outf`` (float32). Returns how many bfloat16 values came out NaN or Inf."""
    n_layers, heads, tokens, _ = codes.shape
    d = centre.shape[2]
    scale = np.float32(1.0 / math.sqrt(block))
    raw = np.zeros(d * TILE, np.uint32)
    y = raw.view(np.float32)
    c = np.zeros(d * TILE, np.int32)
    s = np.zeros(TILE, np.float32)
    word = np.zeros(TILE, np.int32)
    per, width = _packing(bits)
    mask = (1 << bits) - 1
    bad = 0
    for layer in range(n_layers):
        for head in range(heads):
            src = codes[layer, head]
            for t0 in range(0, tokens, TILE):
                n = min(TILE, tokens - t0)
                if n < TILE:
                    word[:] = 0
                    s[:] = 0
                for t in range(n):
                    s[t] = scales[layer, head, t0 + t]
                for g in range(d // per):
                    for t in range(n):
                        w = np.int32(0)
                        for b in range(width):
                            w |= np.int32(src[t0 + t, width * g + b]) << (8 * b)
                        word[t] = w
                    for j in range(per):
                        cj = _row(c, per * g + j)
                        shift = bits * j
                        for t in range(TILE):
                            cj[t] = (word[t] >> shift) & mask
                for i in range(d):
                    yi = _row(y, i)
                    ci = _row(c, i)
                    mu = centre[layer, head, i]
                    for t in range(TILE):
                        yi[t] = table[ci[t]] * s[t] + mu
                _fwht_tile(y, block, d)
                for i in range(d):
                    yi = _row(y, i)
                    sign = signs[i]
                    for t in range(TILE):
                        yi[t] = yi[t] * scale * sign
                if bf16:  # round to nearest even; a non-finite float32, or one rounding past bfloat16's range, is bad
                    for i in range(d):
                        ri = _row(raw, i)
                        for t in range(n):
                            v = ri[t]
                            r = (v + np.uint32(0x7FFF) + ((v >> 16) & np.uint32(1))) >> 16
                            bad += np.int32((v & np.uint32(0x7F800000)) == np.uint32(0x7F800000))
                            bad += np.int32((r & np.uint32(0x7F80)) == np.uint32(0x7F80))
                            ri[t] = r
                    for t in range(n):
                        dst = outb[layer, t0 + t, head]
                        for i in range(d):
                            dst[i] = np.uint16(raw[i * TILE + t])
                else:
                    for t in range(n):
                        dstf = outf[layer, t0 + t, head]
                        for i in range(d):
                            dstf[i] = y[i * TILE + t]
    return bad


#: the kernels' unused input or output (one of float32 and bfloat16 bits), typed as the used one would be
_NO_FLOAT32 = np.empty((0, 0, 0, 0), np.float32)
_NO_BFLOAT16 = np.empty((0, 0, 0, 0), np.uint16)


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
        ``(layers, tokens, heads, head_dim)`` in the chunk's dtype (any strides): one role of a chunk.
    chunk_dtype : torch.dtype
        The chunk's dtype (what the metadata dtype resolves against).

    Raises
    ------
    NonFiniteError, MetadataOverflowError
        As kvpolicy's quantizer does (NaN or Inf input; scales or a centre beyond the metadata dtype).
    """
    layers, tokens, heads, d = x.shape
    mdtype = resolve_meta_dtype(fmt.meta_dtype, chunk_dtype)
    # bfloat16 vectors with one-byte scales are read by the kernel as they are (no float32 copy of the chunk):
    # their only metadata tensor is the centre, checked below; everything else in float32
    direct = x.dtype == torch.bfloat16 and fmt.norm_bits == 8
    if direct:  # a view (the tokens between kept ones: strided across layers) is read where it lies
        x = x if x.stride(-1) == 1 else x.contiguous()
        xf, xb = _NO_FLOAT32, x.view(torch.int16).numpy().view(np.uint16)
    else:
        x = x.float().contiguous()
        xf, xb = x.numpy(), _NO_BFLOAT16
    centre = None
    mu = torch.zeros(layers, heads, d)
    if fmt.centre:
        # the mean of the rotated keys is the rotation of their mean (a linear map): one pass over the tokens,
        # in float32 one layer at a time (the same sums as over the whole chunk in float32, in cache)
        mean = torch.stack([layer.contiguous().float().mean(dim=0) for layer in x])  # (L, H, D)
        rotated = _rotate_rows(mean, rot)
        centre = rotated.to(mdtype).unsqueeze(2).contiguous()  # (L, H, 1, D), rounded as kvpolicy stores it
        mu = centre.float()[:, :, 0].contiguous()
    edges, table = _tables(fmt.bits)
    codes = torch.empty(layers, heads, tokens, d * fmt.bits // 8, dtype=torch.uint8)
    norms = torch.empty(layers, heads, tokens)
    recon = torch.empty(layers, heads, tokens)
    _encode(xf, xb, direct, mu.numpy(), rot.signs, rot.block, edges, table, fmt.bits, codes.numpy(), norms.numpy(),
            recon.numpy())  # fmt: skip
    exact = norms / recon
    if not bool(torch.isfinite(exact).all()):
        from kvpolicy.errors import NonFiniteError

        raise NonFiniteError("kvpolicy codec: vectors holding NaN or Inf reached the quantizer")
    # kvpolicy checks a centre computed from float32 input for overflow; a finite one passes, so only a centre
    # that overflowed needs the chunk in float32 (kvpolicy's check, and its error, as for any input)
    overflowed = direct and centre is not None and not bool(torch.isfinite(centre).all())
    scales, base = store_scales(x.float() if overflowed else x, exact, mdtype, centre, "torch", None, fmt.norm_bits)
    out = {"codes": codes, "scales": scales}
    if centre is not None:
        out["centre"] = centre
    if base is not None:
        out["scale_base"] = base
    return out


def decode(block, rot: Rotation, dtype: torch.dtype) -> torch.Tensor | None:
    """``Rᵀ(μ + s · C[codes])`` of a checked codebook ``block`` ``(L, H, T, ·)``.

    Returns
    -------
    torch.Tensor or None
        ``(L, T, H, D)``: bfloat16 (rounded to nearest even, as torch casts) when ``dtype`` is bfloat16,
        else float32 for the caller to cast; ``None`` if a bfloat16 value came out NaN or Inf (a float32
        result is the caller's to check).
    """
    layers, heads, tokens, d = block.shape
    scales = block.scale_values().contiguous()
    mu = block.centre.float()[:, :, 0].contiguous() if block.centre is not None else torch.zeros(layers, heads, d)
    _, table = _tables(block.bits)
    bf16 = dtype == torch.bfloat16
    out = torch.empty(layers, tokens, heads, d, dtype=torch.int16 if bf16 else torch.float32)
    outf, outb = (_NO_FLOAT32, out.numpy().view(np.uint16)) if bf16 else (out.numpy(), _NO_BFLOAT16)
    bad = _decode(block.codes.contiguous().numpy(), scales.numpy(), mu.numpy(), rot.signs, rot.block, table,
                  block.bits, outf, outb, bf16)  # fmt: skip
    if bad:
        return None
    return out.view(torch.bfloat16) if bf16 else out


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
