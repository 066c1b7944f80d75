"""The ``cpu`` backend: its C++ ``attend`` against exact float64 attention over the stored codes (min-max
and codebook blocks, in every key/value combination), the log-sum-exp merge of segments, end-to-end logits
against the ``torch`` backend, and its refusals."""

from __future__ import annotations

import pytest
import torch
from conftest import fused_and_materialized, teacher_forced_logits, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpolicy import CompressedCache
from kvpolicy.backends.base import Backend, QTensor
from kvpolicy.backends.torch_backend import TorchBackend, unpack
from kvpolicy.errors import ConfigError
from kvpolicy.formats import codebook
from kvpolicy.formats.codebook import CodebookTensor
from kvpolicy.fused import disable_fused, enable_fused, merge
from kvpolicy.kernels import cpu_attention

# two threads: the kernel splits its work over torch's thread pool (at::parallel_for)
pytestmark = pytest.mark.usefixtures("cpu_kernel", "two_threads")

TORCH = TorchBackend()
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def backend():
    from kvpolicy.backends.cpu_backend import CpuBackend

    return CpuBackend()


def exact(q: QTensor) -> torch.Tensor:
    """float64 values of the stored codes and metadata, ``(B, H, n, D)`` (no rounding anywhere): min-max
    ``s * code + z``, codebook ``s * C[code]`` (``C`` the float32 table the kernel reads)."""
    if isinstance(q, CodebookTensor):
        return codebook.centroids(q.bits).double()[unpack(q.codes, q.bits).long()] * q.scales.double().unsqueeze(-1)
    v = unpack(q.codes, q.bits).double() * q.scales.double().unsqueeze(-1) + q.zeros.double().unsqueeze(-1)
    if q.axis == "token":
        return v.reshape(q.shape)
    return v.transpose(-1, -2).reshape(q.shape)


def reference(query: torch.Tensor, keys: QTensor, values: QTensor, scale: float):
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
    _assert_matches_reference(query, keys, values, scale, out, lse)


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


@pytest.mark.parametrize("fit", ["minmax", "mse"])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_large_values_with_default_metadata_raise(axis, fit):
    """The cpu backend quantizes like torch: float32 beyond float16's range raises, never stores inf."""
    from kvpolicy.errors import MetadataOverflowError

    with pytest.raises(MetadataOverflowError, match=r"backend 'cpu'.*float16 metadata.*meta_dtype='float32'"):
        backend().quantize(torch.randn(1, 2, 32, 64) * 1e5, 2, 32, axis, fit=fit)


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


# ------------------------------------------------------------------ codebook blocks

#: (keys, values) schemes the kernel reads besides min-max / min-max
CODEBOOK_PAIRS = [("minmax", "codebook"), ("codebook", "codebook"), ("codebook", "minmax")]


def _block(be, x: torch.Tensor, scheme: str, role: str, bits: int, group: int, meta_dtype: str) -> QTensor:
    if scheme == "codebook":
        return be.quantize(x, bits, None, "token", meta_dtype=meta_dtype, scheme="codebook")
    return be.quantize(x, bits, group, "channel" if role == "key" else "token", meta_dtype=meta_dtype)


def _assert_matches_reference(query, keys, values, scale, out, lse):
    """float32 accumulation over n terms of size |v| (|score|): a few ulps of the magnitudes involved."""
    ref_out, ref_lse = reference(query, keys, values, scale)
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    v_mag = float(exact(values).abs().max()) + 1.0
    s_mag = float(ref_lse.abs().max()) + 1.0
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=3e-6 * v_mag * (1 + s_mag))
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=3e-6 * s_mag * query.shape[-1] ** 0.5)


@pytest.mark.parametrize("meta_dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize(("kb", "vb"), [(2, 2), (2, 3), (2, 4), (3, 2), (3, 3), (3, 4), (4, 2), (4, 3), (4, 4)])
@pytest.mark.parametrize(("k_scheme", "v_scheme"), CODEBOOK_PAIRS)
def test_codebook_attend_equals_float64_reference(k_scheme, v_scheme, kb, vb, meta_dtype):
    """The kernel over codebook blocks (and mixes with min-max) is softmax attention over the exact
    reconstruction: every width pair, every metadata dtype, batch 2 and 3 kv heads, one and several
    queries, token counts of one, a few and more than a tile (codebook keys: not a multiple of the
    tile; min-max keys: whole groups of 8 or 16), one split and several, tiles of 64 and 5 tokens."""
    gen = torch.Generator().manual_seed(kb * 100 + vb * 10 + len(meta_dtype))
    be = backend()
    b, h, d = 2, 3, 64
    # (n, key group): min-max keys in whole groups
    sizes = [(1, 8), (7, 8), (64, 8), (133, 16)] if k_scheme == "codebook" else [(8, 8), (24, 8), (16, 16), (144, 16)]
    for (n, gk), nq, splits, tile in zip(sizes, [1, 4, 1, 3], [None, 2, 1, 3], [64, 5, 64, 64], strict=True):
        be.splits, be.tile = splits, tile
        keys = _block(be, torch.randn(b, h, n, d, generator=gen), k_scheme, "key", kb, gk, meta_dtype)
        values = _block(be, torch.randn(b, h, n, d, generator=gen) * 2, v_scheme, "value", vb, 16, meta_dtype)
        query = torch.randn(b, h, nq, d, generator=gen)
        out, lse = be.attend(query, keys, values, 0.125)
        _assert_matches_reference(query, keys, values, 0.125, out, lse)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pair=st.sampled_from(CODEBOOK_PAIRS), kb=st.sampled_from([2, 3, 4]), vb=st.sampled_from([2, 3, 4]),
    d=st.sampled_from([8, 16, 32, 64, 96, 128]), n=st.integers(1, 300), nq=st.integers(1, 9),
    b=st.integers(1, 2), h=st.integers(1, 3), splits=st.sampled_from([None, 1, 2, 7]),
    tile=st.sampled_from([1, 3, 16, 64, 128]), meta=st.sampled_from(["float16", "bfloat16", "float32"]),
    spread=st.sampled_from([0.05, 1.0, 30.0]), seed=st.integers(0, 2**31 - 1),
)  # fmt: skip
def test_codebook_attend_fuzzed(pair, kb, vb, d, n, nq, b, h, splits, tile, meta, spread, seed):
    """Head dims whose rows are not whole 16-byte blocks (the decoding's scalar tails), tiles of one token
    up to more than the whole segment, scales from small to large."""
    k_scheme, v_scheme = pair
    gen = torch.Generator().manual_seed(seed)
    be = backend()
    be.splits, be.tile = splits, tile
    gk = 8
    if k_scheme == "minmax":
        n = max(gk, n - n % gk)
    keys = _block(be, torch.randn(b, h, n, d, generator=gen) * spread, k_scheme, "key", kb, gk, meta)
    values = _block(be, torch.randn(b, h, n, d, generator=gen) * spread, v_scheme, "value", vb, 8, meta)
    query = torch.randn(b, h, nq, d, generator=gen) / spread
    out, lse = be.attend(query, keys, values, d**-0.5)
    _assert_matches_reference(query, keys, values, d**-0.5, out, lse)


def test_codebook_token_slice_of_a_larger_block_is_read_in_place():
    """A token range of a bigger codebook container (what a tier holds: batch and head strides larger than
    the slice) attends like the range on its own."""
    gen = torch.Generator().manual_seed(8)
    be = backend()
    keys = be.quantize(torch.randn(2, 2, 120, 64, generator=gen), 3, None, "token", scheme="codebook")
    values = be.quantize(torch.randn(2, 2, 120, 64, generator=gen), 4, None, "token", scheme="codebook")
    keys, values = keys.narrow(13, 70), values.narrow(13, 70)
    assert not keys.codes.is_contiguous() and not values.scales.is_contiguous()
    query = torch.randn(2, 2, 3, 64, generator=gen)
    out, lse = be.attend(query, keys, values, 0.125)
    _assert_matches_reference(query, keys, values, 0.125, out, lse)


def _no_torch_attention(monkeypatch):
    """Make every piece of the ``torch`` computation of attention raise: a fallback from the kernel fails."""

    def refuse(*args, **kwargs):
        raise AssertionError("the cpu backend fell back to the torch computation of attention")

    monkeypatch.setattr(TorchBackend, "attend", refuse)
    monkeypatch.setattr(Backend, "attend", refuse)
    for name in ("key_scores", "value_mix"):
        monkeypatch.setattr(codebook, name, refuse)


@pytest.mark.parametrize(("k_scheme", "v_scheme"), CODEBOOK_PAIRS)
def test_codebook_blocks_do_not_take_the_torch_computation(monkeypatch, k_scheme, v_scheme):
    gen = torch.Generator().manual_seed(9)
    be = backend()
    keys = _block(be, torch.randn(1, 3, 128, 64, generator=gen), k_scheme, "key", 2, 64, "float16")
    values = _block(be, torch.randn(1, 3, 128, 64, generator=gen), v_scheme, "value", 2, 64, "float16")
    want = reference(torch.ones(1, 3, 2, 64), keys, values, 0.125)
    _no_torch_attention(monkeypatch)
    out, lse = be.attend(torch.ones(1, 3, 2, 64), keys, values, 0.125)
    torch.testing.assert_close(out.double(), want[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), want[1], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "kw",
    [
        # the tuned preset's shape: a 4-bit codebook middle tier, 2-bit keys per channel + codebook values below
        dict(action="tiered", keep=[{"name": "log", "window": 8}],
             tiers=[{"bits": 4, "scheme": "codebook"}, {"bits": 2, "value_scheme": "codebook", "group_size": 16}]),
        dict(bits=3, key_scheme="codebook", group_size=16),  # codebook keys, min-max values per token
    ],
    ids=["preset-tiers", "codebook-keys"],
)  # fmt: skip
def test_codebook_caches_decode_through_the_kernel_alone(monkeypatch, kw):
    """Fused decode of a tiny model over codebook stores: no attend reaches the torch computation, and
    the logits equal the materialised path's."""
    _no_torch_attention(monkeypatch)  # the materialised path builds the history: it calls no attend
    got, ref, cache = fused_and_materialized(**dict(group_size=None, transform="hadamard", backend="cpu") | kw)
    assert set(cache.attention_paths().values()) == {"fused (cpu)"}
    if "tiers" in kw:
        assert all(p.shape[1] for p in cache.layers[0].engine.held.store.tier_positions())  # both tiers hold tokens
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)


def test_bad_codebook_blocks_are_refused_naming_the_role():
    be = backend()
    x = torch.randn(1, 2, 16, 64)
    cb = be.quantize(x, 2, None, "token", scheme="codebook")
    mm_keys = be.quantize(x, 2, 16, "channel")
    query = torch.randn(1, 2, 1, 64)
    wide = be.quantize(x, 2, None, "token", meta_dtype="float32", scheme="codebook")
    # each role reads its own metadata dtype (float16 min-max keys beside float32 codebook values)
    from kvpolicy.backends.torch_backend import TorchBackend

    got, want = be.attend(query, mm_keys, wide, 0.125), TorchBackend().attend(query, mm_keys, wide, 0.125)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    bad_codes = CodebookTensor(cb.codes[..., :8], cb.scales, 2, cb.shape, cb.dtype)
    with pytest.raises(
        ConfigError, match=r"CodebookTensor values of shape \(1, 2, 16, 64\) at 2 bits need uint8 codes"
    ):
        be.attend(query, mm_keys, bad_codes, 0.125)
    bad_scales = CodebookTensor(cb.codes, cb.scales.double(), 2, cb.shape, cb.dtype)
    with pytest.raises(ConfigError, match=r"CodebookTensor keys need one float16, bfloat16 or float32 scale per token"):
        be.attend(query, bad_scales, cb, 0.125)
    eight = CodebookTensor(cb.codes, cb.scales, 8, cb.shape, cb.dtype)
    with pytest.raises(
        ConfigError, match=r"reads keys of scaled table codes with a table of 256 values at bits \[2, 3, 4\]"
    ):
        be.attend(query, eight, cb, 0.125)
    with pytest.raises(ConfigError, match=r"values of shape .* do not hold the tokens of keys"):
        be.attend(query, cb, cb.narrow(0, 8), 0.125)


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
            a, b = getattr(mine.engine.held.store, stream).q.codes, getattr(theirs.engine.held.store, stream).q.codes
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


@pytest.mark.parametrize(("k_scheme", "v_scheme"), CODEBOOK_PAIRS)
@pytest.mark.parametrize("bits", [2, 4])
def test_scores_far_below_the_maximum_weigh_nothing(k_scheme, v_scheme, bits):
    """Scores more than 87 below the running maximum (where float32's exp underflows) weigh exactly
    nothing, and the result is still the softmax of the reference: one token per group dominates."""
    gen = torch.Generator().manual_seed(bits)
    be = backend()
    b, h, n, d = 1, 2, 256, 64
    keys_x = torch.randn(b, h, n, d, generator=gen)
    keys_x[:, :, 77] = 6.0  # far along the query's direction
    keys = _block(be, keys_x, k_scheme, "key", bits, 64, "float16")
    values = _block(be, torch.randn(b, h, n, d, generator=gen), v_scheme, "value", bits, 32, "float16")
    query = torch.full((b, h, 3, d), 4.0)
    out, lse = be.attend(query, keys, values, 1.0)
    _assert_matches_reference(query, keys, values, 1.0, out, lse)
    ref_scores = torch.matmul(query.double(), exact(keys).transpose(-1, -2))
    gap = ref_scores.amax(-1, keepdim=True) - ref_scores
    assert (gap > 100).float().mean() > 0.9  # most tokens sit below float32's exp range
    torch.testing.assert_close(out.double(), exact(values)[:, :, 77:78].expand_as(out), rtol=0, atol=1e-4)
