"""Tests of the ``triton`` backend against the ``torch`` reference.

The kernels run compiled on a CUDA GPU when there is one, and under Triton's interpreter on the
CPU otherwise (``TRITON_INTERPRET=1`` is set only while the backend is constructed); the tests are
the same either way. Shapes are small: the interpreter runs about a thousand programs a second.

Containers are the ``torch`` backend's ``PackedTensor``; the layout re-derivation helpers below are
written from its docstring (codes ``8 // bits`` per byte, lowest bits first; token axis groups are
consecutive channels of one token, channel axis groups consecutive tokens of one channel).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpolicy.backends.base import Backend
from kvpolicy.backends.torch_backend import PackedTensor, TorchBackend
from kvpolicy.errors import ConfigError, MetadataOverflowError

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BITS = (2, 4, 8)
HEAD_DIMS = (64, 96, 128)
EPS32 = torch.finfo(torch.float32).eps
REF = TorchBackend()
# compiled, every new layout (dtype, bits, group size, head dim...) costs a JIT compile of about a second
SETTINGS = settings(max_examples=12 if GPU else 25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@contextlib.contextmanager
def interpreter_unless_gpu():
    """``TRITON_INTERPRET=1`` for the duration, when there is no GPU (restored afterwards)."""
    if GPU:
        yield
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def make_backend():
    from kvpolicy.backends.triton_backend import TritonBackend

    with interpreter_unless_gpu():
        return TritonBackend()


BACKEND = make_backend()


# --------------------------------------------------------------------------------------------------
# independent helpers
# --------------------------------------------------------------------------------------------------


def ref_unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    p = packed.to(torch.int64)
    parts = [(p >> (bits * j)) & ((1 << bits) - 1) for j in range(per)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * per)


def per_element(meta: torch.Tensor, g: int, axis: str) -> torch.Tensor:
    """A per-group tensor (scales / minimums) broadcast to every element of its group."""
    return meta.repeat_interleave(g, dim=3 if axis == "token" else 2)


def element_codes(q: PackedTensor) -> torch.Tensor:
    """The code of every element, shaped like the logical tensor."""
    c = ref_unpack(q.codes, q.bits)
    b, h, t, d = q.shape
    if q.axis == "token":
        return c.reshape(b, h, t, d)
    return c.permute(0, 1, 2, 4, 3).reshape(b, h, t, d)


def exact_dequant(q: PackedTensor) -> torch.Tensor:
    """``code * scale + min`` in float64, never rounded to the storage dtype."""
    s = per_element(q.scales, q.group_size, q.axis).double()
    z = per_element(q.zeros, q.group_size, q.axis).double()
    return element_codes(q).double() * s + z


@st.composite
def quant_configs(draw):
    axis = draw(st.sampled_from(["token", "channel"]))
    dtype = draw(st.sampled_from(DTYPES))
    bits = draw(st.sampled_from(BITS))
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    batch, heads = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    if axis == "token":
        g = draw(st.sampled_from([v for v in (4, 8, 12, 16, 32, 48, 64, 96, 128) if head_dim % v == 0]))
        tokens = draw(st.integers(1, 12))
    else:
        g = draw(st.sampled_from([4, 8, 12, 16, 32, 64]))
        tokens = g * draw(st.integers(1, 2))
    return axis, dtype, bits, (batch, heads, tokens, head_dim), g


@st.composite
def tensors(draw, shape, dtype):
    """Random values at several scales and offsets, with outliers, integer ties or constant runs."""
    seed = draw(st.integers(0, 2**31 - 1))
    kind = draw(st.sampled_from(["randn", "outliers", "ints", "some_constant"]))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0]))
    offset = draw(st.sampled_from([0.0, -7.5, 100.0]))
    gen = torch.Generator().manual_seed(seed)
    ints = kind == "ints"
    x = torch.randint(-4, 5, shape, generator=gen).float() if ints else torch.randn(shape, generator=gen)
    if kind == "outliers":
        x = torch.where(torch.rand(shape, generator=gen) < 0.02, x * 50, x)
    x = x * scale + offset
    if kind == "some_constant":
        x[:, :, ::3, :] = offset
        x[..., ::5] = 2.0
    return x.to(dtype).to(DEVICE)


def near_tie(x: torch.Tensor, q: PackedTensor) -> torch.Tensor:
    """Elements whose exact ``(x - min) / scale`` lies within float32 rounding of a half-integer:
    the only places where two correct float32 implementations may pick different codes."""
    s = per_element(q.scales, q.group_size, q.axis).double()
    z = per_element(q.zeros, q.group_size, q.axis).double()
    y = (x.double() - z) / torch.where(s > 0, s, torch.ones_like(s))
    return ((y - torch.floor(y)) - 0.5).abs() <= 8 * EPS32 * (1 + y.abs())


def compare_with_reference(x: torch.Tensor, bits: int, g: int, axis: str, meta_dtype: str = "auto") -> dict[str, int]:
    """Quantize with both backends; return mismatch counts (asserting the documented agreement)."""
    q = BACKEND.quantize(x, bits, g, axis, meta_dtype=meta_dtype)
    r = REF.quantize(x, bits, g, axis, meta_dtype=meta_dtype)
    assert isinstance(q, PackedTensor)
    assert (q.bits, q.group_size, q.axis, q.shape, q.dtype) == (r.bits, r.group_size, r.axis, r.shape, r.dtype)
    for name in ("codes", "scales", "zeros"):
        a, b = getattr(q, name), getattr(r, name)
        assert a.shape == b.shape and a.dtype == b.dtype and a.device == b.device, name
    # metadata: min rounded down, scale rounded up, exactly as the reference does it
    assert torch.equal(q.scales, r.scales)
    assert torch.equal(q.zeros, r.zeros)
    # codes: equal except at float32 near-ties, where they may differ by one
    cq, cr = element_codes(q), element_codes(r)
    diff = cq != cr
    assert ((cq - cr).abs() <= 1).all()
    assert not (diff & ~near_tie(x, r)).any(), "codes differ away from a rounding tie"
    # stores are interchangeable: each backend dequantizes the other's container identically
    xq = BACKEND.dequantize(q)
    assert xq.dtype == x.dtype and xq.shape == x.shape and xq.device == x.device
    assert torch.equal(xq, REF.dequantize(q))
    assert torch.equal(BACKEND.dequantize(r), REF.dequantize(r))
    # within one quantization step of the reference (plus the output dtype's rounding)
    s = per_element(r.scales, g, axis).double()
    err = (xq.double() - REF.dequantize(r).double()).abs()
    assert (err <= s * (1 + 1e-6) + torch.finfo(x.dtype).eps * x.double().abs().add(s)).all()
    return {"codes": int(diff.sum()), "elements": x.numel()}


# --------------------------------------------------------------------------------------------------
# quantize / dequantize agree with the torch reference
# --------------------------------------------------------------------------------------------------


@SETTINGS
@given(st.data())
def test_quantize_dequantize_match_torch(d):
    axis, dtype, bits, shape, g = d.draw(quant_configs())
    x = d.draw(tensors(shape, dtype))
    compare_with_reference(x, bits, g, axis)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", ["token", "channel"])
def test_constant_groups_and_special_values(dtype, axis):
    """max == min: scale 0, the value comes back exactly (no NaN from 0 / 0)."""
    for value in (0.0, -0.0, 1.0, -3.125, 1000.0, 2.0**-14):
        x = torch.full((1, 2, 8, 64), value, dtype=dtype, device=DEVICE)
        for bits in BITS:
            q = BACKEND.quantize(x, bits, 8, axis)
            assert torch.equal(q.scales.float(), torch.zeros_like(q.scales.float()))
            xh = BACKEND.dequantize(q)
            assert not torch.isnan(xh).any()
            assert torch.equal(xh, x), (value, bits)
            compare_with_reference(x, bits, 8, axis)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_full_range_codes_exact(dtype, bits):
    """A group 0, 1, ..., qmax shifted by -3: scale 1, minimum -3, the codes are the values."""
    qmax = (1 << bits) - 1
    vals = torch.arange(256, dtype=torch.float32) % (qmax + 1)
    x = (vals.reshape(1, 1, 1, 256) - 3).to(dtype).to(DEVICE)
    q = BACKEND.quantize(x, bits, 256, "token")
    assert float(q.scales.float()) == 1.0 and float(q.zeros.float()) == -3.0
    assert torch.equal(ref_unpack(q.codes, bits).reshape(-1).cpu(), vals.long())
    assert torch.equal(BACKEND.dequantize(q), x)


def test_float64_inputs_follow_the_reference():
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(1, 2, 16, 64, generator=gen, dtype=torch.float64) * 5).to(DEVICE)
    for axis in ("token", "channel"):
        compare_with_reference(x, 4, 16, axis)


def large(shape, magnitude: float, seed: int) -> torch.Tensor:
    """float32 standard normal data times ``magnitude``, one channel all positive (a large minimum)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * magnitude
    x[..., 1] += 2 * magnitude
    return x.to(DEVICE)


@pytest.mark.parametrize("magnitude", [1e5, 1e6])
@pytest.mark.parametrize("axis", ["channel", "token"])  # keys' default axis, values' default axis
@pytest.mark.parametrize("fit", ["minmax", "mse"])  # the kernel, and the fit run as torch operations
def test_large_float32_values_raise_with_float16_metadata(magnitude, axis, fit):
    x = large((1, 2, 16, 64), magnitude, seed=1)
    with pytest.raises(MetadataOverflowError) as ei:
        BACKEND.quantize(x, 2, 16, axis, fit=fit)
    msg = str(ei.value)
    assert "backend 'triton'" in msg and "float16 metadata" in msg and "meta_dtype='float32'" in msg
    assert f"{float(x.abs().max()):.4g}" in msg


@pytest.mark.parametrize("magnitude", [1e5, 1e6])
@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("meta_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bits", BITS)
def test_large_float32_values_with_wide_metadata_match_torch(magnitude, axis, meta_dtype, bits):
    """float32 / bfloat16 metadata: the same codes and metadata as the reference, within half a step."""
    x = large((1, 2, 16, 64), magnitude, seed=bits)
    compare_with_reference(x, bits, 16, axis, meta_dtype=meta_dtype)
    q = BACKEND.quantize(x, bits, 16, axis, meta_dtype=meta_dtype)
    assert q.scales.dtype == q.zeros.dtype == getattr(torch, meta_dtype)
    xh = BACKEND.dequantize(q)
    assert torch.isfinite(xh).all()
    s = per_element(q.scales, 16, axis).double()
    assert ((xh.double() - x.double()).abs() <= s * (0.5 + 1e-5) + 4 * EPS32 * x.double().abs()).all()


@pytest.mark.parametrize("bits", BITS)
def test_float16_grid_top_past_65504_is_clamped(bits):
    """float16 groups spanning -65504..65504: the scale rounded up puts the top grid point past 65504;
    dequantize clamps it like the reference instead of writing inf."""
    x = torch.full((1, 1, 16, 32), 65504.0, dtype=torch.float16)
    x[..., ::2, ::3] = -65504.0
    x = x.to(DEVICE)
    for axis in ("token", "channel"):
        q = BACKEND.quantize(x, bits, 16, axis)
        assert float(q.zeros.float().min()) + ((1 << bits) - 1) * float(q.scales.float().max()) > 65504
        assert torch.equal(BACKEND.dequantize(q), x)
        compare_with_reference(x, bits, 16, axis)


@pytest.mark.parametrize("meta_dtype", ["float32", "bfloat16"])
def test_attend_reads_wide_metadata(meta_dtype):
    """Keys per channel around 1e5 and values per token around 1e6, float32 / bfloat16 metadata: attention
    over the stored codes (queries scaled so the scores stay moderate)."""
    gen = torch.Generator().manual_seed(11)
    keys = large((1, 2, 32, 64), 1e5, seed=2)
    values = large((1, 2, 32, 64), 1e6, seed=3)
    for key_axis, value_axis in (("channel", "token"), ("token", "channel")):
        k = BACKEND.quantize(keys, 4, 16, key_axis, meta_dtype=meta_dtype)
        v = BACKEND.quantize(values, 4, 16, value_axis, meta_dtype=meta_dtype)
        query = (torch.randn(1, 2, 3, 64, generator=gen) * 1e-5).to(DEVICE)
        out, lse = BACKEND.attend(query, k, v, 0.125)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        assert_attention_close(out, lse, k, v, query, 0.125)


def test_codes_agreement_measured():
    """A larger sample: the measured code mismatches against torch (documented in docs/explanation/backends.md)."""
    gen = torch.Generator().manual_seed(0)
    total = {"codes": 0, "elements": 0}
    for dtype in DTYPES:
        for bits in BITS:
            x = (torch.randn(2, 2, 64, 128, generator=gen) * 4 + 1).to(dtype).to(DEVICE)
            for axis in ("token", "channel"):
                got = compare_with_reference(x, bits, 32, axis)
                total = {k: total[k] + got[k] for k in total}
    assert total["elements"] == 9 * 2 * 2 * 2 * 64 * 128
    assert total["codes"] <= total["elements"] * 1e-4, total


# --------------------------------------------------------------------------------------------------
# attend
# --------------------------------------------------------------------------------------------------


def exact_attention(query: torch.Tensor, k: PackedTensor, v: PackedTensor, scale: float):
    """float64 attention over ``code * scale + min`` (no rounding to the storage dtype)."""
    kk, vv = exact_dequant(k), exact_dequant(v)
    scores = torch.matmul(query.double(), kk.transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), vv), lse, scores, vv


@st.composite
def attend_configs(draw):
    dtype = draw(st.sampled_from(DTYPES))
    bits = (draw(st.sampled_from(BITS)), draw(st.sampled_from(BITS)))  # key and value widths, mixed pairs too
    key_axis = draw(st.sampled_from(["channel", "channel", "token"]))  # the default layout, more often
    value_axis = draw(st.sampled_from(["token", "token", "channel"]))
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    g = draw(st.sampled_from([v for v in (4, 8, 16, 32, 64) if head_dim % v == 0] + [12]))
    if "token" in (key_axis, value_axis) and head_dim % g:
        g = 16
    n = g * draw(st.integers(1, 4)) if "channel" in (key_axis, value_axis) else draw(st.integers(1, 40))
    nq = draw(st.integers(1, 6))
    batch, heads = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    return dtype, bits, key_axis, value_axis, (batch, heads, n, head_dim), g, nq


def make_segment(shape, dtype, bits, g, key_axis, value_axis, seed):
    """Quantized keys and values; ``bits`` is one width for both or a ``(key_bits, value_bits)`` pair."""
    key_bits, value_bits = bits if isinstance(bits, tuple) else (bits, bits)
    gen = torch.Generator().manual_seed(seed)
    d = shape[3]
    keys = (torch.randn(shape, generator=gen) * 2 + torch.randn(1, 1, 1, d, generator=gen)).to(dtype).to(DEVICE)
    values = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    return BACKEND.quantize(keys, key_bits, g, key_axis), BACKEND.quantize(values, value_bits, g, value_axis)


def assert_attention_close(out, lse, k, v, query, scale, slack: float = 1.0):
    ref_out, ref_lse, scores, vv = exact_attention(query, k, v, scale)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    # float32 accumulation of D products of size |q_c K_c| (and of n probabilities times |V|)
    s_tol = slack * 1e-5 * (1 + scores.abs().amax(dim=-1))
    assert ((lse.double() - ref_lse).abs() <= s_tol).all(), float((lse.double() - ref_lse).abs().max())
    o_tol = slack * (1e-5 + 2 * s_tol.unsqueeze(-1)) * vv.abs().amax(dim=(-1, -2), keepdim=True).clamp_min(1e-30)
    assert ((out.double() - ref_out).abs() <= o_tol).all(), float((out.double() - ref_out).abs().max())


@SETTINGS
@given(cfg=attend_configs(), seed=st.integers(0, 2**31 - 1))
def test_attend_matches_reference(cfg, seed):
    dtype, bits, key_axis, value_axis, shape, g, nq = cfg
    k, v = make_segment(shape, dtype, bits, g, key_axis, value_axis, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    query = (torch.randn(shape[0], shape[1], nq, shape[3], generator=gen) * 2).to(dtype).to(DEVICE)
    scale = shape[3] ** -0.5
    out, lse = BACKEND.attend(query, k, v, scale)
    # against exact attention over the stored codes
    assert_attention_close(out, lse, k, v, query, scale)
    # against the reference Backend.attend, which rounds the dequantized keys and values to the
    # storage dtype first: scores move by at most scale * sum_c |q_c K_c| * u, outputs by u * |V|
    # plus the effect of those score changes on the probabilities
    ref_out, ref_lse = Backend.attend(REF, query, k, v, scale)
    u = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps / 2
    kk, vv = exact_dequant(k), exact_dequant(v)
    ds = scale * torch.matmul(query.double().abs(), kk.abs().transpose(-1, -2)).amax(dim=-1) * u
    ds = ds + 1e-5 * (1 + ref_lse.double().abs())
    assert ((lse.double() - ref_lse.double()).abs() <= ds).all()
    vmax = vv.abs().amax(dim=(-1, -2), keepdim=True)
    o_tol = vmax * (u + 1e-5 + 2.5 * ds.unsqueeze(-1))
    assert ((out.double() - ref_out.double()).abs() <= o_tol).all()


@SETTINGS
@given(cfg=attend_configs(), seed=st.integers(0, 2**31 - 1), cut=st.integers(1, 3))
def test_attend_segments_merge(cfg, seed, cut):
    """Two disjoint segments' (out, lse), merged by the documented rule, equal attention over both."""
    dtype, bits, key_axis, value_axis, shape, g, nq = cfg
    b, h, n, d = shape
    step = g if "channel" in (key_axis, value_axis) else 1
    if n // step < 2:
        n = 2 * step
    first = step * min(cut, n // step - 1)
    k1, v1 = make_segment((b, h, first, d), dtype, bits, g, key_axis, value_axis, seed)
    k2, v2 = make_segment((b, h, n - first, d), dtype, bits, g, key_axis, value_axis, seed + 7)
    k, v = BACKEND.cat([k1, k2]), BACKEND.cat([v1, v2])
    assert k.shape == (b, h, n, d)
    query = torch.randn(b, h, nq, d, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)
    scale = d**-0.5
    o1, l1 = BACKEND.attend(query, k1, v1, scale)
    o2, l2 = BACKEND.attend(query, k2, v2, scale)
    lse = torch.logaddexp(l1, l2)
    out = o1 * torch.exp(l1 - lse).unsqueeze(-1) + o2 * torch.exp(l2 - lse).unsqueeze(-1)
    o, l_all = BACKEND.attend(query, k, v, scale)
    assert torch.allclose(l_all, lse, rtol=1e-5, atol=1e-5)
    assert torch.allclose(o, out, rtol=1e-4, atol=1e-5)
    assert_attention_close(out, lse, k, v, query, scale, slack=2.0)


@pytest.mark.parametrize(("key_axis", "value_axis"), [("channel", "token"), ("token", "channel")])
def test_attend_token_splits_merge_inside(key_axis, value_axis):
    """Splitting the tokens over several programs (flash-decoding) gives the one-program result."""
    k, v = make_segment((2, 2, 80, 64), torch.float16, 4, 16, key_axis, value_axis, 11)
    query = torch.randn(2, 2, 5, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    backend = make_backend()
    results = {}
    for splits in (1, 2, 3, 100):
        backend.splits = splits
        results[splits] = backend.attend(query, k, v, 0.125)
    for splits in (2, 3, 100):
        assert torch.allclose(results[splits][1], results[1][1], rtol=1e-5, atol=1e-5), splits
        assert torch.allclose(results[splits][0], results[1][0], rtol=1e-4, atol=1e-5), splits
    assert_attention_close(*results[3], k, v, query, 0.125)


@pytest.mark.parametrize(("key_axis", "value_axis"), [("channel", "token"), ("token", "channel")])
def test_attend_reads_token_slices_in_place(key_axis, value_axis):
    """A token slice of a larger container (strided batch / head, as the fused decode path passes
    them) gives the same result as a compact copy of the same tokens."""
    k, v = make_segment((2, 3, 64, 64), torch.bfloat16, 2, 16, key_axis, value_axis, 4)

    def tokens(p: PackedTensor, start: int, length: int, copy: bool) -> PackedTensor:
        per = p.group_size if p.axis == "channel" else 1
        sl = slice(start // per, (start + length) // per)
        parts = [t[:, :, sl] for t in (p.codes, p.scales, p.zeros)]
        if copy:
            parts = [t.contiguous() for t in parts]
        return PackedTensor(*parts, p.bits, p.group_size, p.axis, (*p.shape[:2], length, p.shape[3]), p.dtype)

    query = torch.randn(2, 3, 4, 64, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    k_view, v_view = tokens(k, 16, 32, False), tokens(v, 16, 32, False)
    assert not k_view.codes.is_contiguous() and not v_view.codes.is_contiguous()
    got = BACKEND.attend(query, k_view, v_view, 0.125)
    want = BACKEND.attend(query, tokens(k, 16, 32, True), tokens(v, 16, 32, True), 0.125)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert_attention_close(*got, k_view, v_view, query, 0.125)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attend_constant_groups(dtype):
    """Groups with max == min (scale 0) in keys and values: scores and outputs stay finite and exact."""
    keys = torch.full((1, 2, 32, 64), 0.5, dtype=dtype, device=DEVICE)
    keys[:, :, 16:] = -2.0  # second key group constant too, at another value
    values = torch.arange(32, dtype=torch.float32, device=DEVICE).repeat_interleave(64).reshape(1, 1, 32, 64)
    values = values.expand(1, 2, 32, 64).to(dtype)  # each token constant across its channels
    k = BACKEND.quantize(keys, 2, 16, "channel")
    v = BACKEND.quantize(values, 2, 16, "token")
    assert torch.equal(k.scales.float(), torch.zeros_like(k.scales.float()))
    assert torch.equal(v.scales.float(), torch.zeros_like(v.scales.float()))
    query = torch.randn(1, 2, 3, 64, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    out, lse = BACKEND.attend(query, k, v, 0.125)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_attention_close(out, lse, k, v, query, 0.125)


def test_attend_empty_segment_and_shape_checks():
    k, v = make_segment((1, 2, 16, 64), torch.float16, 2, 16, "channel", "token", 0)
    q = torch.randn(1, 2, 3, 64, device=DEVICE)
    empty_k = PackedTensor(k.codes[:, :, :0], k.scales[:, :, :0], k.zeros[:, :, :0], 2, 16, "channel",
                           (1, 2, 0, 64), torch.float16)  # fmt: skip
    empty_v = PackedTensor(v.codes[:, :, :0], v.scales[:, :, :0], v.zeros[:, :, :0], 2, 16, "token",
                           (1, 2, 0, 64), torch.float16)  # fmt: skip
    out, lse = BACKEND.attend(q, empty_k, empty_v, 0.125)
    assert torch.equal(out, torch.zeros(1, 2, 3, 64, device=DEVICE))
    assert torch.isneginf(lse).all()
    with pytest.raises(ConfigError, match="do not match query"):
        BACKEND.attend(torch.randn(1, 2, 3, 32, device=DEVICE), k, v, 0.125)
    with pytest.raises(ConfigError, match="do not hold the tokens"):
        BACKEND.attend(q, k, empty_v, 0.125)
    with pytest.raises(ConfigError, match="PackedTensor"):
        BACKEND.attend(q, k, "not a container", 0.125)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# memory, capabilities, refusal
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("bits", BITS)
def test_memory_bytes_equal_held_tensors(axis, bits):
    x = torch.randn(2, 2, 32, 96, dtype=torch.float16, device=DEVICE)
    q = BACKEND.quantize(x, bits, 16, axis)
    held = {"codes": q.codes, "scales": q.scales, "zeros": q.zeros}
    assert q.tensors().keys() == held.keys()
    assert q.nbytes() == {k: t.numel() * t.element_size() for k, t in held.items()}
    n = x.numel()
    assert q.nbytes() == {"codes": n * bits // 8, "scales": 2 * n // 16, "zeros": 2 * n // 16}
    assert q.nbytes() == REF.quantize(x, bits, 16, axis).nbytes()


def test_capabilities_and_checks():
    caps = BACKEND.capabilities
    assert caps.bits == (2, 3, 4, 8) and set(caps.axes) == {"token", "channel"} and caps.group_size_multiple == 4
    assert caps.formats == ("minmax", "codebook") and caps.fused
    assert caps.devices == (("cuda",) if GPU else ("cpu",))
    assert BACKEND.mode == ("compiled" if GPU else "interpret")
    assert set(type(BACKEND).capabilities.devices) == {"cuda", "cpu"}
    with pytest.raises(ConfigError, match="bits=5"):
        BACKEND.quantize(torch.randn(1, 1, 4, 64, device=DEVICE), 5, 16, "token")
    with pytest.raises(ConfigError, match="group_size must be a multiple of 8 with bits=3; got group_size=12"):
        BACKEND.quantize(torch.randn(1, 1, 4, 48, device=DEVICE), 3, 12, "token")
    with pytest.raises(ConfigError, match="multiple of group_size=16; got tokens=12"):
        BACKEND.quantize(torch.randn(1, 1, 12, 64, device=DEVICE), 2, 16, "channel")
    wrong = torch.randn(1, 1, 16, 64, device="meta" if not GPU else "cpu")
    with pytest.raises(ConfigError, match="does not run on device"):
        BACKEND.quantize(wrong, 2, 16, "token")
    with pytest.raises(ConfigError, match=r"does not accept dtype torch\.int32"):
        BACKEND.quantize(torch.zeros(1, 1, 16, 64, dtype=torch.int32, device=DEVICE), 2, 16, "token")


def test_refuses_without_gpu_and_interpreter(monkeypatch):
    from kvpolicy import CompressedCache
    from kvpolicy.backends.triton_backend import TritonBackend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match=r"no GPU is available.*TRITON_INTERPRET=1.*backend='torch'"):
        TritonBackend()
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        CompressedCache(policy="log", action="quantize", bits=2, backend="triton")


def test_missing_triton_names_the_extra(monkeypatch):
    from kvpolicy.backends.triton_backend import TritonBackend

    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    with pytest.raises(ConfigError, match=r'pip install "kvpolicy\[triton\]"') as info:
        TritonBackend()
    assert isinstance(info.value, ImportError)  # MissingDependencyError, like the other optional backends


def test_kernels_switch_mode_after_import():
    """Kernels decorated in one mode are re-wrapped for the other (TRITON_INTERPRET set late), with the
    helpers of their module in the same mode (helpers calling helpers included)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from kvpolicy.kernels import triton_attention, triton_quant
    from kvpolicy.kernels.triton_runtime import for_mode

    for k in (triton_quant.quantize_pack_kernel, triton_attention.decode_attention_kernel):
        interp, compiled = for_mode(k, True), for_mode(k, False)
        assert isinstance(interp, InterpretedFunction) and isinstance(compiled, JITFunction)
        assert interp.fn.__code__ is compiled.fn.__code__ is k.fn.__code__
        assert for_mode(k, True) is interp  # cached
        for wrapped, kind in ((interp, InterpretedFunction), (compiled, JITFunction)):
            helpers = [v for v in wrapped.fn.__globals__.values() if isinstance(v, (InterpretedFunction, JITFunction))]
            own = [v for v in helpers if v.fn.__module__ == k.fn.__module__]
            assert own and all(isinstance(v, kind) for v in own)
    names = [p.name for p in for_mode(triton_attention.decode_attention_kernel, False).params if p.do_not_specialize]
    assert "n_tokens" in names and "tiles_per_split" in names


_AOT_SCRIPT = r"""
import inspect, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvpolicy.kernels import triton_attention, triton_quant

def signature(kernel, pointers, constexprs, floats=()):
    names = inspect.signature(kernel.fn).parameters
    return {n: pointers.get(n, "constexpr" if n in constexprs else "fp32" if n in floats else "i32") for n in names}

variants = {
    "quantize": (triton_quant.quantize_pack_kernel,
        {"x_ptr": "*i16", "codes_ptr": "*u8", "scales_ptr": "*i16", "zeros_ptr": "*i16"},
        dict(R_DIV=96, R_OUTER=12 * 96, E_STRIDE=96, G=12, GP=16, BITS=2, PER=4, NB=3, NBP=4, BLOCK_N=64,
             IN_BF16=True, META_BF16=True, META_F32=False), {"enable_fp_fusion": False}),
    "quantize_f32_meta": (triton_quant.quantize_pack_kernel,
        {"x_ptr": "*fp32", "codes_ptr": "*u8", "scales_ptr": "*fp32", "zeros_ptr": "*fp32"},
        dict(R_DIV=1, R_OUTER=64, E_STRIDE=1, G=64, GP=64, BITS=4, PER=2, NB=32, NBP=32, BLOCK_N=32,
             IN_BF16=False, META_BF16=False, META_F32=True), {"enable_fp_fusion": False}),
    "dequantize": (triton_quant.unpack_dequantize_kernel,
        {"codes_ptr": "*u8", "scales_ptr": "*fp16", "zeros_ptr": "*fp16", "out_ptr": "*fp16"},
        dict(R_DIV=1, R_OUTER=64, E_STRIDE=1, G=64, GP=64, BITS=4, PER=2, NB=32, BLOCK_N=32, OUT_BF16=False,
             OUT_F16=True, META_BF16=False), {"enable_fp_fusion": False}),
    "merge": (triton_attention.merge_splits_kernel,
        {"out_ptr": "*fp32", "lse_ptr": "*fp32", "merged_ptr": "*fp32", "merged_lse_ptr": "*fp32"},
        dict(DV=128, DVP=128, SP=8, QB=4), {"enable_fp_fusion": True}),
}
# the attention kernel in the pairings of the shipped presets: (name, key role, value role, bias, precision)
MINMAX_TOKEN, MINMAX_CHANNEL, CODEBOOK = 0, 1, 2
roles = {
    "kivi2": dict(KIND=MINMAX_CHANNEL, BITS=2, G=32, BF16=True, BYTE=False, CENTRE=False),
    "one_liner_keys": dict(KIND=MINMAX_CHANNEL, BITS=2, G=128, BF16=True, BYTE=False, CENTRE=False),
    "minmax3_channel": dict(KIND=MINMAX_CHANNEL, BITS=3, G=64, BF16=False, BYTE=False, CENTRE=False),
    "minmax4_channel": dict(KIND=MINMAX_CHANNEL, BITS=4, G=64, BF16=True, BYTE=False, CENTRE=False),
    "minmax2_token": dict(KIND=MINMAX_TOKEN, BITS=2, G=64, BF16=True, BYTE=False, CENTRE=False),
    "minmax4_token": dict(KIND=MINMAX_TOKEN, BITS=4, G=64, BF16=False, BYTE=False, CENTRE=False),
    "codebook3_byte_centre": dict(KIND=CODEBOOK, BITS=3, G=1, BF16=True, BYTE=True, CENTRE=True),
    "codebook4_byte_centre": dict(KIND=CODEBOOK, BITS=4, G=1, BF16=True, BYTE=True, CENTRE=True),
    "codebook2_byte": dict(KIND=CODEBOOK, BITS=2, G=1, BF16=True, BYTE=True, CENTRE=False),
    "codebook3_byte": dict(KIND=CODEBOOK, BITS=3, G=1, BF16=False, BYTE=True, CENTRE=False),
    "codebook2_norm16_centre": dict(KIND=CODEBOOK, BITS=2, G=1, BF16=True, BYTE=False, CENTRE=True),
    "codebook2_norm16": dict(KIND=CODEBOOK, BITS=2, G=1, BF16=False, BYTE=False, CENTRE=False),
}
pairs = [
    ("kivi2", "minmax2_token", False, "tf32"), ("one_liner_keys", "minmax2_token", False, "tf32"),
    ("minmax4_token", "minmax4_token", False, "ieee"),
    ("minmax3_channel", "minmax2_token", False, "tf32"), ("minmax4_channel", "codebook3_byte", False, "tf32"),
    ("codebook3_byte_centre", "codebook2_byte", False, "tf32"),
    ("codebook4_byte_centre", "codebook3_byte", True, "tf32"),
    ("codebook2_norm16_centre", "codebook2_norm16", False, "ieee"),
]
pointer_names = ["q_ptr", "out_ptr", "lse_ptr", "bias_ptr", "steps_ptr"]
for key_role, value_role, bias, precision in pairs:
    k, v = roles[key_role], roles[value_role]
    ptrs = {n: "*fp32" for n in pointer_names}
    for p, role in (("k", k), ("v", v)):
        meta = "*i16" if role["BF16"] else "*fp16"
        ptrs.update({f"{p}c_ptr": "*u8", f"{p}s_ptr": "*u8" if role["BYTE"] else meta, f"{p}z_ptr": meta,
                     f"{p}base_ptr": "*i16", f"{p}mu_ptr": meta, f"{p}tab_ptr": "*fp32"})
    tile = k["G"] if k["KIND"] == MINMAX_CHANNEL else 32
    ce = dict(D=128, DP=128, DV=128, DVP=128, BIAS=bias, TILE=tile, BT=max(16, tile), QB=16, PRECISION=precision,
              **{f"K_{n}": val for n, val in k.items()}, **{f"V_{n}": val for n, val in v.items()})
    variants[f"attend_{key_role}_{value_role}"] = (triton_attention.decode_attention_kernel, ptrs, ce,
                                                  {"enable_fp_fusion": True})
for name, (kernel, ptrs, ce, options) in variants.items():
    src = ASTSource(fn=kernel, signature=signature(kernel, ptrs, ce, ("sm_scale",)), constexprs=ce)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **options})
    fma = "fma.rn.f32" in compiled.asm["ptx"]
    print(name, "cubin", len(compiled.asm["cubin"]), "fma", fma)
"""


def test_kernels_compile_for_a_cuda_target(tmp_path):
    """The compiled path, checked without a GPU: every kernel compiles ahead of time for sm_90 down
    to a cubin, the attention kernel in each pairing of formats the shipped presets use (catches what the
    interpreter accepts but the compiler does not). Runs in a fresh process without TRITON_INTERPRET, since
    this one may hold Triton's library in interpreter mode."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.strip().splitlines())
    assert {"quantize", "quantize_f32_meta", "dequantize", "merge"} < set(lines)
    assert sum(name.startswith("attend_") for name in lines) == 8
    for name, rest in lines.items():
        words = rest.split()
        assert int(words[1]) > 0, name  # a non-empty cubin
    # launched with enable_fp_fusion=False (as the backend does), code * scale + min is rounded twice, like torch
    assert lines["dequantize"].endswith("fma False")


# --------------------------------------------------------------------------------------------------
# end to end
# --------------------------------------------------------------------------------------------------


def test_generate_with_triton_backend_matches_torch_backend(monkeypatch):
    """LogQuant 2-bit in a tiny model: the stored codes equal the torch backend's bit for bit, so
    decoding is the same."""
    from conftest import tiny_model

    from kvpolicy import CompressedCache

    if not GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = tiny_model("llama", layers=1).to(DEVICE)
    ids = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    kw = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    runs = {}
    for name in ("torch", "triton"):
        cache = CompressedCache(policy="log", window=4, action="quantize", bits=2, group_size=8, backend=name)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **kw)
        runs[name] = (gen, cache)
    (g_ref, c_ref), (g_tri, c_tri) = runs["torch"], runs["triton"]
    assert repr(c_tri.backend) == "'triton'"
    store_ref, store_tri = c_ref.layers[0].engine.held.store, c_tri.layers[0].engine.held.store
    assert store_tri.k.q is not None and store_tri.v.q is not None  # something was quantized
    for a, b in ((store_ref.k.q, store_tri.k.q), (store_ref.v.q, store_tri.v.q)):
        for name in ("codes", "scales", "zeros"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert c_ref.memory_report().segments == c_tri.memory_report().segments
    assert torch.equal(g_ref.sequences, g_tri.sequences)
    for a, b in zip(g_ref.logits, g_tri.logits, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)
    assert math.isfinite(float(torch.stack(g_tri.logits).abs().max()))


def test_fused_decode_path_uses_the_kernel(monkeypatch):
    """With kvpolicy's fused decode attention on, decoding reads the quantized history through
    ``TritonBackend.attend`` and matches the materialised torch-backend run to float32 rounding."""
    from conftest import tiny_model

    from kvpolicy import CompressedCache
    from kvpolicy.fused import enable_fused

    model = tiny_model("llama", layers=1).to(DEVICE)
    ids = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    kw = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    make = dict(policy="log", window=4, action="quantize", bits=2, group_size=8)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), cache=CompressedCache(**make), **kw)
    backend = make_backend()
    calls = []
    kernel_attend = backend.attend
    monkeypatch.setattr(backend, "attend", lambda *a: calls.append(a[1].shape) or kernel_attend(*a))
    enable_fused(model)
    got = model.generate(ids, attention_mask=torch.ones_like(ids), cache=CompressedCache(**make, backend=backend), **kw)
    assert len(calls) >= 3 and all(shape[2] > 0 for shape in calls)  # decode steps read quantized tokens
    assert torch.equal(ref.sequences, got.sequences)
    assert torch.allclose(torch.stack(ref.logits), torch.stack(got.logits), rtol=1e-5, atol=1e-5)


def test_fused_decode_with_rotation_reads_rotated_codes_in_the_kernel(monkeypatch):
    """With ``transform="hadamard"`` the kernel receives the rotated query and the rotated codes; the
    un-rotated output matches the materialised torch-backend run with the same rotation."""
    from conftest import tiny_model

    from kvpolicy import CompressedCache
    from kvpolicy.fused import enable_fused
    from kvpolicy.transforms import Hadamard

    model = tiny_model("llama", layers=1).to(DEVICE)
    ids = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    kw = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    make = dict(policy="log", window=4, action="quantize", key_bits=4, value_bits=2, group_size=8, transform="hadamard")
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), cache=CompressedCache(**make, backend="torch"), **kw)
    backend = make_backend()
    queries = []
    kernel_attend = backend.attend
    monkeypatch.setattr(backend, "attend", lambda *a: queries.append(a[0]) or kernel_attend(*a))
    enable_fused(model)
    cache = CompressedCache(**make, backend=backend)
    got = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **kw)
    assert len(queries) >= 3
    assert set(cache.attention_paths().values()) == {"fused (triton)"}
    layer = cache.layers[0]
    store = layer.engine.held.store
    assert layer.engine.held.basis.transform == Hadamard() and store.k.q is not None  # rotated codes, read fused
    assert torch.equal(ref.sequences, got.sequences)
    assert torch.allclose(torch.stack(ref.logits), torch.stack(got.logits), rtol=1e-5, atol=1e-5)


def test_fitted_ranges_store_the_torch_backends_blocks_and_attend_in_the_kernel(monkeypatch):
    """``key_fit="mse"``: the triton backend stores the torch backend's fitted blocks bit for bit (the
    fit runs as torch operations), which differ from min-max ones, and the fused decode reads them
    through the kernel, matching the materialised torch run."""
    from conftest import tiny_model

    from kvpolicy import CompressedCache
    from kvpolicy.fused import enable_fused

    model = tiny_model("llama", layers=1).to(DEVICE)
    ids = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    kw = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    make = dict(policy="log", window=4, action="quantize", bits=2, group_size=8)
    ref_cache = CompressedCache(**make, key_fit="mse", backend="torch")
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), cache=ref_cache, **kw)
    plain = CompressedCache(**make, key_fit="minmax", backend="torch")
    model.generate(ids, attention_mask=torch.ones_like(ids), cache=plain, **kw)
    backend = make_backend()
    calls = []
    kernel_attend = backend.attend
    monkeypatch.setattr(backend, "attend", lambda *a: calls.append(a[1].shape) or kernel_attend(*a))
    enable_fused(model)
    cache = CompressedCache(**make, key_fit="mse", backend=backend)
    got = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **kw)
    assert len(calls) >= 3 and set(cache.attention_paths().values()) == {"fused (triton)"}
    fitted, minmax, tri = (c.layers[0].engine.held.store.k.q for c in (ref_cache, plain, cache))
    assert not torch.equal(fitted.scales, minmax.scales)  # the fit moved the keys' ranges
    for name in ("codes", "scales", "zeros"):
        assert torch.equal(getattr(fitted, name), getattr(tri, name)), name
    assert torch.equal(ref.sequences, got.sequences)
    assert torch.allclose(torch.stack(ref.logits), torch.stack(got.logits), rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match=r"fit must be one of \['minmax', 'mse'\]; got fit='lloyd'"):
        backend.quantize(torch.zeros(1, 1, 8, 8), 2, 8, "channel", fit="lloyd")
