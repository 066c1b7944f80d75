"""Triton kernels: asymmetric min-max quantize + bit-pack, and unpack + dequantize.

Both work on *groups*: ``n_groups`` runs of ``G`` elements that share one scale and minimum (float16,
bfloat16 or float32 metadata).
Group ``r`` starts at element ``(r // R_DIV) * R_OUTER + r % R_DIV`` of the contiguous input and its
members are ``E_STRIDE`` elements apart, which covers both layouts of
:class:`~kvpolicy.formats.packed.PackedTensor` for ``x`` of shape ``(B, H, T, D)``:

* token axis (channels of one token): ``R_DIV = 1, R_OUTER = G, E_STRIDE = 1``;
* channel axis (tokens of one channel): ``R_DIV = D, R_OUTER = G * D, E_STRIDE = D``.

Codes, scales and minimums are stored group after group (``(n_groups, G * BITS // 8)`` bytes and
``(n_groups,)``), which is exactly the documented ``PackedTensor`` layout; codes are packed
``PER = 8 // BITS`` to a byte, lowest bits first.

The arithmetic follows the ``torch`` reference operation for operation, in float32: the minimum is
rounded *down* and the scale ``(max - min16) / qmax`` rounded *up* to the metadata dtype (a no-op for
float32 metadata),
``code = clamp(round_half_even((x - min16) * (1 / scale16)), 0, qmax)`` (``1 / 0`` taken as 0), and
``x_hat = code * scale16 + min16`` (two roundings: launch with ``enable_fp_fusion=False``).

bfloat16 tensors are read and written through ``int16`` views and converted with integer
arithmetic (bf16 is the top half of a float32; float32 -> bf16 rounds to nearest even). This keeps
compiled and interpreted runs identical: the interpreter's own float32 -> bf16 cast truncates.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.standard import _elementwise_max, _elementwise_min

# Reductions go through ``tl.reduce`` with the standard library's combine functions (what
# ``tl.max``/``tl.min`` do inside): ``tl.max`` itself is a ``@triton.jit`` function decorated when
# ``triton`` is imported, in the mode of that moment, and an interpreted kernel cannot call a
# compiled-mode one. The interpreter recognises these combine functions and reduces with NumPy.


@triton.jit(do_not_specialize=["n_groups"])
def quantize_pack_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    zeros_ptr,
    n_groups,
    R_DIV: tl.constexpr,
    R_OUTER: tl.constexpr,
    E_STRIDE: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    BITS: tl.constexpr,
    PER: tl.constexpr,
    NB: tl.constexpr,
    NBP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IN_BF16: tl.constexpr,
    META_BF16: tl.constexpr,
    META_F32: tl.constexpr,
):
    """Quantize ``BLOCK_N`` groups per program.

    ``x_ptr``: the input (``int16`` view when ``IN_BF16``); ``codes_ptr``: ``uint8`` ``(n_groups, NB)``;
    ``scales_ptr``/``zeros_ptr``: ``(n_groups,)``, ``int16`` views of bf16 when ``META_BF16``, float32
    when ``META_F32``, else float16. ``GP``/``NBP``: ``G``/``NB`` rounded up to powers of two (block
    shapes). Metadata that overflows its dtype is stored as it comes (``inf``): the backend checks it.
    """
    qmax = (1 << BITS) - 1
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < n_groups
    base = (rows // R_DIV) * R_OUTER + rows % R_DIV
    e = tl.arange(0, GP)
    m = rmask[:, None] & (e[None, :] < G)
    offs = base[:, None] + e[None, :] * E_STRIDE
    if IN_BF16:
        x = (tl.load(x_ptr + offs, mask=m, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(x_ptr + offs, mask=m, other=0).to(tl.float32)
    lo = tl.where(rmask, tl.reduce(tl.where(m, x, float("inf")), 1, _elementwise_min), 0.0)
    hi = tl.where(rmask, tl.reduce(tl.where(m, x, -float("inf")), 1, _elementwise_max), 0.0)

    if META_F32:
        # float32 metadata: the float32 minimum and quotient are stored as they are (nothing to round)
        z = lo
        s = tl.math.div_rn(hi - z, tl.full(hi.shape, qmax, tl.float32))
        tl.store(zeros_ptr + rows, z, mask=rmask)
        tl.store(scales_ptr + rows, s, mask=rmask)
    elif META_BF16:
        # largest bf16 <= lo: truncate the low half of the float32, away from zero for negatives
        zb = lo.to(tl.int32, bitcast=True)
        zt = zb & -65536
        zb = tl.where((zb < 0) & ((zb & 65535) != 0), zt + 65536, zt)
        z = zb.to(tl.float32, bitcast=True)
        span = tl.math.div_rn(hi - z, tl.full(hi.shape, qmax, tl.float32))
        # smallest bf16 >= span (span >= 0)
        sb = span.to(tl.int32, bitcast=True)
        st = sb & -65536
        sb = tl.where((sb >= 0) & ((sb & 65535) != 0), st + 65536, st)
        s = sb.to(tl.float32, bitcast=True)
        tl.store(zeros_ptr + rows, (zb >> 16).to(tl.int16), mask=rmask)
        tl.store(scales_ptr + rows, (sb >> 16).to(tl.int16), mask=rmask)
    else:
        # round to nearest float16, then step one ulp down (up) if that went the wrong way
        z16 = lo.to(tl.float16)
        zb = z16.to(tl.int16, bitcast=True).to(tl.int32)
        down = tl.where((zb & 32767) == 0, -32767, tl.where(zb > 0, zb - 1, zb + 1))
        zb = tl.where(z16.to(tl.float32) > lo, down, zb)
        z16 = zb.to(tl.int16).to(tl.float16, bitcast=True)
        z = z16.to(tl.float32)
        span = tl.math.div_rn(hi - z, tl.full(hi.shape, qmax, tl.float32))
        s16 = span.to(tl.float16)
        sb = s16.to(tl.int16, bitcast=True).to(tl.int32)
        up = tl.where((sb & 32767) == 0, 1, tl.where(sb > 0, sb + 1, sb - 1))
        sb = tl.where(s16.to(tl.float32) < span, up, sb)
        s16 = sb.to(tl.int16).to(tl.float16, bitcast=True)
        s = s16.to(tl.float32)
        tl.store(zeros_ptr + rows, z16, mask=rmask)
        tl.store(scales_ptr + rows, s16, mask=rmask)

    inv = tl.where(s > 0, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), tl.where(s > 0, s, 1.0)), 0.0)
    j = tl.arange(0, NBP)
    jm = rmask[:, None] & (j[None, :] < NB)
    packed = tl.full([BLOCK_N, NBP], 0, tl.int32)
    for k in tl.static_range(PER):
        offs_k = base[:, None] + (j[None, :] * PER + k) * E_STRIDE
        if IN_BF16:
            xk = (tl.load(x_ptr + offs_k, mask=jm, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            xk = tl.load(x_ptr + offs_k, mask=jm, other=0).to(tl.float32)
        y = (xk - z[:, None]) * inv[:, None]
        # round half to even (torch.round), from floor so it runs the same compiled and interpreted
        r = tl.math.floor(y)
        frac = y - r
        odd = (r - 2.0 * tl.math.floor(r * 0.5)) == 1.0
        r = tl.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)
        c = tl.minimum(tl.maximum(r, 0.0), qmax * 1.0).to(tl.int32)
        packed = packed | (c << (BITS * k))
    tl.store(codes_ptr + rows[:, None] * NB + j[None, :], packed.to(tl.uint8), mask=jm)


@triton.jit(do_not_specialize=["n_groups"])
def unpack_dequantize_kernel(
    codes_ptr,
    scales_ptr,
    zeros_ptr,
    out_ptr,
    n_groups,
    R_DIV: tl.constexpr,
    R_OUTER: tl.constexpr,
    E_STRIDE: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    BITS: tl.constexpr,
    PER: tl.constexpr,
    NB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    OUT_BF16: tl.constexpr,
    OUT_F16: tl.constexpr,
    META_BF16: tl.constexpr,
):
    """Write ``code * scale + min`` of ``BLOCK_N`` groups per program into ``out_ptr`` (``int16``
    view when ``OUT_BF16``; float32 -> bf16 rounds to nearest even). ``OUT_F16``: clamped to
    ``±65504`` first, as the ``torch`` backend does (a grid top past 65504 would round to ``inf``).
    Metadata: ``int16`` views of bf16 when ``META_BF16``, else float16 or float32 (read through the
    pointer's own type)."""
    qmax = (1 << BITS) - 1
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < n_groups
    base = (rows // R_DIV) * R_OUTER + rows % R_DIV
    e = tl.arange(0, GP)
    m = rmask[:, None] & (e[None, :] < G)
    byte = tl.load(codes_ptr + rows[:, None] * NB + e[None, :] // PER, mask=m, other=0).to(tl.int32)
    code = (byte >> ((e[None, :] % PER) * BITS)) & qmax
    if META_BF16:
        s = (tl.load(scales_ptr + rows, mask=rmask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        z = (tl.load(zeros_ptr + rows, mask=rmask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        s = tl.load(scales_ptr + rows, mask=rmask, other=0).to(tl.float32)
        z = tl.load(zeros_ptr + rows, mask=rmask, other=0).to(tl.float32)
    v = code.to(tl.float32) * s[:, None] + z[:, None]
    if OUT_F16:
        v = tl.minimum(tl.maximum(v, -65504.0), 65504.0)
    offs = base[:, None] + e[None, :] * E_STRIDE
    if OUT_BF16:
        vb = v.to(tl.int32, bitcast=True)
        vb = (vb + 32767 + ((vb >> 16) & 1)) >> 16
        tl.store(out_ptr + offs, vb.to(tl.int16), mask=m)
    else:
        tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=m)
