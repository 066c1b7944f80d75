"""The ``triton`` backend over every format the shipped presets use, against the ``torch`` backend.

Under Triton's interpreter on the CPU (compiled on a GPU when there is one): codebook keys and values at 2, 3
and 4 bits with 16-bit and one-byte scales and centred keys, min-max groups at 2, 3 and 4 bits per channel and
per token, in every pairing, in each dtype; each shipped preset's whole decode on a tiny model; and the
backend that ``backend="auto"`` picks on CUDA (CUDA faked: there is no GPU here).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpolicy import CompressedCache, preset_files
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.errors import ConfigError
from kvpolicy.formats import Codebook, MinMax
from kvpolicy.formats.codebook import CodebookTensor
from kvpolicy.formats.packed import PackedTensor
from kvpolicy.fused import disable_fused, enable_fused
from kvpolicy.layer import composition as specs
from kvpolicy.prefill import teacher_forced_logits
from kvpolicy.presets import BUILTIN_PRESETS

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
REF = TorchBackend()
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def make_backend():
    """A triton backend: compiled on a GPU, else under the interpreter (switched on while it is built)."""
    from kvpolicy.backends.triton_backend import TritonBackend

    if GPU:
        return TritonBackend()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        return TritonBackend()


#: key formats of the shipped presets and of the one-liner (``CompressedCache(policy="log", bits=2)``)
KEY_FORMATS = [
    MinMax(2, 128, "channel", fit="mse"),  # the one-liner
    MinMax(2, 32, "channel"),  # kivi
    MinMax(3, 64, "channel"),  # gemma3-270m-3.5bit
    MinMax(4, 64, "channel"),  # kvpolicy-4.5bit
    MinMax(2, 64, "token"),  # logquant
    MinMax(4, 64, "token"),  # logquant-4bit
    *(Codebook(b, centre=True, norm_bits=n) for b in (2, 3, 4) for n in (8, 16)),  # the tiered presets
    *(Codebook(b, norm_bits=n) for b in (2, 3, 4) for n in (8, 16)),
]
#: value formats of the shipped presets and of the one-liner
VALUE_FORMATS = [
    MinMax(2, 64, "token"),  # the one-liner, logquant, gemma3-270m-3.5bit
    MinMax(2, 32, "token"),  # kivi
    MinMax(4, 64, "token"),  # logquant-4bit
    *(Codebook(b, norm_bits=n) for b in (2, 3, 4) for n in (8, 16)),  # the tiered presets, kvpolicy-4.5bit
]


def exact_blocks(q) -> torch.Tensor:
    """What a block stores, in float64 without rounding to its dtype: ``code * scale + min`` of min-max groups,
    ``centre + scale * C[code]`` of codebook blocks (their scales and centroids are float32 values)."""
    if isinstance(q, PackedTensor):
        from kvpolicy.formats.packed import _ungrouped, unpack

        dim = 3 if q.axis == "token" else 2
        s = q.scales.double().repeat_interleave(q.group_size, dim=dim)
        z = q.zeros.double().repeat_interleave(q.group_size, dim=dim)
        codes = _ungrouped(unpack(q.codes, q.bits), q.axis, tuple(q.shape))
        return codes.double() * s + z
    assert isinstance(q, CodebookTensor)
    out = q.unit_vectors().double() * q.scale_values().double().unsqueeze(-1)
    return out if q.centre is None else out + q.centre.double()


def exact_attention(query, k, v, scale, bias=None):
    """float64 attention over what the blocks store: ``(out, lse, max |score| per query)``."""
    scores = torch.matmul(query.double(), exact_blocks(k).transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.double()
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), exact_blocks(v)), lse, scores.abs().amax(dim=-1)


def quantize(x: torch.Tensor, fmt, parts: int):
    """``x`` quantized by the torch backend, in ``parts`` blocks concatenated (one-byte scales re-based)."""
    centre = x[:, :, :4].float().mean(dim=2, keepdim=True).to(x.dtype) if getattr(fmt, "centre", False) else None
    n = x.shape[2]
    step = fmt.group_size if fmt.grouped and fmt.axis == "channel" else 1
    cuts = sorted({0, n, *(step * ((n // step) * i // parts) for i in range(1, parts))})
    # later blocks hold longer vectors too: their one-byte scales move the base of the concatenation
    blocks = [
        REF.quantize(x[:, :, a:b] * (1 + i), fmt, centre=centre) for i, (a, b) in enumerate(itertools.pairwise(cuts))
    ]
    return REF.cat(blocks) if len(blocks) > 1 else blocks[0]


@st.composite
def cases(draw):
    kf = draw(st.sampled_from(KEY_FORMATS))
    vf = draw(st.sampled_from(VALUE_FORMATS))
    dtype = draw(st.sampled_from(DTYPES))
    head_dim = draw(st.sampled_from([64, 128]))
    step = max((f.group_size for f in (kf, vf) if f.grouped and f.axis == "channel"), default=1)
    if step > 1:
        n = step * draw(st.integers(1, 2))
        lead = step * draw(st.integers(0, 1))
    else:
        n, lead = draw(st.integers(1, 90)), draw(st.integers(0, 9))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 2)), n, head_dim)
    knobs = dict(tile=draw(st.sampled_from([None, 16, 32])), splits=draw(st.sampled_from([None, 1, 2, 3, 8])))
    return kf, vf, dtype, shape, lead, draw(st.integers(1, 5)), draw(st.integers(1, 2)), draw(st.booleans()), knobs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), seed=st.integers(0, 2**31 - 1))
def test_attend_agrees_with_the_torch_backend(case, seed):
    """Every key format with every value format the presets use, each dtype, head dims 64 and 128, tokens read
    in place from a larger block (``narrow``), blocks concatenated, with and without a score bias, tiles and
    token splits varied: the kernel's ``(out, lse)`` are within float32 summation error of exact attention
    over the stored codes, so within the torch backend's own error of the torch backend's."""
    kf, vf, dtype, (b, h, n, d), lead, nq, parts, with_bias, knobs = case
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, h, lead + n, d, generator=gen) * 2 + torch.randn(1, 1, 1, d, generator=gen) * 3
    values = torch.randn(b, h, lead + n, d, generator=gen)
    k = quantize(keys.to(dtype).to(DEVICE), kf, parts).narrow(lead, n)
    v = quantize(values.to(dtype).to(DEVICE), vf, parts).narrow(lead, n)
    query = (torch.randn(b, h, nq, d, generator=gen) * 1.5).to(dtype).to(DEVICE)
    bias = torch.randn(b, h, nq, n, generator=gen).to(DEVICE) if with_bias else None
    scale = d**-0.5
    backend = make_backend()
    backend.tile, backend.splits = knobs["tile"], knobs["splits"]
    backend.precision = "ieee"
    out, lse = backend.attend_biased(query, k, v, scale, bias)
    ref_out, ref_lse = REF.attend_biased(query, k, v, scale, bias)
    want_out, want_lse, top = exact_attention(query, k, v, scale, bias)
    assert out.dtype == lse.dtype == torch.float32 and out.shape == ref_out.shape and lse.shape == ref_lse.shape
    # float32 sums of d products (and of n probabilities times |V|)
    s_tol = 2e-5 * (1 + top)
    vmax = exact_blocks(v).abs().amax(dim=(-1, -2), keepdim=True).squeeze(-1)
    o_tol = (1e-5 + 2 * s_tol) * vmax
    lse_err, out_err = (lse.double() - want_lse).abs(), (out.double() - want_out).abs().amax(dim=-1)
    assert (lse_err <= s_tol).all(), float(lse_err.max())
    assert (out_err <= o_tol).all(), float(out_err.max())
    # hence against the torch backend: its own distance from exact attention plus the kernel's bound
    ref_lse_err = (ref_lse.double() - want_lse).abs()
    ref_out_err = (ref_out.double() - want_out).abs().amax(dim=-1)
    assert ((lse.double() - ref_lse.double()).abs() <= ref_lse_err + s_tol).all()
    assert ((out.double() - ref_out.double()).abs().amax(dim=-1) <= ref_out_err + o_tol).all()


@pytest.mark.parametrize("norm_bits", [8, 16])
def test_byte_scales_decode_bit_for_bit(norm_bits):
    """Scales spanning the whole one-byte grid (fine codes, coarse codes, code 0) and a centre: with a value
    block whose vectors are all one vector times its scale, the kernel's output is the softmax-weighted
    scales, and every scale it decoded equals the torch decoder's (:func:`decode_scales`)."""
    d, n = 64, 96
    gen = torch.Generator().manual_seed(norm_bits)
    direction = torch.randn(d, generator=gen)
    magnitudes = 2.0 ** torch.linspace(-8, 3, n)  # 11 octaves: past the fine and the coarse range
    values = (direction * magnitudes[:, None]).reshape(1, 1, n, d).to(DEVICE)
    v = REF.quantize(values, Codebook(4, norm_bits=norm_bits))
    keys = torch.zeros(1, 1, n, d, device=DEVICE)  # every score 0: uniform attention
    k = REF.quantize(keys + 1, Codebook(2, norm_bits=norm_bits))
    query = torch.zeros(1, 1, 1, d, device=DEVICE)
    backend = make_backend()
    for i in range(n):  # one token at a time: out = that token's value exactly
        out, _ = backend.attend(query, k.narrow(i, 1), v.narrow(i, 1), 1.0)
        want = v.narrow(i, 1).unit_vectors() * v.narrow(i, 1).scale_values().unsqueeze(-1)
        assert torch.equal(out, want.reshape(out.shape)), i
    if norm_bits == 8:
        assert int((v.scales == 0).sum()) > 0 and int(((v.scales > 0) & (v.scales < 64)).sum()) > 0


def test_role_checks_name_the_role():
    backend = make_backend()
    x = torch.randn(1, 2, 8, 64, device=DEVICE)
    k = REF.quantize(x, Codebook(3, norm_bits=8))
    v = REF.quantize(x, Codebook(2))
    q = torch.randn(1, 2, 1, 64, device=DEVICE)
    bad = CodebookTensor(k.codes, k.scales, 3, k.shape, k.dtype, None, None)  # byte scales without their base
    with pytest.raises(ConfigError, match=r"codebook key.*one-byte scales"):
        backend.attend(q, bad, v, 0.125)
    wrong_centre = CodebookTensor(v.codes, v.scales, 2, v.shape, v.dtype, torch.zeros(1, 2, 1, 32), None)
    with pytest.raises(ConfigError, match="the centre of codebook values"):
        backend.attend(q, k, wrong_centre, 0.125)

    class OtherTensor(CodebookTensor):  # another format's block, even one built on the codebook's
        pass

    other = OtherTensor(v.codes, v.scales, 2, v.shape, v.dtype, None, None)
    with pytest.raises(ConfigError, match=r"PackedTensor and CodebookTensor.*values=OtherTensor"):
        backend.attend(q, k, other, 0.125)
    for attr, value in (("tile", 24), ("splits", 0), ("precision", "fp8")):
        backend = make_backend()
        setattr(backend, attr, value)
        with pytest.raises(ConfigError, match=f"{attr}"):
            backend.attend(q, k, v, 0.125)


# --------------------------------------------------------------------------------------------------
# every shipped preset, whole decode
# --------------------------------------------------------------------------------------------------

#: overrides that make each preset compress within a short prompt (the compositions are the presets')
SMALL = {
    "logquant": dict(budget=24),
    "logquant-4bit": dict(budget=24),
    "kivi": dict(residual=16),
    "kvpolicy-3bit": dict(middle_window=8),
    "kvpolicy-3.5bit": dict(middle_window=8),
    "kvpolicy-4bit": dict(middle_window=8),
    "h2o": dict(budget=32),
    "streamingllm": dict(budget=32),
}
SHIPPED = sorted(BUILTIN_PRESETS) + preset_files.names()
#: presets that evict and quantize nothing: no backend reads their history
EVICTING = {"h2o", "streamingllm"}


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama", layers=1)
    enable_fused(m)
    yield m
    disable_fused(m)


@pytest.mark.parametrize("preset", SHIPPED)
def test_every_shipped_preset_decodes_fused_in_triton_like_torch(preset, model, monkeypatch):
    """Each shipped preset's whole decode (prefill, then one token at a time) with ``backend="triton"``: every
    compressed layer attends fused in the kernel, and the logits equal the torch backend's within 2e-3."""
    if not GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    ids = torch.randint(3, 96, (2, 145), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    logits, caches = {}, {}
    for name in ("torch", "triton"):
        caches[name] = CompressedCache.from_preset(preset, backend=name, **SMALL.get(preset, {}))
        logits[name] = teacher_forced_logits(model, ids, 140, caches[name])
    cache = caches["triton"]
    assert repr(cache.backend) == "'triton'"
    paths = set(cache.attention_paths().values())
    if preset in EVICTING:
        assert paths == {"full-precision"}
        torch.testing.assert_close(logits["triton"], logits["torch"], rtol=0, atol=0)
        return
    assert paths == {"fused (triton)"}, paths
    report = cache.memory_report().segments
    assert report["codes"] > 0 and report == caches["torch"].memory_report().segments  # the same blocks held
    worst = float((logits["triton"] - logits["torch"]).abs().max())
    assert worst <= 2e-3, worst


# --------------------------------------------------------------------------------------------------
# backend="auto" on CUDA
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", [p for p in SHIPPED if p not in EVICTING] + ["one-liner"])
def test_auto_on_cuda_serves_every_preset_fused_in_triton(preset, monkeypatch):
    """With CUDA available (faked here: the kernels would compile there), ``backend="auto"`` builds every
    quantizing preset, and the one-liner, on the triton backend, and plans its layers' decode fused."""
    from kvpolicy.kernels import triton_runtime

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(triton_runtime, "select_mode", lambda: "compiled")
    monkeypatch.setattr(specs, "_failed", {})
    cache = CompressedCache(policy="log", bits=2) if preset == "one-liner" else CompressedCache.from_preset(preset)
    assert cache.backend.name == "triton" and cache.backend.capabilities.devices == ("cuda",)
    assert "backend='triton'" in repr(cache)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for action in [cache.action, *getattr(cache.action, "tiers", ())]:
            plan = specs.plan(
                cache.policy, action, cache.backend, auto=True, attention="auto", device_type="cuda", dtype=dtype,
                key_dim=128, value_dim=128,
            )  # fmt: skip
            assert plan.backend is cache.backend and plan.fused_reason is None, plan


# --------------------------------------------------------------------------------------------------
# the launchers as custom operators
# --------------------------------------------------------------------------------------------------


def test_launchers_are_custom_operators_with_fake_implementations():
    """``torch.ops.kvpolicy.triton_*``: each passes ``torch.library.opcheck`` (schema, fake tensors, dispatch),
    and a function calling the attention launcher through :func:`~kvpolicy.kernels.triton_ops.call` traces with
    ``fullgraph=True`` and gives the launcher's result."""
    from kvpolicy.kernels import triton_ops

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 32, 64, generator=gen).to(DEVICE)
    k = REF.quantize(x, Codebook(3, centre=True, norm_bits=8), centre=x[:, :, :1])
    v = REF.quantize(x, MinMax(2, 32, "token"))
    q = torch.randn(1, 2, 3, 64, generator=gen).to(DEVICE)
    ops = triton_ops
    attend_args = (
        q, k.codes, k.scales, None, k.scale_base, k.centre, v.codes, v.scales, v.zeros, None, None, None,
        ops.CODEBOOK, 3, 1, ops.MINMAX_TOKEN, 2, 32, 32, 64, 0.125, 2, 16, "ieee", 4,
    )  # fmt: skip
    torch.library.opcheck(torch.ops.kvpolicy.triton_attend, attend_args)
    torch.library.opcheck(torch.ops.kvpolicy.triton_minmax_quantize, (x, 2, 32, True, torch.float16))
    codes, scales, zeros = ops.minmax_quantize(x, 4, 16, False, torch.float16)
    dequantize_args = (codes, scales, zeros, 4, 16, False, list(x.shape), torch.float32)
    torch.library.opcheck(torch.ops.kvpolicy.triton_minmax_dequantize, dequantize_args)
    want = ops.attend(*attend_args)
    got = torch.compile(lambda *a: ops.call(ops.attend, *a), backend="eager", fullgraph=True)(*attend_args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    out, lse = REF.attend(q, k, v, 0.125)
    torch.testing.assert_close(want[0], out, rtol=0, atol=1e-5)
    torch.testing.assert_close(want[1], lse, rtol=0, atol=1e-5)
