"""Tests of the ``torch`` backend against the quantization spec (policies-spec.md, section (e)).

Group membership, code layout and bit unpacking are re-derived here from the spec and the
documented container layout; the module's private helpers (``_grouped`` ...) are not used.

Layout (from the ``PackedTensor`` docstring), for ``x`` of shape ``(B, H, T, D)`` and group size G:

* ``axis="token"``: group ``(b, h, t, j)`` holds ``x[b, h, t, j*G:(j+1)*G]``;
  scales/zeros ``(B, H, T, D/G)``, codes ``(B, H, T, D/G, G*bits/8)``.
* ``axis="channel"``: group ``(b, h, i, d)`` holds ``x[b, h, i*G:(i+1)*G, d]``;
  scales/zeros ``(B, H, T/G, D)``, codes ``(B, H, T/G, D, G*bits/8)``.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvpolicy.actions.quantize import QuantizedStream
from kvpolicy.backends.torch_backend import TorchBackend, pack, unpack
from kvpolicy.errors import ConfigError, MetadataOverflowError, NonFiniteError
from kvpolicy.formats import MinMax

BACKEND = TorchBackend()
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BITS = (2, 3, 4, 8)
HEAD_DIMS = (8, 16, 64, 96, 128)
EPS32 = torch.finfo(torch.float32).eps

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------------------------------
# independent helpers (written from the spec, not from the implementation)
# --------------------------------------------------------------------------------------------------


def meta_dtype_of(dtype: torch.dtype) -> torch.dtype:
    """Spec/docstring: scales and minimums are bf16 for bf16 inputs, fp16 otherwise."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float16


def _bit_stream(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes as one little-endian bit stream: ``(..., n)`` -> ``(..., n * bits)`` bits, code ``i`` at
    bits ``i * bits ..`` (how 3-bit codes are packed, and what 2/4/8 bits amount to as well)."""
    c = codes.to(torch.int64)
    bit = torch.stack([(c >> b) & 1 for b in range(bits)], dim=-1)
    return bit.reshape(*codes.shape[:-1], codes.shape[-1] * bits)


def ref_unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``8 // bits`` codes per byte, lowest bits first (3 bits: a little-endian bit stream, eight codes
    per three bytes); returns int64 codes."""
    if bits == 3:
        p = packed.to(torch.int64)
        stream = torch.stack([(p >> b) & 1 for b in range(8)], dim=-1).reshape(*p.shape[:-1], -1)
        stream = stream.reshape(*p.shape[:-1], -1, 3)
        return stream[..., 0] | (stream[..., 1] << 1) | (stream[..., 2] << 2)
    per = 8 // bits
    mask = (1 << bits) - 1
    p = packed.to(torch.int64)
    parts = [(p >> (bits * j)) & mask for j in range(per)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * per)


def ref_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 3:
        stream = _bit_stream(codes, 3).reshape(*codes.shape[:-1], -1, 8)
        return sum(stream[..., k] << k for k in range(8)).to(torch.uint8)
    per = 8 // bits
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    out = torch.zeros(c.shape[:-1], dtype=torch.int64)
    for j in range(per):
        out |= c[..., j] << (bits * j)
    return out.to(torch.uint8)


def to_groups(x: torch.Tensor, g: int, axis: str) -> torch.Tensor:
    """``(B, H, T, D)`` -> ``(*meta_shape, G)``: the members of each group on the last dim."""
    b, h, t, d = x.shape
    if axis == "token":
        # consecutive channels of one token
        return x.reshape(b, h, t, d // g, g)
    # consecutive tokens of one channel: (B, H, T/G, G, D) -> (B, H, T/G, D, G)
    return x.reshape(b, h, t // g, g, d).permute(0, 1, 2, 4, 3)


def per_element(meta: torch.Tensor, g: int, axis: str) -> torch.Tensor:
    """Broadcast a per-group tensor (scales/zeros) to every element of its group."""
    return meta.repeat_interleave(g, dim=3 if axis == "token" else 2)


def element_codes(q, g: int, axis: str) -> torch.Tensor:
    """The (unpacked) code of every element, shaped like ``x``."""
    c = ref_unpack(q.codes, q.bits)  # (*meta_shape, G)
    b, h, t, d = q.shape
    if axis == "token":
        return c.reshape(b, h, t, d)
    return c.permute(0, 1, 2, 4, 3).reshape(b, h, t, d)


def tolerance(x: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-element error bound (float64 tensors ``x``, ``s``, ``z`` per element).

    tol = s/2                                   # the spec's bound: round-to-nearest code
        + eps_d * (|x| + s)                     # final cast of x_hat to the input dtype: half an ulp of
                                                # |x_hat| <= |x| + s/2 (+ tiny), i.e. <= eps_d/2*(|x|+s/2)
        + 4 * eps32 * (|x| + |z| + qmax * s)    # fp32 arithmetic inside quantize/dequantize: (x - z)*(1/s)
                                                # may misround a near-tie code by ~3 eps32 * |x - z|, and
                                                # code*s + z is rounded twice (<= eps32 * (qmax*s + |z|))
        + tiny_d                                # subnormal spacing of the output dtype (underflow)

    With eps_d = torch.finfo(dtype).eps (2^-23 fp32, 2^-10 fp16, 2^-7 bf16). The extra terms are
    the "+ dtype rounding" of the spec; all are tiny next to s/2 except the output cast, which is
    at most eps_d * |x| for values not near zero.
    """
    fi = torch.finfo(dtype)
    qmax = (1 << bits) - 1
    ax = x.abs()
    return s / 2 + fi.eps * (ax + s) + 4 * EPS32 * (ax + z.abs() + qmax * s) + fi.tiny * fi.eps


@st.composite
def configs(draw, axes=("token", "channel")):
    axis = draw(st.sampled_from(axes))
    dtype = draw(st.sampled_from(DTYPES))
    bits = draw(st.sampled_from(BITS))
    batch = draw(st.integers(1, 3))
    heads = draw(st.integers(1, 4))
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    step = 8 if bits == 3 else 4  # 3-bit groups hold whole runs of eight codes (three bytes)
    if axis == "token":
        g = draw(st.sampled_from([v for v in range(step, head_dim + 1, step) if head_dim % v == 0]))
        tokens = draw(st.integers(1, 24))
    else:
        g = draw(st.sampled_from([v for v in (4, 8, 12, 16, 32) if v % step == 0]))
        tokens = g * draw(st.integers(1, 3))
    return axis, dtype, bits, (batch, heads, tokens, head_dim), g


@st.composite
def data(draw, shape, dtype):
    """A tensor of ``dtype``: random values at several scales/offsets, sometimes with outliers,
    integer values (ties) or constant runs."""
    seed = draw(st.integers(0, 2**31 - 1))
    kind = draw(st.sampled_from(["randn", "uniform", "outliers", "ints", "some_constant"]))
    scale = draw(st.sampled_from([1e-3, 0.1, 1.0, 30.0]))
    offset = draw(st.sampled_from([0.0, 1.0, -7.5, 100.0]))
    gen = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        x = torch.rand(shape, generator=gen) * 2 - 1
    elif kind == "ints":
        x = torch.randint(-4, 5, shape, generator=gen).float()
    else:
        x = torch.randn(shape, generator=gen)
    if kind == "outliers":
        mask = torch.rand(shape, generator=gen) < 0.02
        x = torch.where(mask, x * 50, x)
    x = x * scale + offset
    if kind == "some_constant":
        # constant along channels for some tokens and along tokens for some channels
        x[:, :, ::3, :] = offset
        x[..., ::5] = 2.0
    return x.to(dtype)


def check_bound(x: torch.Tensor, bits: int, g: int, axis: str):
    q = BACKEND.quantize(x, bits, g, axis)
    xh = BACKEND.dequantize(q)
    assert xh.shape == x.shape
    assert xh.dtype == x.dtype
    assert torch.isfinite(xh).all()
    s = per_element(q.scales, g, axis).double()
    z = per_element(q.zeros, g, axis).double()
    xd = x.double()
    err = (xd - xh.double()).abs()
    tol = tolerance(xd, s, z, bits, x.dtype)
    bad = err > tol
    assert not bad.any(), (
        f"{int(bad.sum())} elements exceed the bound; worst excess {float((err - tol).max())}, "
        f"x={xd[bad][:4].tolist()} x_hat={xh.double()[bad][:4].tolist()} s={s[bad][:4].tolist()}"
    )
    return q, xh


# --------------------------------------------------------------------------------------------------
# error bound
# --------------------------------------------------------------------------------------------------


@SETTINGS
@given(st.data())
def test_error_within_half_step(d):
    axis, dtype, bits, shape, g = d.draw(configs())
    x = d.draw(data(shape, dtype))
    q, xh = check_bound(x, bits, g, axis)
    # the layout re-derived here agrees with dequantize: x_hat = code * s + min (computed in fp32)
    codes = element_codes(q, g, axis)
    assert int(codes.max()) <= (1 << bits) - 1
    s = per_element(q.scales, g, axis).float()
    z = per_element(q.zeros, g, axis).float()
    assert torch.equal(xh, (codes.float() * s + z).to(dtype))


@SETTINGS
@given(st.data())
def test_metadata_dtypes_and_directed_rounding(d):
    """min is rounded down and scale up in the 16-bit meta dtype: z <= lo < next_up(z) and
    s * qmax >= hi - z > next_down(s) * qmax (up to fp32 arithmetic, 1e-6 relative)."""
    axis, dtype, bits, shape, g = d.draw(configs())
    x = d.draw(data(shape, dtype))
    q = BACKEND.quantize(x, bits, g, axis)
    mdt = meta_dtype_of(dtype)
    assert q.scales.dtype == mdt and q.zeros.dtype == mdt
    qmax = (1 << bits) - 1
    grp = to_groups(x.double(), g, axis)
    lo, hi = grp.amin(-1), grp.amax(-1)
    z, s = q.zeros.double(), q.scales.double()
    z_up = torch.nextafter(q.zeros, torch.full_like(q.zeros, math.inf)).double()
    s_down = torch.nextafter(q.scales, torch.zeros_like(q.scales)).double()
    assert (z <= lo).all()
    assert (lo < z_up).all()
    if dtype == mdt:  # input already representable in the meta dtype: the minimum is stored exactly
        assert torch.equal(z, lo)
    span = hi - z
    assert (s * qmax >= span * (1 - 1e-6)).all()
    nonconst = hi > lo
    assert (s_down[nonconst] * qmax < span[nonconst] * (1 + 1e-6)).all()


# --------------------------------------------------------------------------------------------------
# a group's min and max reconstruct
# --------------------------------------------------------------------------------------------------


@SETTINGS
@given(st.data())
def test_group_min_and_max_reconstruct(d):
    """What exactly holds, with z = round_down16(lo), s = round_up16((hi - z) / qmax):

    * min: its code is round((lo - z) / s) with 0 <= lo - z < ulp16(z). So the min maps to code 0
      whenever lo - z < s/2 -- always when lo is representable in the meta dtype (fp16 inputs,
      bf16 inputs), not necessarily for fp32 inputs with a narrow range far from zero.
    * max: r = (hi - z) / s lies in (qmax * (1 - u), qmax] with u = (s - next_down16(s)) / s,
      because s is the smallest 16-bit value >= (hi - z) / qmax. So its code is qmax whenever
      qmax * u < 1/2 (fp16 scales in the normal range: u <= 2^-10; bf16 with bits <= 4:
      u <= 2^-7, 15 * 2^-7 < 1/2), and at least qmax - round(qmax * u) otherwise
      (bf16 at 8 bits: >= 253).
    * either way the dequantized group min/max are within the element bound of the true ones.
    """
    axis, dtype, bits, shape, g = d.draw(configs())
    x = d.draw(data(shape, dtype))
    q, xh = check_bound(x, bits, g, axis)
    qmax = (1 << bits) - 1
    grp = to_groups(x.double(), g, axis)
    hgrp = to_groups(xh.double(), g, axis)
    cgrp = to_groups(element_codes(q, g, axis), g, axis)
    lo, hi = grp.amin(-1), grp.amax(-1)
    z, s = q.zeros.double(), q.scales.double()

    # dequantized min / max vs true min / max
    tol_lo = tolerance(lo, s, z, bits, dtype)
    tol_hi = tolerance(hi, s, z, bits, dtype)
    assert ((hgrp.amin(-1) - lo).abs() <= tol_lo).all()
    assert ((hgrp.amax(-1) - hi).abs() <= tol_hi).all()

    nonconst = hi > lo
    if not nonconst.any():
        return
    # code of the min element / max element of each group
    code_min = cgrp.gather(-1, grp.argmin(-1, keepdim=True)).squeeze(-1)
    code_max = cgrp.gather(-1, grp.argmax(-1, keepdim=True)).squeeze(-1)
    slop = 1e-4  # fp32 arithmetic near exact ties

    r_lo = (lo - z) / torch.where(s > 0, s, torch.ones_like(s))
    assert (code_min[nonconst] <= torch.floor(r_lo + 0.5 + slop)[nonconst]).all()
    zero_expected = nonconst & (r_lo < 0.5 - slop)
    assert (code_min[zero_expected] == 0).all()
    assert (cgrp.amin(-1)[zero_expected] == 0).all()  # code 0 appears in the group
    if dtype == meta_dtype_of(dtype):
        assert torch.equal(zero_expected, nonconst)  # fp16/bf16 inputs: always code 0

    u = (q.scales.double() - torch.nextafter(q.scales, torch.zeros_like(q.scales)).double()) / s.clamp_min(1e-300)
    top_expected = nonconst & (qmax * u < 0.5 - slop)
    assert (code_max[top_expected] == qmax).all()
    assert (cgrp.amax(-1)[top_expected] == qmax).all()  # the top code appears in the group
    drop = torch.floor(qmax * u + 0.5 + slop)
    assert (code_max[nonconst] >= (qmax - drop)[nonconst]).all()
    # the cases in which the top code is guaranteed, stated above
    normal = s >= torch.finfo(meta_dtype_of(dtype)).tiny
    if meta_dtype_of(dtype) == torch.float16 or bits <= 4:
        assert torch.equal(top_expected & normal, nonconst & normal)
    else:
        assert (code_max[nonconst & normal] >= qmax - 2).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_full_range_codes_exact_example(dtype, bits):
    """A group 0, 1, ..., qmax (exact in every dtype): s = 1, codes are the values themselves."""
    qmax = (1 << bits) - 1
    n = 256
    vals = torch.arange(n, dtype=torch.float32) % (qmax + 1)
    x = vals.reshape(1, 1, 1, n).to(dtype) - 3
    q = BACKEND.quantize(x, bits, n, "token")
    assert float(q.scales.float()) == 1.0
    assert float(q.zeros.float()) == -3.0
    assert torch.equal(ref_unpack(q.codes, bits).reshape(-1), vals.long())
    assert torch.equal(BACKEND.dequantize(q), x)


# --------------------------------------------------------------------------------------------------
# constant groups
# --------------------------------------------------------------------------------------------------


@SETTINGS
@given(st.data())
def test_constant_groups_reconstruct_exactly(d):
    axis, dtype, bits, shape, g = d.draw(configs())
    seed = d.draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    # one value per group: k/8 with |k| <= 255, i.e. at most 8 significant bits -> exact in fp32,
    # fp16 and bf16 (and in the 16-bit metadata)
    b, h, t, dd = shape
    meta_shape = (b, h, t, dd // g) if axis == "token" else (b, h, t // g, dd)
    vals = torch.randint(-255, 256, meta_shape, generator=gen).float() / 8
    x = per_element(vals, g, axis).to(dtype)
    assert torch.equal(x.float(), per_element(vals, g, axis))  # truly representable
    q = BACKEND.quantize(x, bits, g, axis)
    assert torch.equal(q.scales.float(), torch.zeros(meta_shape))
    assert torch.equal(q.zeros.float(), vals)
    assert torch.isfinite(q.scales.float()).all() and torch.isfinite(q.zeros.float()).all()
    xh = BACKEND.dequantize(q)
    assert not torch.isnan(xh).any()
    assert torch.equal(xh, x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [0.0, -0.0, 1.0, -3.125, 1000.0, 2.0**-14])
def test_constant_tensor_special_values(dtype, value):
    x = torch.full((2, 3, 8, 16), value, dtype=dtype)
    for axis in ("token", "channel"):
        for bits in BITS:
            q = BACKEND.quantize(x, bits, 8, axis)
            xh = BACKEND.dequantize(q)
            assert not torch.isnan(xh).any()
            assert torch.equal(xh, x), (axis, bits)


# --------------------------------------------------------------------------------------------------
# bit packing
# --------------------------------------------------------------------------------------------------


@SETTINGS
@given(st.data())
def test_packing_shrinks_bytes(d):
    axis, dtype, bits, shape, g = d.draw(configs())
    x = d.draw(data(shape, dtype))
    q = BACKEND.quantize(x, bits, g, axis)
    n = x.numel()
    assert q.codes.dtype == torch.uint8
    assert q.codes.numel() * q.codes.element_size() * 8 == n * bits
    for t in (q.scales, q.zeros):
        assert t.numel() * g == n
        assert t.element_size() == 2
    assert q.nbytes() == {"codes": n * bits // 8, "scales": 2 * n // g, "zeros": 2 * n // g}
    assert set(q.tensors()) == {"codes", "scales", "zeros"}
    # bits per element b + 32 / G
    assert sum(q.nbytes().values()) * 8 == pytest.approx(n * (bits + 32 / g))
    # documented shapes
    b, h, t, dd = shape
    packed_group = g * bits // 8  # bytes per group (3 bits: eight codes to three bytes)
    if axis == "token":
        assert tuple(q.codes.shape) == (b, h, t, dd // g, packed_group)
        assert tuple(q.scales.shape) == (b, h, t, dd // g)
    else:
        assert tuple(q.codes.shape) == (b, h, t // g, dd, packed_group)
        assert tuple(q.scales.shape) == (b, h, t // g, dd)


@SETTINGS
@given(bits=st.sampled_from((2, 4, 8)), lead=st.integers(1, 5), n=st.integers(1, 8), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip(bits, lead, n, seed):
    gen = torch.Generator().manual_seed(seed)
    per = 8 // bits
    codes = torch.randint(0, 1 << bits, (lead, 3, n * per), generator=gen).to(torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert tuple(packed.shape) == (lead, 3, n)
    assert torch.equal(packed, ref_pack(codes, bits))  # lowest bits first
    assert torch.equal(unpack(packed, bits), codes)
    assert torch.equal(ref_unpack(packed, bits), codes.long())


def test_pack_known_bytes():
    assert pack(torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8), 2).tolist() == [[1 | 2 << 2 | 3 << 4]]
    assert pack(torch.tensor([[0xA, 0x5]], dtype=torch.uint8), 4).tolist() == [[0x5A]]
    assert unpack(torch.tensor([[0xE4]], dtype=torch.uint8), 2).tolist() == [[0, 1, 2, 3]]


# --------------------------------------------------------------------------------------------------
# codes never change after quantization; cat
# --------------------------------------------------------------------------------------------------


@SETTINGS
@given(
    axis=st.sampled_from(["token", "channel"]),
    dtype=st.sampled_from(DTYPES),
    bits=st.sampled_from(BITS),
    g=st.sampled_from([4, 8, 16]),
    chunks=st.lists(st.integers(1, 13), min_size=2, max_size=8),
    seed=st.integers(0, 2**31 - 1),
)
def test_stream_codes_never_change(axis, dtype, bits, g, chunks, seed):
    assume(bits != 3 or g % 8 == 0)
    gen = torch.Generator().manual_seed(seed)
    stream = QuantizedStream(BACKEND, MinMax(bits, g, axis))
    snaps = []
    for i, n in enumerate(chunks):
        # later chunks have a different range, which would change earlier codes if requantized
        x = (torch.randn(2, 2, n, 16, generator=gen) * (i + 1) * 3 + i).to(dtype)
        stream.append(x)
        if stream.q is not None:
            snaps.append(
                (stream.q.codes.clone(), stream.q.scales.clone(), stream.q.zeros.clone(), BACKEND.dequantize(stream.q))
            )
    if stream.q is None:
        return
    final = stream.q
    final_deq = BACKEND.dequantize(final)
    for codes, scales, zeros, deq in snaps:
        k = codes.shape[2]
        assert torch.equal(final.codes[:, :, :k], codes)
        assert torch.equal(final.scales[:, :, :k], scales)
        assert torch.equal(final.zeros[:, :, :k], zeros)
        assert torch.equal(final_deq[:, :, : deq.shape[2]], deq)


@SETTINGS
@given(
    axis=st.sampled_from(["token", "channel"]),
    dtype=st.sampled_from(DTYPES),
    bits=st.sampled_from(BITS),
    g=st.sampled_from([4, 8, 16]),
    sizes=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    seed=st.integers(0, 2**31 - 1),
)
def test_cat_then_dequantize_equals_dequantize_then_cat(axis, dtype, bits, g, sizes, seed):
    assume(bits != 3 or g % 8 == 0)
    gen = torch.Generator().manual_seed(seed)
    blocks = []
    for i, k in enumerate(sizes):
        n = k * g if axis == "channel" else k + i
        blocks.append(BACKEND.quantize((torch.randn(2, 3, n, 16, generator=gen) * (i + 1)).to(dtype), bits, g, axis))
    cat = BACKEND.cat(blocks)
    assert cat.shape == (2, 3, sum(b.shape[2] for b in blocks), 16)
    assert cat.num_tokens == cat.shape[2]
    assert torch.equal(BACKEND.dequantize(cat), torch.cat([BACKEND.dequantize(b) for b in blocks], dim=2))


# --------------------------------------------------------------------------------------------------
# check()
# --------------------------------------------------------------------------------------------------


def test_check_rejects_unsupported_bits():
    with pytest.raises(ConfigError) as ei:
        BACKEND.check(bits=5, group_size=32, axis="token")
    msg = str(ei.value)
    assert "torch" in msg and "bits=5" in msg and "[2, 3, 4, 8]" in msg


def test_check_rejects_bad_axis():
    with pytest.raises(ConfigError) as ei:
        BACKEND.check(bits=2, group_size=32, axis="row", role="key")
    msg = str(ei.value)
    assert "torch" in msg and "key_axis='row'" in msg and "'token'" in msg and "'channel'" in msg


@pytest.mark.parametrize("group_size", [6, 30, 1, 2])
def test_check_rejects_group_size_not_multiple_of_4(group_size):
    with pytest.raises(ConfigError) as ei:
        BACKEND.check(bits=4, group_size=group_size, axis="channel")
    msg = str(ei.value)
    assert "torch" in msg and f"group_size={group_size}" in msg and "4" in msg


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("axis", ["token", "channel"])
def test_check_accepts_supported(bits, axis):
    BACKEND.check(bits=bits, group_size=32, axis=axis)
    BACKEND.check_tensor(torch.zeros(1, dtype=torch.bfloat16))


def test_check_tensor_rejects_dtype():
    with pytest.raises(ConfigError, match=r"does not accept dtype torch.int32; it supports \[.*torch.float64"):
        BACKEND.check_tensor(torch.zeros(1, dtype=torch.int32))
    BACKEND.check_tensor(torch.zeros(1, dtype=torch.float64))  # float64 models (reference runs) are accepted


# --------------------------------------------------------------------------------------------------
# metadata range: float32 data beyond float16's range (meta_dtype)
# --------------------------------------------------------------------------------------------------


def large(shape, magnitude: float, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Standard normal data times ``magnitude`` (groups with both signs), one channel offset by it."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * magnitude
    x[..., 1] += 2 * magnitude  # an all-positive channel: its minimum is large too
    return x.to(dtype)


def check_bound_meta(x: torch.Tensor, bits: int, g: int, axis: str, meta_dtype: str):
    q = BACKEND.quantize(x, bits, g, axis, meta_dtype=meta_dtype)
    xh = BACKEND.dequantize(q)
    assert torch.isfinite(q.scales).all() and torch.isfinite(q.zeros).all()
    assert torch.isfinite(xh).all()
    s = per_element(q.scales, g, axis).double()
    z = per_element(q.zeros, g, axis).double()
    err = (x.double() - xh.double()).abs()
    assert (err <= tolerance(x.double(), s, z, bits, x.dtype)).all(), float((err / s.clamp_min(1e-30)).max())
    return q


@pytest.mark.parametrize("magnitude", [1e5, 1e6])
@pytest.mark.parametrize("axis", ["channel", "token"])  # keys' default axis, values' default axis
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fit", ["minmax", "mse"])
def test_large_values_raise_with_default_float16_metadata(magnitude, axis, dtype, fit):
    x = large((1, 2, 16, 64), magnitude, seed=int(magnitude) % 97, dtype=dtype)
    with pytest.raises(MetadataOverflowError) as ei:
        BACKEND.quantize(x, 2, 16, axis, fit=fit)
    msg = str(ei.value)
    assert "backend 'torch'" in msg and str(dtype).removeprefix("torch.") in msg
    assert "float16 metadata" in msg and "65504" in msg
    assert f"{float(x.abs().max()):.4g}" in msg  # the offending magnitude
    assert "meta_dtype='float32'" in msg and "meta_dtype='bfloat16'" in msg  # the remedy
    assert isinstance(ei.value, NonFiniteError)


@pytest.mark.parametrize("magnitude", [1e5, 1e6])
@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("meta_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bits", BITS)
def test_large_values_within_half_step_with_wide_metadata(magnitude, axis, meta_dtype, bits):
    x = large((2, 2, 16, 64), magnitude, seed=bits)
    q = check_bound_meta(x, bits, 16, axis, meta_dtype)
    assert q.scales.dtype == q.zeros.dtype == getattr(torch, meta_dtype)
    # the bytes held are those of the stored dtype: 4 (float32) or 2 (bfloat16) per scale and minimum
    n_groups = x.numel() // 16
    size = 4 if meta_dtype == "float32" else 2
    assert q.nbytes() == {"codes": x.numel() * bits // 8, "scales": size * n_groups, "zeros": size * n_groups}


def test_float32_metadata_is_the_exact_minimum_and_quotient():
    """float32 metadata of float32 input: nothing to round, z = min and s = (max - min) / qmax in float32."""
    x = large((1, 2, 8, 32), 1e6, seed=5)
    for axis in ("token", "channel"):
        q = BACKEND.quantize(x, 4, 8, axis, meta_dtype="float32")
        grp = to_groups(x, 8, axis)
        lo, hi = grp.amin(-1), grp.amax(-1)
        assert torch.equal(q.zeros, lo)
        assert torch.equal(q.scales, (hi - lo) / 15)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_positive_groups_beyond_float16_keep_a_finite_grid(bits, axis):
    """A group above 65504 with a narrow enough range: the minimum rounds down to 65504 and the grid still
    covers the group (coarser than the data warrants, but within half of the stored step)."""
    x = (1e5 + torch.rand(1, 1, 16, 32, generator=torch.Generator().manual_seed(bits)) * 1e3).float()
    q = check_bound_meta(x, bits, 16, axis, "auto")
    assert q.scales.dtype == torch.float16 and (q.zeros.float() == 65504).all()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_float16_extremes_never_overflow_float16_metadata(bits, axis):
    """float16 input: min >= -65504 and (max - min) / qmax <= 131008 / 3 always fit, so no check runs."""
    from kvpolicy.backends.base import metadata_may_overflow

    assert not metadata_may_overflow(torch.float16, torch.float16)
    assert metadata_may_overflow(torch.float32, torch.float16) and metadata_may_overflow(torch.float64, torch.float32)
    x = torch.full((1, 1, 16, 32), 65504.0, dtype=torch.float16)
    x[..., ::2, ::3] = -65504.0
    check_bound_meta(x, bits, 16, axis, "auto")


def test_metadata_check_leaves_non_finite_input_to_the_caller():
    """NaN in the input makes its group's metadata NaN: that is check_finite's business (the action's
    check_finite=False keeps it), not an overflow, so the backend does not raise."""
    x = torch.randn(1, 1, 4, 16) * 1e5
    x[0, 0, 0, 0] = float("nan")
    q = BACKEND.quantize(x, 2, 16, "token")
    assert not torch.isfinite(q.scales).all()


@pytest.mark.parametrize("bad", ["float64", "fp16", "", None, 32])
def test_unknown_meta_dtype_rejected(bad):
    with pytest.raises(ConfigError, match=re.escape(f"meta_dtype={bad!r}")):
        BACKEND.quantize(torch.randn(1, 1, 4, 16), 2, 16, "token", meta_dtype=bad)
    with pytest.raises(ConfigError, match=re.escape(f"meta_dtype={bad!r}")):
        BACKEND.check_meta_dtype(bad)
    for ok in ("auto", "float16", "bfloat16", "float32"):
        BACKEND.check_meta_dtype(ok)


@settings(max_examples=50, deadline=None)
@given(
    bits=st.sampled_from(BITS),
    lead=st.lists(st.integers(1, 3), max_size=3),
    runs=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_round_trip_against_the_bit_stream(bits, lead, runs, seed):
    """pack/unpack invert each other and agree with an independent bit-level reference; 3-bit codes
    take exactly 3 bits each (eight per three bytes)."""
    n = 8 * runs
    codes = torch.randint(0, 1 << bits, (*lead, n), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (*lead, n * bits // 8)
    assert torch.equal(packed, ref_pack(codes, bits))
    assert torch.equal(unpack(packed, bits), codes)
    assert torch.equal(ref_unpack(packed, bits), codes.long())


def test_three_bit_groups_must_hold_runs_of_eight():
    with pytest.raises(ConfigError, match="multiple of 8 with bits=3; got value_group_size=12"):
        BACKEND.check(bits=3, group_size=12, axis="token", role="value")
    with pytest.raises(ConfigError, match="got group_size=12"):
        BACKEND.quantize(torch.randn(1, 1, 2, 24), 3, 12, "token")
    BACKEND.check(bits=3, group_size=16, axis="channel")


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize(("shape", "group_size", "axis", "what"), [
    ((1, 2, 256, 48), 64, "token", "head_dim to be a multiple of 64; got 48"),
    ((1, 2, 100, 64), 64, "channel", "the token count to be a multiple of 64; got 100"),
])  # fmt: skip
def test_min_max_groups_that_do_not_divide_their_dimension_are_refused_by_name(backend, shape, group_size, axis, what):
    from kvpolicy.backends.cpu_backend import CpuBackend

    instance = TorchBackend() if backend == "torch" else CpuBackend()
    with pytest.raises(ValueError, match=f"group_size={group_size} along axis='{axis}' need {what}"):
        instance.quantize(torch.randn(shape), 2, group_size, axis)
