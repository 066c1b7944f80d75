"""Triton kernels: decode attention read straight from quantized keys and values, and the merge of its splits.

:func:`decode_attention_kernel`: one program handles one (batch, kv head), one block of ``QB`` queries and one
split of the tokens (flash-decoding). It walks its tokens in tiles with an online softmax, reads each code
once, and never writes keys or values back to memory in any float format. :func:`merge_splits_kernel` merges
the splits through their log-sum-exps.

Each role (keys, values) is one of three *kinds* (``K_KIND``/``V_KIND``):

- ``MINMAX_TOKEN`` (0): min-max groups of ``G`` consecutive channels of one token
  (:class:`~kvpolicy.formats.packed.PackedTensor`, ``axis="token"``), dequantized in registers
  (``code * scale + min`` in float32);
- ``MINMAX_CHANNEL`` (1): min-max groups of ``G`` consecutive tokens of one channel (``axis="channel"``).
  Keys of this kind take tiles of one group, whose channel ``c`` has one scale ``s_c`` and minimum ``z_c``, so
  ``q . K_hat_t = sum_c (q_c s_c) code_{t,c} + sum_c q_c z_c``: one product of the scaled queries with the
  integer codes plus one bias per query;
- ``CODEBOOK`` (2): Lloyd-Max indices with one scale per token (:class:`~kvpolicy.formats.codebook.CodebookTensor`):
  keys score ``s_t (q . C[codes_t])``, values add ``(p_t s_t) C[codes_t]``; the centroids ``C`` are a table
  of ``2**bits`` floats. Scales are in the metadata dtype, or one-byte log-scale codes around a base per
  (batch, head) (``*_BYTE``), decoded here exactly as :func:`kvpolicy.formats.scale_codes.decode_scales`
  does: ``steps[k mod 64] * 2**floor(k / 64)`` of their grid index ``k``, the power of two built from its
  bits (the table ``steps`` is the decoder's own). A centre ``mu`` (``*_CENTRE``) adds ``q . mu`` to every
  key score (the part's log-sum-exp moves by it) and ``mu`` to the values' output.

Codes are bit-packed, ``BITS`` of 2, 3, 4 or 8, lowest bits first, as :func:`kvpolicy.formats.packed.pack`
packs them; every layout puts element ``i`` of a (batch, head) at bits ``BITS * i .. BITS * i + BITS - 1`` of its
bytes, with ``i = t * D + c`` (per token, token ``t``, channel ``c``: min-max token groups and codebook rows)
or ``i = ((t // G) * D + c) * G + t % G`` (min-max channel groups), so one rule reads them all (a 3-bit code
may straddle two bytes). Offsets inside a tile are int32; each tile's start is an int64 offset, so the
length of a history is not bounded by 32-bit arithmetic.

Metadata (scales, minimums, centres) is float16, bfloat16 or float32; bfloat16 travels as ``int16`` bit
patterns (``*_BF16``: the interpreter has no bfloat16) and is widened with integer arithmetic.

No ``tl.max``/``tl.sum``/``tl.zeros``/``tl.cdiv`` here: those are ``@triton.jit`` functions fixed in one mode
when ``triton`` is imported (see :mod:`kvpolicy.kernels.triton_runtime`); reductions go through
``tl.reduce`` with the standard library's combine functions. The helpers below are this module's own
``@triton.jit`` functions, re-wrapped with the kernels when the mode changes.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.standard import _elementwise_max, _sum_combine

#: the kinds of a role's blocks (``K_KIND``/``V_KIND``)
MINMAX_TOKEN, MINMAX_CHANNEL, CODEBOOK = 0, 1, 2


@triton.jit
def _codes_at(base_ptr, bit, mask, BITS: tl.constexpr):
    """The ``BITS``-bit codes starting at bit offsets ``bit`` (int32) of the bytes at ``base_ptr`` (int32)."""
    byte = bit >> 3
    shift = bit & 7
    word = tl.load(base_ptr + byte, mask=mask, other=0).to(tl.int32)
    if BITS == 3:  # a 3-bit code at bit offset 6 or 7 of its byte continues in the next one
        nxt = tl.load(base_ptr + byte + 1, mask=mask & (shift > 5), other=0).to(tl.int32)
        word = word | (nxt << 8)
    return (word >> shift) & ((1 << BITS) - 1)


@triton.jit
def _meta(ptr, offs, mask, BF16: tl.constexpr):
    """Metadata as float32: ``int16`` bit patterns of bfloat16 (``BF16``), or float16 / float32."""
    if BF16:
        return (tl.load(ptr + offs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0).to(tl.float32)


@triton.jit
def _byte_scales(codes_ptr, offs, mask, beta, steps_ptr):
    """One-byte log-scale codes decoded around the base ``beta`` (int32), bit for bit as
    :func:`kvpolicy.formats.scale_codes.decode_scales` decodes them (see the module docstring there)."""
    c = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    anchor = ((beta + 63) >> 2) << 2  # the largest multiple of 4 below beta + 64 (arithmetic shifts: floors)
    k = tl.where(c >= 64, beta + c, anchor - 4 * (63 - c))
    octave = k >> 6
    step = tl.load(steps_ptr + (k & 63), mask=mask, other=0.0)
    # 2**octave from its float32 bits: normal for octave >= -126, subnormal down to 2**-149, zero below
    normal = (tl.maximum(octave, -126) + 127) << 23
    subnormal = 1 << tl.minimum(tl.maximum(octave + 149, 0), 22)
    bits = tl.where(octave >= -126, normal, tl.where(octave >= -149, subnormal, 0))
    return tl.where(c == 0, 0.0, step * bits.to(tl.float32, bitcast=True))


@triton.jit
def _token_scales(s_ptr, t_local, mask, beta, steps_ptr, BYTE: tl.constexpr, BF16: tl.constexpr):
    """Per-token scales of a codebook tile (``s_ptr``: at the tile's first token)."""
    if BYTE:
        return _byte_scales(s_ptr, t_local, mask, beta, steps_ptr)
    else:
        return _meta(s_ptr, t_local, mask, BF16)


@triton.jit
def _values_tile(
    vc_ptr, vs_ptr, vz_ptr, vtab_ptr, steps_ptr, v_beta, t0, t64, tt, tmask, cv, cvmask,
    DV: tl.constexpr, V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_G: tl.constexpr, V_BF16: tl.constexpr,
    V_BYTE: tl.constexpr,
):  # fmt: skip
    """One tile's values ``(BT, DVP)`` float32 and their per-token factor ``(BT,)``: dequantized min-max values
    (factor 1), or codebook centroids whose factor is each token's scale. ``t0``: the tile's first token
    (``t64``: the same as an int64 scalar)."""
    vm = tmask[:, None] & cvmask[None, :]
    if V_KIND == 2:
        e = tt[:, None] * DV + cv[None, :]
        code = _codes_at(vc_ptr + t64 * (DV * V_BITS // 8), V_BITS * e, vm, V_BITS)
        unit = tl.load(vtab_ptr + code, mask=vm, other=0.0)
        factor = _token_scales(vs_ptr + t64, tt, tmask, v_beta, steps_ptr, V_BYTE, V_BF16)
        return unit, tl.where(tmask, factor, 0.0)
    else:
        if V_KIND == 1:
            g0 = t0 // V_G  # the tile's first group row: its bytes and metadata start at int64 offsets
            g64 = t64 // V_G
            t = t0 + tt
            r = ((t // V_G) - g0)[:, None] * DV + cv[None, :]
            code = _codes_at(vc_ptr + g64 * (DV * V_G * V_BITS // 8), V_BITS * (r * V_G + (t % V_G)[:, None]),
                             vm, V_BITS)  # fmt: skip
            meta_base = g64 * DV
            meta = r
        else:
            e = tt[:, None] * DV + cv[None, :]
            code = _codes_at(vc_ptr + t64 * (DV * V_BITS // 8), V_BITS * e, vm, V_BITS)
            meta_base = t64 * (DV // V_G)
            meta = e // V_G
        s = _meta(vs_ptr + meta_base, meta, vm, V_BF16)
        z = _meta(vz_ptr + meta_base, meta, vm, V_BF16)
        return tl.where(vm, code.to(tl.float32) * s + z, 0.0), tl.where(tmask, 1.0, 0.0)


# runtime sizes and strides are not specialised (n_tokens changes every decode step): one compile per layout
@triton.jit(
    do_not_specialize=[
        "n_tokens", "n_q", "tiles_per_split", "n_heads", "kc_sb", "kc_sh", "km_sb", "km_sh", "vc_sb", "vc_sh",
        "vm_sb", "vm_sh",
    ]
)  # fmt: skip
def decode_attention_kernel(
    q_ptr, out_ptr, lse_ptr, bias_ptr,
    kc_ptr, ks_ptr, kz_ptr, kbase_ptr, kmu_ptr, ktab_ptr,
    vc_ptr, vs_ptr, vz_ptr, vbase_ptr, vmu_ptr, vtab_ptr,
    steps_ptr,
    n_tokens, n_q, tiles_per_split, sm_scale, n_heads,
    kc_sb, kc_sh, km_sb, km_sh, vc_sb, vc_sh, vm_sb, vm_sh,
    D: tl.constexpr, DP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_G: tl.constexpr, K_BF16: tl.constexpr, K_BYTE: tl.constexpr,
    K_CENTRE: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_G: tl.constexpr, V_BF16: tl.constexpr, V_BYTE: tl.constexpr,
    V_CENTRE: tl.constexpr,
    BIAS: tl.constexpr, TILE: tl.constexpr, BT: tl.constexpr, QB: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Partial attention of one split.

    ``q_ptr``: float32 ``(B*H, n_q, D)``, unscaled. Per role (``k``: keys, ``v``: values): ``*c_ptr`` the packed
    ``uint8`` codes; ``*s_ptr``/``*z_ptr`` scales and minimums (codebook: scales only, or one-byte codes); a
    codebook role's ``*base_ptr`` (contiguous int16 ``(B, H)``, one-byte scales), ``*mu_ptr`` (contiguous centre,
    ``(B, H, D)`` in the metadata dtype) and ``*tab_ptr`` (its ``2**bits`` float32 centroids); ``steps_ptr``: the 64
    float32 octave steps of one-byte scales. Batch / head strides, in elements: ``*c_sb``/``*c_sh`` of the codes,
    ``*m_sb``/``*m_sh`` of the scales and minimums (inside one (batch, head) both are contiguous).
    ``bias_ptr`` (``BIAS``): float32 ``(B*H, n_q, n_tokens)`` added to the scaled scores. Writes ``out_ptr``:
    float32 ``(B*H, splits, n_q, DV)`` (normalised within the split) and ``lse_ptr``: ``(B*H, splits, n_q)``
    (``-inf`` for a split without tokens). ``TILE`` tokens per tile (``K_G`` for keys of
    kind ``MINMAX_CHANNEL``), padded to ``BT``; ``DP``/``DVP``: head dims padded to powers of two; ``PRECISION``:
    the products' ``input_precision`` (``"ieee"`` float32, ``"tf32"`` tensor cores).
    """
    bh = tl.program_id(0).to(tl.int64)
    b = bh // n_heads
    h = bh % n_heads
    kc_ptr += b * kc_sb + h * kc_sh
    ks_ptr += b * km_sb + h * km_sh
    kz_ptr += b * km_sb + h * km_sh
    vc_ptr += b * vc_sb + h * vc_sh
    vs_ptr += b * vm_sb + h * vm_sh
    vz_ptr += b * vm_sb + h * vm_sh
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    qi = tl.program_id(2) * QB + tl.arange(0, QB)
    qmask = qi < n_q
    c = tl.arange(0, DP)
    cmask = c < D
    cv = tl.arange(0, DVP)
    cvmask = cv < DV
    q = tl.load(q_ptr + (bh * n_q + qi[:, None]) * D + c[None, :], mask=qmask[:, None] & cmask[None, :], other=0.0)
    q = q * sm_scale
    k_beta = 0
    v_beta = 0
    if K_BYTE:
        k_beta = tl.load(kbase_ptr + bh).to(tl.int32)
    if V_BYTE:
        v_beta = tl.load(vbase_ptr + bh).to(tl.int32)

    m_i = tl.full([QB], -float("inf"), tl.float32)
    l_i = tl.full([QB], 0.0, tl.float32)
    acc = tl.full([QB, DVP], 0.0, tl.float32)
    n_tiles = (n_tokens + TILE - 1) // TILE
    t_begin = split * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, n_tiles)
    tt = tl.arange(0, BT)
    zero64 = tl.full([], 0, tl.int64)
    for tile in range(t_begin, t_end):
        t0 = tile * TILE
        tile64 = zero64 + tile  # int64 offsets of the tile's start (the loop index may be a plain int)
        t64 = zero64 + t0
        t = t0 + tt
        tmask = (tt < TILE) & (t < n_tokens)
        km = tmask[:, None] & cmask[None, :]
        # ---- scores from the key codes
        if K_KIND == 1:
            # one key group: channel c's codes are K_G consecutive positions of group row (tile * D + c)
            kc_tile = kc_ptr + tile64 * (D * K_G * K_BITS // 8)
            code = _codes_at(kc_tile, K_BITS * (c[None, :] * K_G + tt[:, None]), km, K_BITS).to(tl.float32)
            ks = _meta(ks_ptr + tile64 * D, c, cmask, K_BF16)
            kz = _meta(kz_ptr + tile64 * D, c, cmask, K_BF16)
            scores = tl.dot(q * ks[None, :], tl.trans(code), input_precision=PRECISION)
            scores = scores + tl.reduce(q * kz[None, :], 1, _sum_combine)[:, None]
        else:
            e = tt[:, None] * D + c[None, :]
            code = _codes_at(kc_ptr + t64 * (D * K_BITS // 8), K_BITS * e, km, K_BITS)
            if K_KIND == 2:
                unit = tl.load(ktab_ptr + code, mask=km, other=0.0)
                factor = _token_scales(ks_ptr + t64, tt, tmask, k_beta, steps_ptr, K_BYTE, K_BF16)
                scores = tl.dot(q, tl.trans(unit), input_precision=PRECISION) * factor[None, :]
            else:
                meta_base = t64 * (D // K_G)
                ks = _meta(ks_ptr + meta_base, e // K_G, km, K_BF16)
                kz = _meta(kz_ptr + meta_base, e // K_G, km, K_BF16)
                khat = tl.where(km, code.to(tl.float32) * ks + kz, 0.0)
                scores = tl.dot(q, tl.trans(khat), input_precision=PRECISION)
        if BIAS:
            brow = (bh * n_q + qi) * n_tokens
            scores = scores + tl.load(bias_ptr + brow[:, None] + t[None, :], mask=qmask[:, None] & tmask[None, :],
                                      other=0.0)  # fmt: skip
        scores = tl.where(tmask[None, :], scores, -float("inf"))
        # ---- online softmax (every tile holds at least one token, so m_new is finite for finite scores)
        m_new = tl.maximum(m_i, tl.reduce(scores, 1, _elementwise_max))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
        # ---- values: min-max dequantized in registers, or codebook centroids with each token's scale in p
        vals, vfactor = _values_tile(
            vc_ptr, vs_ptr, vz_ptr, vtab_ptr, steps_ptr, v_beta, t0, t64, tt, tmask, cv, cvmask,
            DV, V_KIND, V_BITS, V_G, V_BF16, V_BYTE,
        )  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p * vfactor[None, :], vals, input_precision=PRECISION)
        m_i = m_new

    has = l_i > 0
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), -float("inf"))
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if K_CENTRE:  # every score of the part moves by q . mu: its log-sum-exp does, its softmax does not
        kmu = _meta(kmu_ptr + bh * D, c, cmask, K_BF16)
        lse = lse + tl.reduce(q * kmu[None, :], 1, _sum_combine)
    if V_CENTRE:  # the probabilities sum to one: the centre adds to the output once
        vmu = _meta(vmu_ptr + bh * DV, cv, cvmask, V_BF16)
        out = tl.where(has[:, None], out + vmu[None, :], 0.0)
    row = (bh * n_splits + split) * n_q + qi
    tl.store(out_ptr + row[:, None] * DV + cv[None, :], out, mask=qmask[:, None] & cvmask[None, :])
    tl.store(lse_ptr + row, lse, mask=qmask)


@triton.jit(do_not_specialize=["n_q", "n_splits"])
def merge_splits_kernel(
    out_ptr, lse_ptr, merged_ptr, merged_lse_ptr, n_q, n_splits,
    DV: tl.constexpr, DVP: tl.constexpr, SP: tl.constexpr, QB: tl.constexpr,
):  # fmt: skip
    """Merge the splits of :func:`decode_attention_kernel` by their log-sum-exps.

    One program per (batch * head, block of ``QB`` queries): ``lse = log sum_s exp(lse_s)`` and
    ``out = sum_s exp(lse_s - lse) out_s`` (a split without tokens, ``lse_s = -inf``, weighs nothing). Reads
    ``out_ptr`` ``(B*H, n_splits, n_q, DV)`` and ``lse_ptr`` ``(B*H, n_splits, n_q)``; writes ``merged_ptr``
    ``(B*H, n_q, DV)`` and ``merged_lse_ptr`` ``(B*H, n_q)``. ``SP``: ``n_splits`` padded to a power of two.
    """
    bh = tl.program_id(0).to(tl.int64)
    qi = tl.program_id(1) * QB + tl.arange(0, QB)
    qmask = qi < n_q
    s = tl.arange(0, SP)
    smask = s < n_splits
    lses = tl.load(lse_ptr + (bh * n_splits + s[None, :]) * n_q + qi[:, None], mask=qmask[:, None] & smask[None, :],
                   other=-float("inf"))  # fmt: skip
    top = tl.reduce(lses, 1, _elementwise_max)
    finite = top > -float("inf")
    top = tl.where(finite, top, 0.0)
    w = tl.exp(lses - top[:, None])  # exp(-inf) = 0
    total = tl.reduce(w, 1, _sum_combine)
    lse = tl.where(finite, top + tl.log(tl.where(finite, total, 1.0)), -float("inf"))
    norm = tl.where(finite, 1.0 / tl.where(finite, total, 1.0), 0.0)
    cv = tl.arange(0, DVP)
    om = qmask[:, None] & (cv[None, :] < DV)
    acc = tl.full([QB, DVP], 0.0, tl.float32)
    for j in range(0, n_splits):
        wj = tl.exp(tl.load(lse_ptr + (bh * n_splits + j) * n_q + qi, mask=qmask, other=-float("inf")) - top) * norm
        oj = tl.load(out_ptr + ((bh * n_splits + j) * n_q + qi[:, None]) * DV + cv[None, :], mask=om, other=0.0)
        acc = acc + wj[:, None] * oj
    tl.store(merged_ptr + (bh * n_q + qi[:, None]) * DV + cv[None, :], acc, mask=om)
    tl.store(merged_lse_ptr + bh * n_q + qi, lse, mask=qmask)
