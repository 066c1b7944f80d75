"""The ``cpu`` backend: its C++ ``attend`` against exact float64 attention over the stored codes, the
log-sum-exp merge of segments, end-to-end logits against the ``torch`` backend, and its refusals."""

from __future__ import annotations

import pytest
import torch
from conftest import teacher_forced_logits, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpolicy import CompressedCache
from kvpolicy.backends.base import Backend
from kvpolicy.backends.torch_backend import PackedTensor, TorchBackend, unpack
from kvpolicy.errors import ConfigError
from kvpolicy.fused import disable_fused, enable_fused, merge
from kvpolicy.kernels import cpu_attention

pytestmark = pytest.mark.usefixtures("cpu_kernel")

TORCH = TorchBackend()
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def backend():
    from kvpolicy.backends.cpu_backend import CpuBackend

    return CpuBackend()


def exact(q: PackedTensor) -> torch.Tensor:
    """float64 values of the stored codes and metadata, ``(B, H, n, D)`` (no rounding anywhere)."""
    v = unpack(q.codes, q.bits).double() * q.scales.double().unsqueeze(-1) + q.zeros.double().unsqueeze(-1)
    if q.axis == "token":
        return v.reshape(q.shape)
    return v.transpose(-1, -2).reshape(q.shape)


def reference(query: torch.Tensor, keys: PackedTensor, values: PackedTensor, scale: float):
    """Dequantize + softmax attention in float64: ``(out, lse)``."""
    scores = torch.matmul(query.double(), exact(keys).transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.softmax(scores, dim=-1), exact(values)), lse


def _data(gen, shape, dtype, spread, offset):
    return (torch.randn(shape, generator=gen) * spread + offset).to(dtype)


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    d = draw(st.sampled_from([16, 32, 64, 96]))
    kb, vb = draw(st.sampled_from([2, 3, 4])), draw(st.sampled_from([2, 3, 4]))
    # 3-bit groups hold whole runs of eight codes (three bytes)
    gk = draw(st.sampled_from([g for g in (4, 8, 12, 20, 32, 64) if kb != 3 or g % 8 == 0]))
    gv = draw(st.sampled_from([g for g in (4, 8, 16, 32, 48, 64) if d % g == 0 and (vb != 3 or g % 8 == 0)]))
    n = gk * draw(st.integers(1, 7))  # whole key groups; odd token counts with gk = 4 * odd
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    nq = draw(st.integers(1, 9))  # GQA heads x query tokens
    spread = draw(st.sampled_from([0.05, 1.0, 4.0]))
    offset = draw(st.sampled_from([0.0, -3.0, 20.0]))
    splits = draw(st.sampled_from([None, 1, 2, 3, 8]))
    seed = draw(st.integers(0, 2**31 - 1))
    return dtype, (b, h, n, d), nq, (kb, gk), (vb, gv), spread, offset, splits, seed


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_attend_equals_float64_reference(case):
    dtype, shape, nq, (kb, gk), (vb, gv), spread, offset, splits, seed = case
    gen = torch.Generator().manual_seed(seed)
    be = backend()
    be.splits = splits
    keys = be.quantize(_data(gen, shape, dtype, spread, offset), kb, gk, "channel")
    values = be.quantize(_data(gen, shape, dtype, spread, offset), vb, gv, "token")
    query = torch.randn((*shape[:2], nq, shape[3]), generator=gen).to(dtype)
    scale = shape[3] ** -0.5
    out, lse = be.attend(query, keys, values, scale)
    ref_out, ref_lse = reference(query, keys, values, scale)
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    # float32 accumulation over n terms of size |v| (|score|): a few ulps of the magnitudes involved
    v_mag = float(exact(values).abs().max()) + 1.0
    s_mag = float(ref_lse.abs().max()) + 1.0
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=3e-6 * v_mag * (1 + s_mag))
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=3e-6 * s_mag * shape[3] ** 0.5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attend_equals_backend_reference_attend(dtype):
    """Against the contract's reference implementation (``Backend.attend``, which dequantizes into the
    tensor's dtype first: fp16 / bf16 differ by that rounding)."""
    gen = torch.Generator().manual_seed(3)
    be = backend()
    keys = be.quantize(torch.randn(2, 3, 192, 64, generator=gen).to(dtype), 2, 64, "channel")
    values = be.quantize(torch.randn(2, 3, 192, 64, generator=gen).to(dtype), 2, 64, "token")
    query = torch.randn(2, 3, 3, 64, generator=gen).to(dtype)
    out, lse = be.attend(query, keys, values, 0.125)
    ref_out, ref_lse = Backend.attend(TORCH, query, keys, values, 0.125)
    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out, ref_out, rtol=0, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=tol)
    # and the torch backend's own attend, which keeps float32 like the kernel
    t_out, t_lse = TORCH.attend(query, keys, values, 0.125)
    torch.testing.assert_close(out, t_out, rtol=0, atol=2e-5)
    torch.testing.assert_close(lse, t_lse, rtol=0, atol=2e-5)


@pytest.mark.parametrize("meta_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("kb", "vb"), [(2, 2), (4, 4), (2, 4), (3, 2), (3, 3)])
def test_attend_reads_wide_metadata(meta_dtype, kb, vb):
    """float32 keys around 1e5 (per channel) and values around 1e6 (per token), stored with float32 /
    bfloat16 metadata: the kernel reads that dtype (queries scaled so the scores stay moderate)."""
    gen = torch.Generator().manual_seed(kb * 10 + vb)
    be = backend()
    shape = (1, 2, 96, 64)
    k_in, v_in = torch.randn(shape, generator=gen) * 1e5, torch.randn(shape, generator=gen) * 1e6
    k_in[..., 1] += 2e5  # an all-positive channel: a large minimum
    keys = be.quantize(k_in, kb, 32, "channel", meta_dtype=meta_dtype)
    values = be.quantize(v_in, vb, 16, "token", meta_dtype=meta_dtype)
    assert keys.scales.dtype == values.zeros.dtype == getattr(torch, meta_dtype)
    query = torch.randn(1, 2, 3, 64, generator=gen) * 1e-5
    out, lse = be.attend(query, keys, values, 0.125)
    ref_out, ref_lse = reference(query, keys, values, 0.125)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    v_mag = float(exact(values).abs().max())
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=3e-6 * v_mag * (1 + float(ref_lse.abs().max())))
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-4)


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_large_values_with_default_metadata_raise(axis):
    """The cpu backend quantizes like torch: float32 beyond float16's range raises, never stores inf."""
    from kvpolicy.errors import MetadataOverflowError

    with pytest.raises(MetadataOverflowError, match=r"backend 'cpu'.*float16 metadata.*meta_dtype='float32'"):
        backend().quantize(torch.randn(1, 2, 32, 64) * 1e5, 2, 32, axis)


def test_two_segments_merge_to_the_whole():
    gen = torch.Generator().manual_seed(5)
    be = backend()
    keys = be.quantize(torch.randn(1, 2, 160, 64, generator=gen), 4, 32, "channel")
    values = be.quantize(torch.randn(1, 2, 160, 64, generator=gen), 2, 32, "token")
    query = torch.randn(1, 2, 5, 64, generator=gen)
    whole = be.attend(query, keys, values, 0.125)
    parts = [be.attend(query, keys.narrow(s, ln), values.narrow(s, ln), 0.125) for s, ln in ((0, 96), (96, 64))]
    out, lse = merge(parts)
    torch.testing.assert_close(out, whole[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(lse, whole[1], rtol=0, atol=2e-6)
    ref_out, ref_lse = reference(query, keys, values, 0.125)
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-5)


def test_strided_token_slice_is_read_in_place():
    """A token slice of a bigger container (batch/head strides larger than the slice) attends correctly."""
    gen = torch.Generator().manual_seed(6)
    be = backend()
    keys = be.quantize(torch.randn(2, 2, 128, 32, generator=gen), 2, 16, "channel").narrow(32, 64)
    values = be.quantize(torch.randn(2, 2, 128, 32, generator=gen), 2, 16, "token").narrow(32, 64)
    assert not keys.codes.is_contiguous()
    query = torch.randn(2, 2, 2, 32, generator=gen)
    out, lse = be.attend(query, keys, values, 0.2)
    ref_out, ref_lse = reference(query, keys, values, 0.2)
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-5)


def test_empty_segment():
    be = backend()
    keys = be.quantize(torch.zeros(1, 2, 0, 64), 2, 32, "channel")
    values = be.quantize(torch.zeros(1, 2, 0, 64), 2, 32, "token")
    out, lse = be.attend(torch.randn(1, 2, 3, 64), keys, values, 0.125)
    assert out.shape == (1, 2, 3, 64) and (out == 0).all()
    assert lse.shape == (1, 2, 3) and (lse == -float("inf")).all()


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_end_to_end_logits_equal_torch_backend(bits):
    """Tiny GQA Llama, fused decode: 36 steps across key-group flushes; only the backend differs.

    The two attends differ by float32 rounding (~1e-7), which reaches the next layer's keys; a key
    that sits on a rounding boundary of the quantizer can then take the neighbouring code (seen here
    at 4 bits: one code of layer 1), which moves later logits by up to ~5e-4. So: nearly all logits
    agree to float rounding (median), none by more than a few such steps, and the stored codes all but
    agree.
    """
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (2, 75), generator=torch.Generator().manual_seed(1))
    kw = dict(policy="log", window=8, bits=bits, group_size=16)
    enable_fused(model)
    try:
        ref_cache = CompressedCache(**kw, backend="torch")
        ref = teacher_forced_logits(model, ids, 38, ref_cache)
        cache = CompressedCache(**kw, backend="cpu")
        got = teacher_forced_logits(model, ids, 38, cache)
    finally:
        disable_fused(model)
    assert set(cache.attention_paths().values()) == {f"fused ({cache.backend.name})"}
    diff = (got - ref).abs()
    assert float(diff.median()) < 5e-6
    assert float(diff.max()) < 2e-3
    for mine, theirs in zip(cache.layers, ref_cache.layers, strict=True):
        for stream in ("k", "v"):
            a, b = getattr(mine.store, stream).q.codes, getattr(theirs.store, stream).q.codes
            assert a.shape == b.shape and int((a != b).sum()) <= 2


def test_unsupported_layouts_and_widths_are_refused():
    with pytest.raises(ConfigError, match="key_axis='token'"):
        CompressedCache(policy="log", bits=2, backend="cpu", key_axis="token")
    with pytest.raises(ConfigError, match="value_axis='channel'"):
        CompressedCache(policy="log", bits=2, backend="cpu", value_axis="channel")
    with pytest.raises(ConfigError, match="bits=8"):
        CompressedCache(policy="log", bits=8, backend="cpu")
    be = backend()
    with pytest.raises(ConfigError, match="float64"):
        be.check_tensor(torch.zeros(1, dtype=torch.float64))
    keys = TORCH.quantize(torch.randn(1, 1, 8, 16), 2, 8, "token")
    values = TORCH.quantize(torch.randn(1, 1, 8, 16), 2, 8, "token")
    with pytest.raises(ConfigError, match="keys grouped along 'channel'"):
        be.attend(torch.randn(1, 1, 1, 16), keys, values, 1.0)


def test_build_failures_raise_config_error(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_attention, "_module", None)
    monkeypatch.setenv("KVPOLICY_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(ConfigError, match="no C\\+\\+ compiler"):
        backend()
    monkeypatch.delenv("CXX")
    real_which = cpu_attention.shutil.which
    monkeypatch.setattr(
        cpu_attention.shutil, "which", lambda name, **kw: None if name == "ninja" else real_which(name, **kw)
    )
    with pytest.raises(ConfigError, match="needs the ninja build tool"):
        backend()
    monkeypatch.setattr(cpu_attention.shutil, "which", real_which)
    monkeypatch.setattr(cpu_attention, "CFLAGS", ("-O3", "--no-such-compiler-option"))  # g++ stops at once
    with pytest.raises(ConfigError, match="could not build its C\\+\\+ kernel"):
        backend()
