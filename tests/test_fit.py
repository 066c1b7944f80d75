"""``Quantize(fit="mse")``: min-max groups whose range is refitted for the least squared error."""

from __future__ import annotations

import pytest
import torch
from conftest import fused_and_materialized, saved_cache_continues, teacher_forced_logits, tiny_model
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpolicy import CompressedCache
from kvpolicy.actions.quantize import Quantize
from kvpolicy.backends.torch_backend import FP16_MAX, TorchBackend, fit_range, quantize_groups, unpack
from kvpolicy.errors import ConfigError, MetadataOverflowError
from kvpolicy.formats.base import FITS


def _group_errors(g: torch.Tensor, bits: int, mdtype: torch.dtype, fit: str) -> torch.Tensor:
    """Per group, ``Σ (zero + scale · code − x)²`` in float32 from what :func:`quantize_groups` stores."""
    codes, scales, zeros = quantize_groups(g, bits, mdtype, fit)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= (1 << bits) - 1
    back = zeros.float().unsqueeze(-1) + scales.float().unsqueeze(-1) * codes.float()
    return (back - g.float()).square().sum(-1)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4, 8]),
    n=st.sampled_from([4, 16, 64, 128]),
    mdtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    scale=st.floats(1e-3, 1e3),
    heavy=st.booleans(),
    seed=st.integers(0, 2**16),
)
# outliers past float16's range (|x| up to 65,509.8): float16 metadata cannot hold that group
@example(bits=2, n=128, mdtype=torch.float16, scale=877.0, heavy=True, seed=5903)
def test_a_fitted_group_never_stores_more_squared_error_than_its_minmax_grid(bits, n, mdtype, scale, heavy, seed):
    """The documented guarantee: computed in float32 from the stored metadata, per group. Groups whose
    min-max grid the metadata dtype cannot hold (float16 beyond ±65504) are refused by both fits alike."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(7, n, generator=gen) * scale
    if heavy:  # a few outliers per group, as keys have
        g = g + (torch.rand(7, n, generator=gen) < 0.05) * torch.randn(7, n, generator=gen) * 20 * scale
    try:
        minmax = _group_errors(g, bits, mdtype, "minmax")
    except MetadataOverflowError:
        # only float16 metadata, only past its range; and the fitted grid is refused too
        assert mdtype == torch.float16 and float(g.abs().max()) > FP16_MAX
        with pytest.raises(MetadataOverflowError):
            _group_errors(g, bits, mdtype, "mse")
        return
    fitted = _group_errors(g, bits, mdtype, "mse")
    assert bool((fitted <= minmax).all())


@pytest.mark.parametrize("fit", ["minmax", "mse"])
@pytest.mark.parametrize("outlier", [-65509.8, 2e5])
def test_groups_beyond_float16_metadata_are_refused_not_stored_as_inf(fit, outlier):
    """float32 groups float16 metadata cannot hold: a minimum below -65504 (it rounds down to -inf), or
    a scale (max - min) / 3 above 65504. Both fits refuse them, naming the dtype, the magnitude and the
    remedy; with float32's range the same groups are stored, finite."""
    g = torch.randn(5, 64, generator=torch.Generator().manual_seed(11)) * 100
    g[2, 7] = outlier
    with pytest.raises(MetadataOverflowError) as ei:
        quantize_groups(g, 2, torch.float16, fit)
    msg = str(ei.value)
    assert msg.startswith("backend 'torch': quantizing finite float32 values") and "float16 metadata" in msg
    assert f"{abs(outlier):.4g}" in msg and "meta_dtype='float32'" in msg
    for wide in (torch.float32, torch.bfloat16):
        _, scales, zeros = quantize_groups(g, 2, wide, fit)
        assert bool(torch.isfinite(scales).all() and torch.isfinite(zeros).all())


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    mdtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    bits=st.sampled_from([2, 3, 4, 8]),
    fit=st.sampled_from(["minmax", "mse"]),
    magnitude=st.floats(1e-3, 1e30),
    offset=st.floats(-1e6, 1e6),
    seed=st.integers(0, 2**16),
)
def test_quantize_groups_refuses_or_stores_finite_metadata(dtype, mdtype, bits, fit, magnitude, offset, seed):
    """The contract, for finite input away from float32's limit: an error, or finite scales and minimums
    whose grid holds every element (min-max: within half a step). float16 input (clamped to its range)
    is never refused."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(6, 16, generator=gen, dtype=torch.float64) * magnitude + offset
    if dtype == torch.float16:
        g = g.clamp(-FP16_MAX, FP16_MAX)
    g = g.to(dtype)
    try:
        codes, scales, zeros = quantize_groups(g, bits, mdtype, fit)
    except MetadataOverflowError:
        assert mdtype == torch.float16 and dtype != torch.float16 and float(g.float().abs().max()) > FP16_MAX
        return
    assert bool(torch.isfinite(scales).all() and torch.isfinite(zeros).all())
    back = zeros.double().unsqueeze(-1) + scales.double().unsqueeze(-1) * codes.double()
    assert bool(torch.isfinite(back).all())
    if fit == "minmax":
        err = (back - g.double()).abs()
        assert bool((err <= scales.double().unsqueeze(-1) * (0.5 + 1e-5) + 1e-6 * g.double().abs()).all())


def test_a_group_past_65504_whose_grid_fits_float16_is_kept():
    """Only the minimum and the scale must fit: a maximum of 65509.8 over small values stores a finite
    grid (its top, ``min + 3 · scale``, is computed in float32)."""
    g = torch.randn(3, 64, generator=torch.Generator().manual_seed(13)) * 100
    g[1, 5] = 65509.8
    for fit in FITS:
        codes, scales, zeros = quantize_groups(g, 2, torch.float16, fit)
        assert bool(torch.isfinite(scales).all() and torch.isfinite(zeros).all())
        back = zeros.float().unsqueeze(-1) + scales.float().unsqueeze(-1) * codes.float()
        assert float((back - g).abs().max()) <= float(scales.float().max())


def test_quantize_groups_and_the_backend_raise_one_error():
    """The backend's quantize runs quantize_groups' check: one message, naming the backend passed."""
    x = torch.randn(1, 1, 4, 64, generator=torch.Generator().manual_seed(12)) * 100
    x[0, 0, 1, 3] = -7e4
    with pytest.raises(MetadataOverflowError) as direct:
        quantize_groups(x.reshape(4, 1, 64), 2, torch.float16, "mse", backend=TorchBackend())
    with pytest.raises(MetadataOverflowError) as through:
        TorchBackend().quantize(x, 2, 64, "token", fit="mse")
    assert str(direct.value) == str(through.value)
    with pytest.raises(MetadataOverflowError, match=r"^backend 'my-plugin': .*meta_dtype='float32'"):
        quantize_groups(x.reshape(4, 64), 3, torch.float16, backend="my-plugin")


def test_float16_groups_fill_float16_metadata_without_overflow():
    """float16 input holds every group in float16 metadata: ±65504 at 2 bits stores a finite grid."""
    g = torch.tensor([[-65504.0, 65504.0, 0.0, 1.0] * 4, [65504.0] * 16], dtype=torch.float16)
    for fit in FITS:
        codes, scales, zeros = quantize_groups(g, 2, torch.float16, fit)
        back = zeros.float().unsqueeze(-1) + scales.float().unsqueeze(-1) * codes.float()
        assert bool(torch.isfinite(scales).all() and torch.isfinite(zeros).all())
        assert bool(((back.clamp(-FP16_MAX, FP16_MAX) - g.float()).abs() <= scales.float().unsqueeze(-1)).all())


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"bits": 1}, r"bits must be an integer from 2 to 8 \(uint8 codes\); got bits=1"),
        ({"bits": 9}, r"bits must be an integer from 2 to 8 .*; got bits=9"),
        ({"bits": 2.0}, r"bits must be an integer from 2 to 8 .*; got bits=2\.0"),
        ({"mdtype": torch.int8}, r"mdtype must be a floating-point torch\.dtype; got mdtype=torch\.int8"),
        ({"fit": "lloyd"}, r"fit must be one of \['minmax', 'mse'\]; got fit='lloyd'"),
    ],
)
def test_quantize_groups_refuses_bad_arguments_naming_them(kw, match):
    args = {"bits": 2, "mdtype": torch.float32, "fit": "minmax", **kw}
    with pytest.raises(ConfigError, match=r"^quantize_groups: " + match):
        quantize_groups(torch.randn(3, 8), args["bits"], args["mdtype"], args["fit"])


@pytest.mark.parametrize("bits,most", [(2, 0.75), (3, 0.85)])
def test_fitting_cuts_the_squared_error_of_gaussian_groups(bits, most):
    """64 Gaussian samples span about ±2.4σ, while the least-error 4-level grid spans about ±1.5σ: at
    2 bits the refit removes a third or more of the error (Lloyd-Max's uniform optimum is 0.119σ²
    against min-max's ~0.2σ²)."""
    g = torch.randn(2000, 64, generator=torch.Generator().manual_seed(0))
    ratio = _group_errors(g, bits, torch.float32, "mse").sum() / _group_errors(g, bits, torch.float32, "minmax").sum()
    assert ratio < most


def test_alternating_least_squares_never_raises_the_error_round_by_round():
    g = torch.randn(500, 64, generator=torch.Generator().manual_seed(3)) ** 3  # heavy-tailed
    lo, hi = g.amin(-1), g.amax(-1)
    qmax = 3

    def err(lo: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        c = ((g - lo[:, None]) / step[:, None]).round().clamp(0, qmax)
        return (lo[:, None] + step[:, None] * c - g).square().sum(-1)

    step = (hi - lo) / qmax
    previous = err(lo, step)
    for rounds in range(1, 6):
        now = err(*fit_range(g, lo, step, qmax, rounds))
        assert bool((now <= previous * (1 + 1e-5) + 1e-6).all())
        previous = now


def test_constant_and_two_valued_groups_come_back_exactly():
    g = torch.tensor([[1.5] * 8, [0.0] * 4 + [2.0] * 4])
    codes, scales, zeros = quantize_groups(g, 2, torch.float32, "mse")
    back = zeros.unsqueeze(-1) + scales.unsqueeze(-1) * codes.float()
    assert torch.equal(back, g)


def test_minmax_fit_is_unchanged_and_keeps_every_element_within_half_a_step():
    g = torch.randn(300, 64, generator=torch.Generator().manual_seed(4)) * 3
    codes, scales, zeros = quantize_groups(g, 2, torch.float32)
    again = quantize_groups(g, 2, torch.float32, "minmax")
    assert all(torch.equal(a, b) for a, b in zip(again, (codes, scales, zeros), strict=True))
    back = zeros.unsqueeze(-1) + scales.unsqueeze(-1) * codes.float()
    assert bool(((back - g).abs() <= scales.unsqueeze(-1) / 2 * (1 + 1e-5)).all())
    # the fitted grid clamps some extremes: more than half a step away, yet less error in all
    fc, fs, fz = quantize_groups(g, 2, torch.float32, "mse")
    fitted = fz.unsqueeze(-1) + fs.unsqueeze(-1) * fc.float()
    assert bool(((fitted - g).abs() > fs.unsqueeze(-1) / 2 * (1 + 1e-5)).any())
    assert float((fitted - g).square().sum()) < 0.8 * float((back - g).square().sum())


def test_fitted_blocks_are_stored_like_minmax_blocks():
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(5))
    be = TorchBackend()
    q = be.quantize(x, 2, 64, "token", fit="mse")
    codes = unpack(q.codes, 2).float()
    want = q.zeros.float().unsqueeze(-1) + q.scales.float().unsqueeze(-1) * codes.reshape(*q.scales.shape, 64)
    torch.testing.assert_close(be.dequantize(q), want.reshape(x.shape), rtol=0, atol=0)
    assert q.nbytes() == be.quantize(x, 2, 64, "token").nbytes()


# ------------------------------------------------------------------ in a cache


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_fused_equals_materialized_with_fitted_ranges(family, backend, cpu_kernel):
    got, ref, cache = fused_and_materialized(family, key_bits=4, value_bits=2, fit="mse", backend=backend)
    assert set(cache.attention_paths().values()) == {f"fused ({backend})"}
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)


def test_fitted_ranges_hold_the_same_bytes_and_change_what_is_stored():
    x = torch.randn(1, 2, 300, 64, generator=torch.Generator().manual_seed(6))
    plain = CompressedCache(policy="recent", window=16, bits=2, backend="torch", group_size=64, fit="minmax")
    fitted = CompressedCache(policy="recent", window=16, bits=2, backend="torch", group_size=64, fit="mse")
    plain.update(x, x, 0)
    fitted.update(x, x, 0)
    seg = fitted.memory_report().segments
    assert seg == plain.memory_report().segments and seg["codes"] > 0
    assert repr(fitted).count("fit='mse'") == 1 and repr(plain).count("fit=") == 1  # key_fit='minmax'
    assert repr(plain).endswith(
        "check_finite=True, key_fit='minmax'), backend='torch', layout='ordered', attention='auto')"
    )
    held, ref = fitted.layers[0].engine.held.store, plain.layers[0].engine.held.store
    assert not torch.equal(held.k.q.scales, ref.k.q.scales) and not torch.equal(held.v.q.scales, ref.v.q.scales)


def test_fitted_ranges_bring_a_tiny_model_closer_to_uncompressed():
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (1, 120), generator=torch.Generator().manual_seed(7))
    ref = teacher_forced_logits(model, ids, 80, CompressedCache(action="none"))

    def gap(**kw) -> float:
        got = teacher_forced_logits(
            model, ids, 80, CompressedCache(policy="log", window=4, bits=2, backend="torch", **kw)
        )
        return float((got - ref).square().mean())

    assert gap(fit="mse") < gap()


def test_saved_cache_keeps_its_fit(tmp_path):
    _, loaded = saved_cache_continues(
        tmp_path, policy="log", window=4, bits=2, group_size=16, fit="mse", backend="torch"
    )
    assert loaded.action.keys.fit == loaded.action.values.fit == "mse"


def test_repr_and_equality():
    # min-max keys name their fit, since the keys' default is "mse"; min-max values are the default and do not
    assert repr(Quantize(bits=2, fit="minmax")).endswith("check_finite=True, key_fit='minmax')")
    assert repr(Quantize(key_fit="minmax")) == repr(Quantize(bits=2, fit="minmax"))
    assert repr(Quantize(bits=2)).endswith("key_fit='mse')")  # the default fits the keys, and says so
    assert repr(Quantize(bits=2, fit="mse")).endswith("fit='mse')")
    assert Quantize(bits=2, fit="mse") != Quantize(bits=2) != Quantize(bits=2, fit="minmax")
    assert Quantize(bits=2) == Quantize(key_fit="mse", value_fit="minmax")
    assert Quantize(fit="mse") == Quantize(bits=2, fit="mse")
    mixed = Quantize(key_bits=4, value_bits=3, value_scheme="codebook", fit="mse")
    assert repr(mixed).endswith("key_fit='mse')")  # codebook values have no range to fit
    assert (mixed.keys.fit, mixed.values.fit) == ("mse", "minmax")
    assert Quantize(key_fit="mse", value_fit="mse") == Quantize(fit="mse")
    assert repr(Quantize(key_fit="mse", value_fit="mse")) == repr(Quantize(fit="mse"))
    assert repr(Quantize(key_fit="mse")).endswith("key_fit='mse')")
    assert repr(Quantize(value_fit="mse", key_fit="minmax")).endswith("value_fit='mse', key_fit='minmax')")
    assert Quantize(value_fit="mse") == Quantize(fit="mse")  # the keys' default is "mse" too
    assert Quantize(key_fit="mse") != Quantize(value_fit="mse")


def test_key_fit_fits_the_keys_alone():
    x = torch.randn(1, 2, 200, 64, generator=torch.Generator().manual_seed(8)) * 2
    blocks = {}
    kinds = {"plain": {"fit": "minmax"}, "keys": {"key_fit": "mse"}, "default": {}, "both": {"fit": "mse"}}
    for name, kw in kinds.items():
        cache = CompressedCache(policy="recent", window=8, bits=2, backend="torch", group_size=64, **kw)
        cache.update(x, x, 0)
        cache.memory_report()  # demotion is deferred until something reads the store
        store = cache.layers[0].engine.held.store
        blocks[name] = (store.k.q, store.v.q)
    (pk, pv), (kk, kv), (bk, bv) = blocks["plain"], blocks["keys"], blocks["both"]
    dk, dv = blocks["default"]  # the default: keys fitted, values min-max
    assert torch.equal(dk.codes, kk.codes) and torch.equal(dk.scales, kk.scales) and torch.equal(dv.scales, pv.scales)
    assert torch.equal(kv.codes, pv.codes) and torch.equal(kv.scales, pv.scales)  # values untouched
    assert torch.equal(kk.codes, bk.codes) and torch.equal(kk.scales, bk.scales)  # keys fitted
    assert not torch.equal(kk.scales, pk.scales) and not torch.equal(bv.scales, pv.scales)


def test_auto_backend_serves_fitted_ranges_with_the_cpu_kernel(cpu_kernel):
    assert CompressedCache(policy="log", bits=2, fit="mse").backend.name == "cpu"


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"fit": "lloyd"}, r"fit must be one of \['minmax', 'mse'\]; got fit='lloyd'"),
        (
            {"fit": "mse", "scheme": "codebook", "transform": "hadamard"},
            r"fit='mse' applies to neither role: keys in format 'codebook'",
        ),
        ({"fit": "mse", "value_fit": "minmax"}, r"fit='mse' \(the shorthand for both\) contradicts value_fit='minmax'"),
        (
            {"key_fit": "mse", "key_scheme": "codebook", "transform": "hadamard"},
            r"key_fit='mse' does not apply to keys in format 'codebook'",
        ),
        ({"value_fit": "best"}, r"value_fit='best': MinMax: fit must be one of \['minmax', 'mse'\]"),
    ],
)
def test_bad_fit_parameters_are_refused_naming_them(kw, match):
    with pytest.raises(ConfigError, match=match):
        CompressedCache(policy="log", bits=2, backend="torch", **kw)
