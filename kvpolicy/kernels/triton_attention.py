"""Triton kernel: decode attention read straight from bit-packed keys and values.

One program handles one (batch, kv head), one block of ``QB`` queries and one split of the tokens
(flash-decoding: splits are merged afterwards through their log-sum-exp). It walks the tokens in
tiles with an online softmax and never writes keys or values back to memory in any float format.

Keys quantized per channel (the KIVI layout, ``K_CHANNEL``): a tile is one key group of ``K_G``
tokens, whose channel ``c`` has one scale ``s_c`` and minimum ``z_c``, so

    q . K_hat_t = sum_c (q_c s_c) code_{t,c} + sum_c q_c z_c

is one ``(QB, D) x (D, K_G)`` product of the scaled queries with the integer codes plus one bias
per query. Keys quantized per token, and values in either layout, are dequantized in registers,
element by element (``code * scale + min`` in float32), and multiplied from there.

Addressing inside one (batch, head), whose codes and metadata start at ``b * stride_b + h * stride_h``
and are contiguous from there (so token slices of a larger container are read in place), for token
``t`` and channel ``c``, ``e = t * D + c``:

* token axis, group size ``G``: byte ``e // PER``, bit offset ``BITS * (e % PER)``, metadata ``e // G``;
* channel axis: group ``r = (t // G) * D + c``, position ``w = t % G``: byte ``r * (G // PER) + w // PER``,
  bit offset ``BITS * (w % PER)``, metadata ``r``.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.standard import _elementwise_max, _sum_combine

# No ``tl.max``/``tl.sum``/``tl.zeros``/``tl.cdiv``: those are ``@triton.jit`` functions fixed in one
# mode when ``triton`` is imported (see :mod:`kvpolicy.kernels.triton_quant`).


# runtime sizes and strides are not specialised (n_tokens changes every decode step): one compile per layout
@triton.jit(
    do_not_specialize=[
        "n_tokens", "n_q", "tiles_per_split", "n_heads", "kc_sb", "kc_sh", "km_sb", "km_sh", "vc_sb", "vc_sh",
        "vm_sb", "vm_sh",
    ]
)  # fmt: skip
def decode_attention_kernel(
    q_ptr,
    kc_ptr,
    ks_ptr,
    kz_ptr,
    vc_ptr,
    vs_ptr,
    vz_ptr,
    out_ptr,
    lse_ptr,
    n_tokens,
    n_q,
    tiles_per_split,
    sm_scale,
    n_heads,
    kc_sb,
    kc_sh,
    km_sb,
    km_sh,
    vc_sb,
    vc_sh,
    vm_sb,
    vm_sh,
    D: tl.constexpr,
    DP: tl.constexpr,
    DV: tl.constexpr,
    DVP: tl.constexpr,
    K_CHANNEL: tl.constexpr,
    K_BITS: tl.constexpr,
    K_PER: tl.constexpr,
    K_G: tl.constexpr,
    K_BF16: tl.constexpr,
    V_CHANNEL: tl.constexpr,
    V_BITS: tl.constexpr,
    V_PER: tl.constexpr,
    V_G: tl.constexpr,
    V_BF16: tl.constexpr,
    TILE: tl.constexpr,
    BT: tl.constexpr,
    QB: tl.constexpr,
):
    """Partial attention of one split.

    ``q_ptr``: float32 ``(B*H, n_q, D)``; ``kc/vc``: packed ``uint8`` codes; ``ks/kz/vs/vz``: metadata
    (``int16`` views of bf16 when ``*_BF16``, else float16 or float32), with batch / head strides ``*_sb``/``*_sh``
    (``kc``: key codes, ``km``: key scales and minimums, likewise ``vc``, ``vm``). Writes ``out_ptr``: float32
    ``(B*H, splits, n_q, DV)`` (normalised within the split) and ``lse_ptr``: ``(B*H, splits, n_q)``
    (``-inf`` for a split without tokens). ``TILE`` real tokens per tile (``K_G`` when
    ``K_CHANNEL``), padded to ``BT``; ``DP``/``DVP``: head dims padded to powers of two.
    """
    k_mask_bits = (1 << K_BITS) - 1
    v_mask_bits = (1 << V_BITS) - 1
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

    m_i = tl.full([QB], -float("inf"), tl.float32)
    l_i = tl.full([QB], 0.0, tl.float32)
    acc = tl.full([QB, DVP], 0.0, tl.float32)
    n_tiles = (n_tokens + TILE - 1) // TILE
    t_begin = split * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, n_tiles)
    tt = tl.arange(0, BT)
    for tile in range(t_begin, t_end):
        t = tile * TILE + tt
        tmask = (tt < TILE) & (t < n_tokens)
        km = tmask[:, None] & cmask[None, :]
        # ---- scores from packed keys
        if K_CHANNEL:
            r = tile * D + c  # (DP,) one group per channel (offsets within a head fit in int32)
            if K_BF16:
                ks = (tl.load(ks_ptr + r, mask=cmask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
                kz = (tl.load(kz_ptr + r, mask=cmask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
            else:
                ks = tl.load(ks_ptr + r, mask=cmask, other=0).to(tl.float32)
                kz = tl.load(kz_ptr + r, mask=cmask, other=0).to(tl.float32)
            kbyte = tl.load(kc_ptr + r[None, :] * (K_G // K_PER) + tt[:, None] // K_PER, mask=km, other=0)
            kcode = ((kbyte.to(tl.int32) >> ((tt[:, None] % K_PER) * K_BITS)) & k_mask_bits).to(tl.float32)
            scores = tl.dot(q * ks[None, :], tl.trans(kcode), input_precision="ieee")
            scores = scores + tl.reduce(q * kz[None, :], 1, _sum_combine)[:, None]
        else:
            e = t[:, None].to(tl.int64) * D + c[None, :]  # (BT, DP)
            kbyte = tl.load(kc_ptr + e // K_PER, mask=km, other=0)
            kcode = ((kbyte.to(tl.int32) >> ((e % K_PER) * K_BITS)) & k_mask_bits).to(tl.float32)
            if K_BF16:
                ks = (tl.load(ks_ptr + e // K_G, mask=km, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
                kz = (tl.load(kz_ptr + e // K_G, mask=km, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
            else:
                ks = tl.load(ks_ptr + e // K_G, mask=km, other=0).to(tl.float32)
                kz = tl.load(kz_ptr + e // K_G, mask=km, other=0).to(tl.float32)
            khat = tl.where(km, kcode * ks + kz, 0.0)
            scores = tl.dot(q, tl.trans(khat), input_precision="ieee")
        scores = tl.where(tmask[None, :], scores, -float("inf"))
        # ---- online softmax (every tile holds at least one token, so m_new is finite)
        m_new = tl.maximum(m_i, tl.reduce(scores, 1, _elementwise_max))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
        # ---- values, dequantized in registers
        vm = tmask[:, None] & cvmask[None, :]
        if V_CHANNEL:
            rv = (t[:, None] // V_G).to(tl.int64) * DV + cv[None, :]
            w = t[:, None] % V_G
            vbyte = tl.load(vc_ptr + rv * (V_G // V_PER) + w // V_PER, mask=vm, other=0)
            vcode = ((vbyte.to(tl.int32) >> ((w % V_PER) * V_BITS)) & v_mask_bits).to(tl.float32)
            vmeta = rv
        else:
            ev = t[:, None].to(tl.int64) * DV + cv[None, :]
            vbyte = tl.load(vc_ptr + ev // V_PER, mask=vm, other=0)
            vcode = ((vbyte.to(tl.int32) >> ((ev % V_PER) * V_BITS)) & v_mask_bits).to(tl.float32)
            vmeta = ev // V_G
        if V_BF16:
            vs = (tl.load(vs_ptr + vmeta, mask=vm, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
            vz = (tl.load(vz_ptr + vmeta, mask=vm, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            vs = tl.load(vs_ptr + vmeta, mask=vm, other=0).to(tl.float32)
            vz = tl.load(vz_ptr + vmeta, mask=vm, other=0).to(tl.float32)
        vhat = tl.where(vm, vcode * vs + vz, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p, vhat, input_precision="ieee")
        m_i = m_new

    has = l_i > 0
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), -float("inf"))
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    row = (bh * n_splits + split) * n_q + qi
    tl.store(out_ptr + row[:, None] * DV + cv[None, :], out, mask=qmask[:, None] & cvmask[None, :])
    tl.store(lse_ptr + row, lse, mask=qmask)
