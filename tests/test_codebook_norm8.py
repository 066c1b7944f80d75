"""One-byte codebook scales (``Codebook(norm_bits=8)``, kvpolicy/formats/codebook.py): the scale's error
bound, blocks, saved state, bytes, backends and a real cache against the 16-bit scales."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json

import pytest
import torch
from conftest import fused_and_materialized
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy import CacheSpec, CompressedCache
from kvpolicy.actions.quantize import Quantize
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.errors import ConfigError, MetadataOverflowError, NonFiniteError
from kvpolicy.formats import Codebook, MinMax, codebook, scale_codes
from kvpolicy.formats.codebook import CodebookTensor
from kvpolicy.formats.scale_codes import COARSE_ERROR, FINE_ERROR

#: float32 rounding of a decoded scale (the table entry and the exact scale are each rounded once)
F32 = 4 * torch.finfo(torch.float32).eps
#: octaves below a row's largest scale that fine codes hold, and that codes hold at all (a little less
#: than the coarse codes reach)
FINE_SPAN = (scale_codes.TOP - scale_codes.FINE_LOW) / scale_codes.STEPS
SPAN = FINE_SPAN + (scale_codes.FINE_LOW - 2) * scale_codes.COARSE / scale_codes.STEPS


def _exact_scales(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The norm-corrected scales in float32 (what 8-bit codes approximate)."""
    return Codebook(bits, meta_dtype="float32").quantize(x).scales


# ------------------------------------------------------------------ the scale's error bound


@settings(max_examples=60, deadline=None)
@given(
    top=st.floats(-115.0, 120.0),
    spread=st.floats(0.0, SPAN),
    seed=st.integers(0, 2**16),
)
def test_decoded_scales_are_within_the_documented_bounds(top, spread, seed):
    """Every positive scale within the codes' span below its row's largest decodes within FINE_ERROR
    (within the fine span of the largest) or COARSE_ERROR (below it)."""
    gen = torch.Generator().manual_seed(seed)
    octaves = top - spread * torch.rand(2, 3, 40, generator=gen, dtype=torch.float64)
    scales = torch.exp2(octaves).float()
    codes, base = scale_codes.encode_scales(scales)
    assert codes.dtype == torch.uint8 and base.dtype == torch.int16 and tuple(base.shape) == (2, 3, 1)
    assert bool((codes > 0).all())
    err = (scale_codes.decode_scales(codes, base).double() / scales.double() - 1).abs()
    below = scales.double().amax(dim=-1, keepdim=True).log2() - scales.double().log2()
    fine = below <= FINE_SPAN - 1 / scale_codes.STEPS  # a grid step of margin for the rounding of both
    bound = torch.where(fine, FINE_ERROR, COARSE_ERROR) + F32
    assert bool((err <= bound).all()), float((err - bound).max())


@settings(max_examples=60, deadline=None)
@given(st.floats(min_value=2.0**-126, max_value=2.0**127.98, allow_subnormal=False))
def test_any_normal_float32_scale_alone_in_its_row_decodes_within_the_bound(scale):
    s = torch.tensor([[[scale, 0.0]]], dtype=torch.float32)
    codes, base = scale_codes.encode_scales(s)
    decoded = scale_codes.decode_scales(codes, base).double()
    assert int(codes[0, 0, 1]) == 0 and float(decoded[0, 0, 1]) == 0.0
    assert abs(float(decoded[0, 0, 0]) / float(s[0, 0, 0]) - 1) <= FINE_ERROR + F32
    assert scale_codes.BASE_MIN <= int(base) <= scale_codes.BASE_MAX


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, torch.finfo(torch.float32).max])
def test_encoding_refuses_scales_no_code_holds(bad):
    with pytest.raises(ValueError, match="one-byte scales hold finite scales"):
        scale_codes.encode_scales(torch.tensor([[[1.0, bad]]]))


def test_the_bound_is_reached_just_above_a_midpoint_between_grid_points():
    """``log2 s`` goes to the nearest grid point: a scale just short of halfway below a grid point decodes to
    that point, off by (almost exactly) the bound."""
    below = 2.0 ** (-1 / (2 * scale_codes.STEPS) + 1e-6)
    s = torch.tensor([[[below, 1.0, 4.0]]])
    codes, base = scale_codes.encode_scales(s)
    decoded = scale_codes.decode_scales(codes, base)
    assert float(decoded[0, 0, 1]) == 1.0 and float(decoded[0, 0, 2]) == 4.0
    err = float(decoded[0, 0, 0]) / below - 1
    assert err <= FINE_ERROR + F32 and err == pytest.approx(FINE_ERROR, rel=1e-3)


@settings(max_examples=25, deadline=None)
@given(
    bits=st.sampled_from(codebook.CODEBOOK_BITS),
    magnitude=st.floats(-60.0, 60.0),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_quantized_scales_and_vectors_are_within_the_bound(bits, magnitude, dtype, seed):
    """Through the format: each one-byte scale within the bound of the norm-corrected scale, so each
    vector within ``COARSE_ERROR · ‖x‖`` of its 16-bit-free (float32 scale) reconstruction."""
    if dtype == torch.float16:
        magnitude = max(-8.0, min(magnitude, 10.0))  # float16 vectors: finite and not all subnormal
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 2, 9, 64, generator=gen) * torch.rand(2, 2, 9, 1, generator=gen).add(0.1)) * 2.0**magnitude
    x = x.to(dtype)
    exact = _exact_scales(x, bits).double()
    q = Codebook(bits, norm_bits=8).quantize(x)
    got = q.scale_values().double()
    assert float(((got - exact).abs() - (COARSE_ERROR + F32) * exact).max()) <= 0
    ref = Codebook(bits, meta_dtype="float32").quantize(x).dequantize().double()
    norms = torch.linalg.vector_norm(x.double(), dim=-1, keepdim=True)
    eps = torch.finfo(dtype).eps
    gap = torch.linalg.vector_norm(q.dequantize().double() - ref, dim=-1, keepdim=True)
    assert bool((gap <= (COARSE_ERROR + 2 * F32) * norms + 4 * eps * norms).all())


def test_vectors_far_below_the_longest_of_their_row_are_zeros_and_zero_vectors_stay_zero():
    x = torch.randn(1, 2, 4, 64)
    x[0, 0, 1] *= 2.0 ** -(SPAN + 1)  # beyond the span below the row's largest: stored as zero
    x[0, 1, 2] = 0.0
    q = Codebook(2, norm_bits=8).quantize(x)
    xh = q.dequantize()
    assert torch.equal(xh[0, 0, 1], torch.zeros(64)) and torch.equal(xh[0, 1, 2], torch.zeros(64))
    assert int(q.scales[0, 0, 1]) == 0 and int(q.scales[0, 1, 2]) == 0
    everything_zero = Codebook(2, norm_bits=8).quantize(torch.zeros(1, 1, 3, 64))
    assert int(everything_zero.scale_base) == scale_codes.BASE_MIN
    assert torch.equal(everything_zero.dequantize(), torch.zeros(1, 1, 3, 64))


def test_huge_float16_vectors_need_no_wider_metadata():
    """16-bit float16 scales overflow near 65504; one-byte scales decode in float32 and do not."""
    x = torch.full((1, 1, 2, 64), 60000.0, dtype=torch.float16)
    x[0, 0, 1, ::2] = -60000.0
    with pytest.raises(MetadataOverflowError):
        Codebook(3).quantize(x)
    q = Codebook(3, norm_bits=8).quantize(x)
    xh = q.dequantize()
    assert bool(torch.isfinite(xh).all())
    exact = _exact_scales(x, 3).double()
    assert float(((q.scale_values().double() / exact) - 1).abs().max()) <= FINE_ERROR + F32


def test_non_finite_vectors_and_norms_beyond_float32_are_refused():
    x = torch.randn(1, 1, 3, 64)
    x[0, 0, 1, 5] = float("nan")
    with pytest.raises(NonFiniteError, match="norm_bits=8"):
        Codebook(2, norm_bits=8).quantize(x)
    x[0, 0, 1, 5] = float("inf")
    with pytest.raises(NonFiniteError, match="norm_bits=8"):
        Codebook(2, norm_bits=8).quantize(x)
    huge = torch.full((1, 1, 1, 64), 3e38)
    with pytest.raises(MetadataOverflowError, match="norm_bits=8"):
        Codebook(2, norm_bits=8).quantize(huge)
    # the cache refuses NaN before the quantizer (check_finite), and refuses it without the check too
    cache = CompressedCache(policy="recent", window=2, bits=2, scheme="codebook", norm_bits=8, transform="hadamard",
                            backend="torch", check_finite=False)  # fmt: skip
    bad = torch.randn(1, 2, 10, 64)
    bad[0, 0, 1, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="norm_bits=8"):  # demotion is settled on the next step
        cache.update(bad, bad, 0)
        cache.update(bad[:, :, :1], bad[:, :, :1], 0)


# ------------------------------------------------------------------ blocks


@settings(max_examples=30, deadline=None)
@given(
    cuts=st.lists(st.integers(1, 39), max_size=4, unique=True),
    spread=st.floats(0.0, 20.0),
    seed=st.integers(0, 2**16),
)
def test_blocks_quantized_apart_and_concatenated_equal_one_block(cuts, spread, seed):
    """Concatenation re-expresses each block's codes around the largest base exactly: the stream's
    blocks (one per demotion) hold what quantizing all its tokens at once holds, bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 2, 40, 64, generator=gen) * torch.exp2(spread * torch.rand(2, 2, 40, 1, generator=gen))
    fmt = Codebook(3, norm_bits=8)
    whole = fmt.quantize(x)
    edges = [0, *sorted(cuts), 40]
    parts = [fmt.quantize(x[:, :, a:b]) for a, b in itertools.pairwise(edges)]
    joined = CodebookTensor.cat(parts)
    assert torch.equal(joined.scales, whole.scales) and torch.equal(joined.scale_base, whole.scale_base)
    assert torch.equal(joined.codes, whole.codes)


def test_narrow_select_map_batch_and_saved_state_keep_the_scales():
    x = torch.randn(3, 2, 10, 64)
    q = Codebook(4, norm_bits=8, centre=True).quantize(x, centre=x.mean(dim=2, keepdim=True))
    xh = q.dequantize()
    assert torch.equal(q.narrow(2, 5).dequantize(), xh[:, :, 2:7])
    index = torch.tensor([7, 0, 3])
    assert torch.equal(q.select(index).dequantize(), xh[:, :, index])
    pick = torch.tensor([2, 0])
    assert torch.equal(q.map_batch(lambda t: t.index_select(0, pick)).dequantize(), xh[pick])
    saved = codebook.state(q)
    assert saved["layout"] == "codebook-v3"
    back = codebook.from_state(saved)
    assert back.norm_bits == 8 and torch.equal(back.dequantize(), xh)
    with pytest.raises(ValueError, match="8-bit and 16-bit norms"):
        CodebookTensor.cat([q, Codebook(4, centre=True).quantize(x, centre=q.centre)])


def _saved_block() -> dict:
    return codebook.state(Codebook(2, norm_bits=8).quantize(torch.randn(1, 2, 5, 64)))


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: s.update(scale_base=torch.full((1, 2, 1), scale_codes.BASE_MAX + 1, dtype=torch.int16)),
         "scale_base holds values"),
        (lambda s: s.update(scale_base=torch.full((1, 2, 1), scale_codes.BASE_MIN - 1, dtype=torch.int16)),
         "scale_base holds values"),
        (lambda s: s.update(scale_base=s["scale_base"].int()), "int16 scale_base"),
        (lambda s: s.update(scale_base=torch.zeros(1, 2, 2, dtype=torch.int16)), "int16 scale_base"),
        (lambda s: s.pop("scale_base"), "int16 scale_base|tensor"),
        (lambda s: s.update(scales=s["scales"].half()), "uint8 one-byte codes"),
        (lambda s: s.update(layout="codebook-v1"), "no scale_base"),
        (lambda s: (s.pop("scale_base"), s.update(layout="codebook-v1")), "must be floating point"),
    ],
)  # fmt: skip
def test_saved_one_byte_blocks_are_checked_before_use(edit, match):
    saved = _saved_block()
    edit(saved)
    with pytest.raises(ValueError, match=match):
        codebook.from_state(saved)


# ------------------------------------------------------------------ configuration


def test_norm_bits_reaches_the_codebook_kinds_through_every_form():
    both = Quantize(scheme="codebook", norm_bits=8, key_centre=True)
    assert both.keys == Codebook(2, centre=True, norm_bits=8) and both.values == Codebook(2, norm_bits=8)
    values_only = Quantize(key_bits=4, value_scheme="codebook", norm_bits=8)
    assert isinstance(values_only.keys, MinMax) and values_only.values.norm_bits == 8
    for action in (both, values_only):
        assert eval(repr(action), {"Quantize": Quantize, "MinMax": MinMax, "Codebook": Codebook}) == action
    cache = CompressedCache(policy="log", window=4, bits=3, scheme="codebook", norm_bits=8, transform="hadamard")
    assert cache.action.keys.norm_bits == cache.action.values.norm_bits == 8
    tiered = CacheSpec.resolve(action="tiered", transform="hadamard", keep=[{"name": "log", "window": 32}],
                               tiers=[{"bits": 4, "scheme": "codebook", "norm_bits": 8},
                                      {"bits": 2, "scheme": "codebook"}])  # fmt: skip
    assert [t.values.norm_bits for t in tiered.action.tiers] == [8, 16]
    data = json.loads(json.dumps(CacheSpec.resolve(scheme="codebook", norm_bits=8, transform="hadamard").to_dict()))
    assert data["action"]["params"]["keys"]["part"]["params"]["norm_bits"] == 8


def test_a_preset_file_sets_norm_bits_per_tier(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(
        '[cache]\npolicy = "log"\nwindow = 4\ntransform = "hadamard"\naction = "tiered"\n'
        'keep = [{ name = "log", window = 32 }]\n'
        '[[cache.tiers]]\nbits = 4\nscheme = "codebook"\nnorm_bits = 8\n'
        '[[cache.tiers]]\nkey_bits = 3\nvalue_bits = 2\nscheme = "codebook"\nkey_centre = true\nnorm_bits = 8\n'
    )
    spec = CacheSpec.from_file(path)
    assert all(f.norm_bits == 8 for t in spec.action.tiers for f in (t.keys, t.values))


def test_a_spec_written_before_norm_bits_reads_as_sixteen_bits():
    data = CacheSpec.resolve(scheme="codebook", transform="hadamard").to_dict()
    for role in ("keys", "values"):
        del data["action"]["params"][role]["part"]["params"]["norm_bits"]
    assert CacheSpec.from_dict(data).action.keys.norm_bits == 16


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Codebook(2, norm_bits=12), r"norm_bits must be one of \[16, 8\]; got norm_bits=12"),
        (lambda: Codebook(2, norm_bits=True), "norm_bits must be one of"),
        (lambda: Quantize(scheme="codebook", norm_bits=4), r"refuses norm_bits=4: Codebook: norm_bits must be one of"),
        (lambda: Quantize(bits=2, norm_bits=8), "norm_bits=8 applies to neither role: keys in format 'minmax'"),
        (lambda: Quantize(keys=MinMax(2, 128, "channel"), value_bits=2, norm_bits=8), "applies to neither role"),
        (lambda: CompressedCache(bits=2, norm_bits=8), "norm_bits"),
    ],
)  # fmt: skip
def test_bad_norm_bits_are_refused_naming_the_parameter(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def test_a_backend_without_one_byte_scales_refuses_them():
    class SixteenOnly(TorchBackend):
        name = "sixteen-only"

        def check_format(self, fmt, role=""):  # a backend refuses the options of a format it cannot read
            super().check_format(fmt, role)
            if getattr(fmt, "norm_bits", 16) != 16:
                raise ConfigError(f"backend {self.name!r} does not read {role}s with norm_bits={fmt.norm_bits}; it "
                                  "supports norm_bits in [16]")  # fmt: skip

    Quantize(scheme="codebook").check_backend(SixteenOnly())
    with pytest.raises(ConfigError, match=r"does not read keys with norm_bits=8; it supports norm_bits in \[16\]"):
        Quantize(scheme="codebook", norm_bits=8).check_backend(SixteenOnly())
    assert TorchBackend().serves(Codebook(2, norm_bits=8), "key")


# ------------------------------------------------------------------ backends and caches


@pytest.mark.parametrize("name", ["torch", "cpu"])
def test_backends_pass_check_backend_with_one_byte_scales(name, cpu_kernel):
    from kvpolicy import registry
    from kvpolicy.testing import check_backend

    be = registry.get("backends", name)()
    fmts = [Codebook(b, norm_bits=8) for b in codebook.CODEBOOK_BITS] + [MinMax(3, 32, "channel"),
                                                                        MinMax(2, 32, "token")]  # fmt: skip
    check_backend(be, formats=fmts, bound="reference")


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize(
    "kw",
    [
        dict(group_size=None, bits=2, scheme="codebook", key_centre=True),
        dict(key_bits=4, value_bits=3, key_scheme="codebook", key_centre=True),  # min-max float16 values beside
        dict(key_bits=4, value_bits=2, value_scheme="codebook"),  # min-max keys beside
    ],
)  # fmt: skip
def test_fused_equals_materialized_with_one_byte_scales(backend, kw, cpu_kernel):
    got, ref, cache = fused_and_materialized(transform="hadamard", backend=backend, norm_bits=8, **kw)
    assert set(cache.attention_paths().values()) == {f"fused ({backend})"}
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)


@pytest.mark.parametrize(("saved_bits", "stream_bits"), [(16, 8), (8, 16)])
def test_a_stream_refuses_blocks_saved_with_the_other_scale_width(saved_bits, stream_bits):
    from kvpolicy.actions.quantize import QuantizedStream

    x = torch.randn(1, 2, 5, 64)
    saved = QuantizedStream(TorchBackend(), Codebook(3, norm_bits=saved_bits))
    saved.append(x)
    stream = QuantizedStream(TorchBackend(), Codebook(3, norm_bits=stream_bits))
    stream.load_state_dict(copy.deepcopy(saved.state_dict()))
    with pytest.raises(ValueError, match="scale"):
        stream.validate(x)


def test_bits_per_element_drop_by_eight_over_head_dim():
    """Per demoted token and head one byte less per stream; the base adds two bytes per row, head and stream."""
    x = torch.randn(2, 3, 300, 64)
    reports = {}
    for norm in (16, 8):
        cache = CompressedCache(policy="recent", window=16, bits=3, scheme="codebook", transform="hadamard",
                                backend="torch", norm_bits=norm)  # fmt: skip
        cache.update(x, x, 0)
        reports[norm] = cache.memory_report()
    demoted, b, h, d = 300 - 16, 2, 3, 64
    seg16, seg8 = reports[16].segments, reports[8].segments
    assert seg16["scales"] == 2 * b * h * demoted * 2
    assert seg8["scales"] == 2 * b * h * demoted * 1 and seg8["scale_base"] == 2 * b * h * 2
    assert seg8["codes"] == seg16["codes"]
    drop = reports[16].bits_per_element - reports[8].bits_per_element
    elements = 300 * b * h * 2 * d  # what bits_per_element divides by: every cached element, keys and values
    assert drop == pytest.approx((8 * 2 * b * h * demoted - 16 * 2 * b * h) / elements, rel=1e-12)
    assert drop == pytest.approx(8 / d * demoted / 300 - 32 / (300 * 2 * d), rel=1e-12)


@pytest.mark.parametrize(
    "kw",
    [
        dict(key_bits=4, value_bits=3, value_scheme="codebook", key_group_size=64, key_fit="mse", norm_bits=8),
        dict(key_bits=3, value_bits=2, key_scheme="codebook", key_centre=True, norm_bits=8),
        dict(bits=2, scheme="codebook", norm_bits=8),
    ],
)
def test_the_repr_of_one_byte_scales_is_the_keywords_that_build_it(kw):
    """A role without scales (min-max) must not hide the other role's width: the repr's keywords rebuild the
    action (kvpolicy-4.5bit's shape: min-max keys, codebook values with one-byte scales)."""
    action = Quantize(**kw)
    text = repr(action)
    assert "norm_bits=8" in text and "keys=" not in text
    assert eval(text, {"Quantize": Quantize}) == action


def test_the_cpu_kernel_decodes_one_byte_scales_to_the_very_scales_of_the_format_decoder():
    """The kernel reads one-byte codes and their base as stored (no decoded copy): its output equals, bit for
    bit, the kernel's output over the same blocks holding the float32 scales ``decode_scales`` gives, for
    codebook roles beside min-max, float16 and bfloat16 ones, norms from float32's subnormal range to 1e15, and
    token counts that take the kernel's eight-token and one-token paths."""
    check_one_byte_scales_in_the_cpu_kernel(
        [(Codebook(3, norm_bits=8), Codebook(2, norm_bits=8)), (Codebook(2, norm_bits=8), Codebook(3, "float16")),
         (MinMax(4, 32, "channel", meta_dtype="float16"), Codebook(3, norm_bits=8)),
         (Codebook(4, "float32", norm_bits=8), Codebook(3, "bfloat16", norm_bits=8))]
    )  # fmt: skip


def check_one_byte_scales_in_the_cpu_kernel(pairs: list) -> None:
    """The check above over ``(key format, value format)`` pairs (a plugin's scaled formats' tests call it)."""
    from kvpolicy.backends.cpu_backend import CpuBackend

    cpu = CpuBackend()
    gen = torch.Generator().manual_seed(8)

    def as_float(block):
        if getattr(block, "scale_base", None) is None:
            return block
        return dataclasses.replace(block, scales=block.scale_values(), scale_base=None)

    for kf, vf in pairs:
        for n, magnitude in ((1, 1.0), (9, 1e-41), (64, 1e15), (131, 1e-20)):
            n = 32 * (n // 32 + 1) if isinstance(kf, MinMax) else n
            spread = torch.exp2(6 * torch.rand(2, 3, n, 1, generator=gen))  # 6 octaves: fine and coarse codes
            k = torch.randn(2, 3, n, 64, generator=gen) * spread * (1.0 if isinstance(kf, MinMax) else magnitude)
            v = torch.randn(2, 3, n, 64, generator=gen) * spread
            q = torch.randn(2, 3, 2, 64, generator=gen)
            kq, vq = kf.quantize(k), vf.quantize(v)
            out, lse = cpu.attend(q, kq, vq, 0.125)
            want_out, want_lse = cpu.attend(q, as_float(kq), as_float(vq), 0.125)
            assert torch.equal(out, want_out) and torch.equal(lse, want_lse), (kf, vf, n, magnitude)
