"""The codebook scheme: a per-vector scale and Lloyd-Max indices (``Quantize(scheme="codebook")``)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import fused_and_materialized, saved_cache_continues, teacher_forced_logits, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy import CompressedCache
from kvpolicy.actions.quantize import Quantize
from kvpolicy.backends.base import dense_attention
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.errors import ConfigError, MetadataOverflowError, NonFiniteError
from kvpolicy.formats import codebook
from kvpolicy.transforms import Hadamard

#: Max (1960), "Quantizing for minimum distortion", Table I: the least mean squared error of a
#: 4-, 8- and 16-level quantizer of the standard normal distribution, and the 4-level output levels
PUBLISHED_MSE = {2: 0.1175, 3: 0.03455, 4: 0.009497}
PUBLISHED_2BIT_LEVELS = (0.4528, 1.510)


# ------------------------------------------------------------------ the codebook itself


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_lloyd_max_matches_the_published_optimum(bits):
    levels, edges, mse = codebook.lloyd_max(bits)
    assert mse == pytest.approx(PUBLISHED_MSE[bits], rel=1e-3)
    assert len(levels) == 2**bits and len(edges) == 2**bits - 1
    assert all(a < b for a, b in itertools.pairwise(levels))
    assert levels == pytest.approx([-v for v in reversed(levels)], abs=1e-12)  # symmetric about 0
    # each boundary is the midpoint of its neighbours (the nearest-centroid rule)
    assert edges == pytest.approx([(a + b) / 2 for a, b in itertools.pairwise(levels)], abs=1e-12)


def test_two_bit_levels_match_the_published_table():
    levels, _, _ = codebook.lloyd_max(2)
    assert levels[2:] == pytest.approx(PUBLISHED_2BIT_LEVELS, abs=5e-4)  # the table gives 4 digits


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_scalar_gaussian_samples_reach_the_optimum(bits):
    """Nearest-centroid coding of standard normal samples with the table: the empirical MSE is the
    optimum within sampling error (1 % at a million samples)."""
    x = torch.randn(1_000_000, generator=torch.Generator().manual_seed(bits))
    table = codebook.centroids(bits)
    edges = torch.tensor(codebook.lloyd_max(bits)[1], dtype=torch.float32)
    xh = table[torch.bucketize(x, edges, right=True)]
    assert float(((x - xh) ** 2).mean()) == pytest.approx(codebook.lloyd_max(bits)[2], rel=0.01)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("d", [64, 128])
def test_vector_reconstruction_is_within_5_percent_of_the_lloyd_max_optimum(bits, d):
    """Gaussian vectors through the scheme (normalised, coded, norm-corrected): the mean squared error
    per coordinate is at most 1.05 x the Lloyd-Max optimum (the stored norm can only help)."""
    x = torch.randn(4, 2, 512, d, generator=torch.Generator().manual_seed(d + bits)) * 3.0
    q = TorchBackend().quantize(x, bits, None, "token", scheme="codebook")
    mse = float(((x - TorchBackend().dequantize(q)) ** 2).mean()) / 9.0
    assert mse <= 1.05 * codebook.lloyd_max(bits)[2]


def test_reconstruction_keeps_each_vector_norm():
    """The norm correction: ‖x̂‖ = ‖x‖ up to the float16 rounding of the scale (2**-11 relative)."""
    x = torch.randn(2, 3, 50, 64, generator=torch.Generator().manual_seed(0)) * torch.rand(2, 3, 50, 1) * 10
    xh = TorchBackend().dequantize(TorchBackend().quantize(x, 2, None, "token", scheme="codebook"))
    ratio = xh.norm(dim=-1) / x.norm(dim=-1)
    assert float((ratio - 1).abs().max()) <= 2**-11


def test_zero_vectors_come_back_as_zeros():
    x = torch.randn(1, 2, 6, 64)
    x[0, 1, 3] = 0
    xh = TorchBackend().dequantize(TorchBackend().quantize(x, 3, None, "token", scheme="codebook"))
    assert torch.isfinite(xh).all() and torch.equal(xh[0, 1, 3], torch.zeros(64))


def test_beats_minmax_at_fewer_bytes_on_gaussian_data():
    """2-bit codebook (2.25 bits/el at head_dim 64) has a lower error than 2-bit min-max groups of 64
    (2.5 bits/el) on rotated-like data: the measured reason the scheme exists."""
    x = torch.randn(1, 4, 256, 64, generator=torch.Generator().manual_seed(1))
    be = TorchBackend()
    cb, mm = be.quantize(x, 2, None, "token", scheme="codebook"), be.quantize(x, 2, 64, "token")
    assert sum(cb.nbytes().values()) < sum(mm.nbytes().values())
    assert float(((x - be.dequantize(cb)) ** 2).mean()) < 0.7 * float(((x - be.dequantize(mm)) ** 2).mean())


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_bytes_held_are_the_formula(bits):
    """``n·D·bits/8`` bytes of codes and one 16-bit scale per vector: ``bits + 16 / D`` bits per element."""
    b, h, n, d = 2, 3, 40, 64
    q = TorchBackend().quantize(torch.randn(b, h, n, d), bits, None, "token", scheme="codebook")
    assert q.nbytes() == {"codes": b * h * n * d * bits // 8, "scales": b * h * n * 2}
    assert sum(q.nbytes().values()) * 8 / (b * h * n * d) == bits + 16 / d


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 70), nq=st.integers(1, 4), kbits=st.sampled_from([2, 3, 4]), vbits=st.sampled_from([2, 3, 4]),
       backend=st.sampled_from(["torch", "cpu"]), keys_minmax=st.booleans())  # fmt: skip
def test_attend_from_codes_equals_dense_attention_over_the_reconstruction(n, nq, kbits, vbits, backend, keys_minmax):
    """``Backend.attend`` over codebook blocks (values alone, or keys and values) is softmax attention
    over the dequantized tokens, float32 rounding aside."""
    from kvpolicy import registry

    be = registry.get("backends", backend)()
    g = torch.Generator().manual_seed(n * 7 + nq)
    query = torch.randn(2, 3, nq, 64, generator=g)
    keys, values = torch.randn(2, 3, n, 64, generator=g), torch.randn(2, 3, n, 64, generator=g)
    if keys_minmax:
        whole = n - n % 8  # min-max keys per channel: whole groups of 8 tokens
        if whole == 0:
            return
        keys, values = keys[:, :, :whole], values[:, :, :whole]
        kq = be.quantize(keys, kbits, 8, "channel")
    else:
        kq = be.quantize(keys, kbits, None, "token", scheme="codebook")
    vq = be.quantize(values, vbits, None, "token", scheme="codebook")
    _assert_attend_is_dense_attention(be, query, kq, vq, atol=2e-5)


def _assert_attend_is_dense_attention(be, query, kq, vq, atol):
    """``be.attend`` over the blocks equals softmax attention over their reconstruction (output and
    log-sum-exp) within ``atol``."""
    out, lse = be.attend(query, kq, vq, 0.125)
    want, want_lse = dense_attention(query, be.dequantize(kq), be.dequantize(vq), 0.125)
    torch.testing.assert_close(out, want, rtol=0, atol=atol)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=atol)


def test_blocks_cat_narrow_and_round_trip_through_their_saved_state():
    be = TorchBackend()
    x = torch.randn(2, 2, 30, 64)
    a, b = (
        be.quantize(x[:, :, :12], 3, None, "token", scheme="codebook"),
        be.quantize(x[:, :, 12:], 3, None, "token", scheme="codebook"),
    )
    whole = be.cat([a, b])
    assert torch.equal(be.dequantize(whole), be.dequantize(be.quantize(x, 3, None, "token", scheme="codebook")))
    assert torch.equal(be.dequantize(whole.narrow(5, 11)), be.dequantize(whole)[:, :, 5:16])
    again = be.load_block(be.block_state(whole))
    assert torch.equal(be.dequantize(again), be.dequantize(whole))
    bad = dict(be.block_state(whole), shape=[2, 2, 31, 64])
    with pytest.raises(ValueError, match="codebook block tensors have shapes"):
        be.load_block(bad)


# ------------------------------------------------------------------ in a cache


@pytest.mark.parametrize("value_bits", [2, 3])  # 3: the kvpolicy-4.5bit preset's composition
def test_fused_equals_materialized_with_codebook_values_and_minmax_keys(value_bits, cpu_kernel):
    got, ref, cache = fused_and_materialized(
        transform="hadamard", key_bits=4, value_bits=value_bits, value_scheme="codebook", backend="cpu"
    )
    assert set(cache.attention_paths().values()) == {"fused (cpu)"}
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_fused_equals_materialized_with_codebook_keys_and_values(family, backend, cpu_kernel):
    got, ref, cache = fused_and_materialized(
        family, group_size=None, bits=2, scheme="codebook", transform="hadamard", backend=backend
    )
    assert set(cache.attention_paths().values()) == {f"fused ({backend})"}
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)


def test_cache_bytes_are_codes_scales_and_positions_with_no_staging():
    """A codebook store quantizes every demoted token on arrival: no staging buffer, no zero-points."""
    x = torch.randn(1, 2, 300, 64)
    cache = CompressedCache(
        policy="recent", window=16, bits=3, scheme="codebook", transform="hadamard", backend="torch"
    )
    cache.update(x, x, 0)
    seg = cache.memory_report().segments
    demoted = 300 - 16
    assert seg["codes"] == 2 * (1 * 2 * demoted * 64 * 3 // 8)
    assert seg["scales"] == 2 * (1 * 2 * demoted * 2)
    assert seg["zeros"] == 0 and seg["staging"] == 0


@pytest.mark.parametrize("norm_bits", [16, 8])  # 8: one-byte scales (also tests/test_codebook_norm8.py)
@pytest.mark.parametrize("key_centre", [False, True])
def test_saved_cache_continues_identically(tmp_path, key_centre, norm_bits):
    saved_cache_continues(
        tmp_path, policy="log", window=4, key_bits=3, value_bits=2, scheme="codebook", transform="hadamard",
        key_centre=key_centre, norm_bits=norm_bits,
    )  # fmt: skip


def test_four_bit_codebook_stays_close_to_uncompressed():
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (1, 90), generator=torch.Generator().manual_seed(6))
    ref = teacher_forced_logits(model, ids, 60, CompressedCache(action="none"))
    got = teacher_forced_logits(
        model, ids, 60, CompressedCache(policy="log", window=8, bits=4, scheme="codebook", transform="hadamard")
    )
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    assert float((p.exp() * (p - q)).sum(-1).mean()) < 5e-3


# ------------------------------------------------------------------ the action's parameters


def test_scheme_shorthand_sets_both_kinds_and_equal_actions_compare_equal():
    a = Quantize(bits=2, scheme="codebook")
    assert (a.keys.name, a.values.name) == ("codebook", "codebook")
    # axis and group size do not apply to a codebook kind
    assert a == Quantize(bits=2, key_scheme="codebook", value_scheme="codebook", key_axis="token")
    assert "scheme='codebook'" in repr(a) and "group_size" not in repr(a)
    mixed = Quantize(key_bits=4, value_bits=2, value_scheme="codebook", key_group_size=32)
    assert repr(mixed) == (
        "Quantize(key_bits=4, value_bits=2, key_scheme='minmax', value_scheme='codebook', key_group_size=32, "
        "key_axis='channel', check_finite=True, key_fit='mse')"  # min-max keys are fitted by default
    )
    assert "scheme" not in repr(Quantize(bits=2))  # min-max reprs (and the cell ids built on them) unchanged


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            dict(scheme="trellis"),
            r"scheme must be one of \[.*'codebook'.*'minmax'.*\] or a Format class; got scheme='trellis'",
        ),
        (dict(key_scheme="nf4"), r"key_scheme must be one of"),
        (dict(scheme="codebook", value_scheme="minmax"), r"scheme='codebook' \(the shorthand for both\) contradicts"),
        (dict(scheme="codebook", group_size=32), r"group_size=32 applies to neither role: keys in format 'codebook'"),
        (
            dict(key_scheme="codebook", key_group_size=32),
            r"key_group_size=32 does not apply to keys in format 'codebook'",
        ),
    ],
)
def test_bad_scheme_parameters_are_refused_naming_them(kw, match):
    with pytest.raises(ConfigError, match=match):
        Quantize(**kw)


def test_a_group_size_for_the_minmax_kind_alone_is_accepted():
    q = Quantize(value_scheme="codebook", group_size=32)
    assert q.keys.group_size == 32 and q.values.name == "codebook"


def test_codebook_without_a_rotation_is_refused():
    with pytest.raises(ConfigError, match=r"assumes rotated coordinates.*transform='hadamard'.*transform='none'"):
        CompressedCache(policy="log", bits=2, scheme="codebook")
    with pytest.raises(ConfigError, match=r"for the values"):
        CompressedCache(policy="log", bits=2, value_scheme="codebook")


def test_widths_the_codebook_lacks_are_refused_with_those_it_has():
    with pytest.raises(ConfigError, match=r"'codebook' refuses bits=8: Codebook: bits must be one of \[2, 3, 4\]"):
        CompressedCache(policy="log", bits=8, scheme="codebook", transform="hadamard", backend="torch")


def test_auto_backend_picks_the_cpu_kernel_backend_for_codebook(cpu_kernel):
    cache = CompressedCache(policy="log", bits=2, scheme="codebook", transform="hadamard")
    assert cache.backend.name == "cpu"


def test_head_dim_that_does_not_pack_is_refused():
    cache = CompressedCache(policy="log", window=2, bits=3, scheme="codebook", transform=Hadamard(), backend="torch")
    x = torch.randn(1, 1, 10, 12)
    with pytest.raises(ConfigError, match=r"head_dim"):
        cache.update(x, x, 0)


def test_non_finite_and_overflowing_inputs_raise():
    cache = CompressedCache(policy="recent", window=2, bits=2, scheme="codebook", transform="hadamard", backend="torch")
    x = torch.randn(1, 1, 10, 64)
    x[0, 0, 1, 5] = math.nan
    with pytest.raises(NonFiniteError):  # demotion is settled on the next step
        cache.update(x, x, 0)
        cache.update(x[:, :, :1], x[:, :, :1], 0)
    big = torch.full((1, 1, 10, 64), 1e6)
    cache = CompressedCache(policy="recent", window=2, bits=2, scheme="codebook", transform="hadamard", backend="torch")
    with pytest.raises(MetadataOverflowError, match="meta_dtype='float32'"):
        cache.update(big, big, 0)
        cache.update(big[:, :, :1], big[:, :, :1], 0)
    wide = CompressedCache(
        policy="recent",
        window=2,
        bits=2,
        scheme="codebook",
        transform="hadamard",
        backend="torch",
        meta_dtype="float32",
    )
    wide.update(big, big, 0)
    wide.update(big[:, :, :1], big[:, :, :1], 0)
    assert wide.layers[0].engine.held.store.k.q.scales.dtype == torch.float32


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_float16_vectors_whose_scale_passes_65504_are_refused(bits, backend, cpu_kernel):
    """A float16 vector of equal coordinates near 65504 scales by ``a / c`` (``c`` the centroid nearest 1:
    0.756 at 3 bits, 0.942 at 4), past float16's range: refused, not stored as an infinite scale, by the
    module's function and by both backends; bfloat16 or float32 metadata stores it."""
    from kvpolicy.backends.cpu_backend import CpuBackend

    x = torch.randn(1, 2, 4, 64, generator=torch.Generator().manual_seed(21)).to(torch.float16)
    x[0, 1, 2] = 65504.0
    be = TorchBackend() if backend == "torch" else CpuBackend()
    with pytest.raises(MetadataOverflowError, match=r"^backend 'torch': quantizing finite float16 values .*6\.55e\+04"):
        codebook.quantize(x, bits, torch.float16)
    with pytest.raises(
        MetadataOverflowError, match=rf"^backend '{backend}': .*meta_dtype='float32' or meta_dtype='bfloat16'"
    ):
        be.quantize(x, bits, None, "token", scheme="codebook")
    for meta in ("bfloat16", "float32"):
        q = be.quantize(x, bits, None, "token", scheme="codebook", meta_dtype=meta)
        back = be.dequantize(q).float()
        assert bool(torch.isfinite(q.scales).all()) and float(back[0, 1, 2].min()) > 0.5 * 65504


def test_float16_vectors_whose_scale_fits_are_kept():
    """At 2 bits the centroid nearest 1 is 1.510: the same vector scales to 43,360 and is stored."""
    x = torch.full((1, 1, 2, 64), 65504.0, dtype=torch.float16)
    q = codebook.quantize(x, 2, torch.float16)
    assert bool(torch.isfinite(q.scales).all()) and float(q.scales.float().max()) == pytest.approx(43360, rel=1e-3)


def test_a_float16_centre_that_doubles_the_offset_is_refused():
    """Vectors minus a centre can reach twice float16's range: their scale is checked with float16
    input too."""
    x = torch.full((1, 1, 2, 64), 40000.0, dtype=torch.float16)
    x[..., ::2] = -40000.0
    centre = torch.full((1, 1, 1, 64), -60000.0, dtype=torch.float16)
    with pytest.raises(MetadataOverflowError, match=r"non-finite scales in float16 metadata"):
        codebook.quantize(x, 3, torch.float16, centre=centre)


# ------------------------------------------------------------------ centred blocks (key_centre)


def _offset_vectors(n: int, seed: int = 0) -> torch.Tensor:
    """``(2, 3, n, 64)`` vectors sharing a per-head offset three times their own spread, as keys do."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, n, 64, generator=g) + 3 * torch.randn(2, 3, 1, 64, generator=g)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_a_centre_removes_the_shared_offset_from_the_error(bits):
    """Quantizing ``x − μ`` and adding ``μ`` back: the error is that of the residual, far below that of
    vectors whose offset takes the codebook's cells; ``μ`` is stored rounded to the metadata dtype and
    the reconstruction uses the stored one."""
    be = TorchBackend()
    x = _offset_vectors(200)
    mu = x.mean(2, keepdim=True)
    plain = be.quantize(x, bits, None, "token", scheme="codebook")
    centred = be.quantize(x, bits, None, "token", scheme="codebook", centre=mu)
    assert centred.centre.dtype == torch.float16 and torch.equal(centred.centre, mu.half())
    err = lambda q: float((be.dequantize(q) - x).pow(2).sum() / x.pow(2).sum())  # noqa: E731
    assert err(centred) < 0.5 * err(plain)
    residual = be.quantize(x - centred.centre.float(), bits, None, "token", scheme="codebook")
    torch.testing.assert_close(be.dequantize(centred), be.dequantize(residual) + centred.centre.float(), rtol=0,
                               atol=1e-6)  # fmt: skip


def test_a_centre_counts_as_a_shared_zero_point_in_the_bytes():
    be = TorchBackend()
    x = _offset_vectors(50)
    q = be.quantize(x, 3, None, "token", scheme="codebook", centre=x.mean(2, keepdim=True))
    assert q.nbytes() == {"codes": 2 * 3 * 50 * 64 * 3 // 8, "scales": 2 * 3 * 50 * 2, "zeros": 2 * 3 * 64 * 2}


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 60), nq=st.integers(1, 3), kbits=st.sampled_from([2, 3, 4]), vbits=st.sampled_from([2, 3, 4]),
       backend=st.sampled_from(["torch", "cpu"]), centre_values=st.booleans())  # fmt: skip
def test_attend_over_centred_blocks_equals_dense_attention_over_the_reconstruction(
    n, nq, kbits, vbits, backend, centre_values, cpu_kernel
):
    """A key centre shifts the block's log-sum-exp by ``q · μ``, a value centre its output by ``μ``:
    both backends equal softmax attention over ``μ + s · C[codes]``."""
    from kvpolicy import registry

    be = registry.get("backends", backend)()
    keys, values = _offset_vectors(n, seed=n), _offset_vectors(n, seed=n + 1)
    query = torch.randn(2, 3, nq, 64, generator=torch.Generator().manual_seed(nq))
    kq = be.quantize(keys, kbits, None, "token", scheme="codebook", centre=keys.mean(2, keepdim=True))
    vcentre = values.mean(2, keepdim=True) if centre_values else None
    vq = be.quantize(values, vbits, None, "token", scheme="codebook", centre=vcentre)
    _assert_attend_is_dense_attention(be, query, kq, vq, atol=5e-5)


def test_centred_blocks_cat_narrow_select_and_round_trip_keeping_their_centre():
    be = TorchBackend()
    x = _offset_vectors(30)
    mu = x[:, :, :12].mean(2, keepdim=True)
    a = be.quantize(x[:, :, :12], 3, None, "token", scheme="codebook", centre=mu)
    b = be.quantize(x[:, :, 12:], 3, None, "token", scheme="codebook", centre=a.centre)
    whole = be.cat([a, b])
    assert torch.equal(be.dequantize(whole), be.dequantize(be.quantize(x, 3, None, "token", scheme="codebook",
                                                                        centre=mu)))  # fmt: skip
    assert torch.equal(be.dequantize(whole.narrow(5, 11)), be.dequantize(whole)[:, :, 5:16])
    idx = torch.tensor([7, 2, 20])
    assert torch.equal(be.dequantize(whole.select(idx)), be.dequantize(whole)[:, :, idx])
    assert torch.equal(be.dequantize(whole.map_batch(lambda t: t[1:])), be.dequantize(whole)[1:])
    saved = be.block_state(whole)
    assert saved["layout"] == "codebook-v2"
    assert torch.equal(be.dequantize(be.load_block(saved)), be.dequantize(whole))
    with pytest.raises(ValueError, match="needs a centre of shape"):
        be.load_block({k: v for k, v in saved.items() if k != "centre"})
    other = be.quantize(x[:, :, 12:], 3, None, "token", scheme="codebook", centre=mu + 1)
    with pytest.raises(ValueError, match="different centres"):
        be.cat([a, other])
    with pytest.raises(ValueError, match="different centres"):
        be.cat([a, be.quantize(x[:, :, 12:], 3, None, "token", scheme="codebook")])


def test_a_key_centre_is_the_first_demoted_block_mean_and_is_shared_by_every_later_block():
    cache = CompressedCache(policy="recent", window=4, key_bits=3, value_bits=2, scheme="codebook", key_centre=True,
                            transform="hadamard", backend="torch")  # fmt: skip
    x = _offset_vectors(40)[:1]
    cache.update(x[:, :, :30], x[:, :, :30], 0)
    for t in range(30, 40):
        cache.update(x[:, :, t : t + 1], x[:, :, t : t + 1], 0)
    store = cache.layers[0].engine.held.store  # the action's store behind the rotation
    rotated = cache.transform.forward(x[:, :, :26].float())  # the first demotion: tokens 0..25
    torch.testing.assert_close(store.k.q.centre.float(), rotated.mean(2, keepdim=True), rtol=1e-3, atol=1e-5)
    assert store.v.q.centre is None  # values are not centred
    assert cache.memory_report().segments["zeros"] == 3 * 64 * 2


def test_fused_equals_materialized_with_centred_codebook_keys(cpu_kernel):
    for backend in ("torch", "cpu"):
        got, ref, cache = fused_and_materialized(
            group_size=None, key_bits=3, value_bits=2, scheme="codebook", key_centre=True, transform="hadamard",
            backend=backend,
        )  # fmt: skip
        assert set(cache.attention_paths().values()) == {f"fused ({backend})"}
        torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)


def test_tier_moves_keep_each_tier_centred_on_its_own_mean():
    """Tokens leaving a centred middle tier are re-quantized from their reconstruction into the bottom
    tier, which centres on its own first block."""
    from kvpolicy.actions.tiered import Tiered
    from kvpolicy.policies.log import LogWindow

    middle = Quantize(bits=4, scheme="codebook", key_centre=True)
    bottom = Quantize(key_bits=2, value_bits=2, scheme="codebook", key_centre=True)
    cache = CompressedCache(policy="log", window=4, action=Tiered(tiers=[middle, bottom], keep=[LogWindow(8)]),
                            transform="hadamard", backend="torch")  # fmt: skip
    x = _offset_vectors(120)[:1]
    cache.update(x[:, :, :100], x[:, :, :100], 0)
    for t in range(100, 120):
        cache.update(x[:, :, t : t + 1], x[:, :, t : t + 1], 0)
    cache.layers[0].engine.held.settle()
    store = cache.layers[0].engine.held.store
    tiers = store  # the action's store (the rotation is the layer's basis)
    top, low = tiers.middles[0].inner.k.q, tiers.bottom.k.q
    assert top.centre is not None and low.centre is not None and not torch.equal(top.centre, low.centre)
    engine = cache.layers[0].engine
    held = engine.held.basis.unmap_keys(store.keys(), store.positions).float()  # every demoted key, in store order
    want = x.float()[:, :, store.positions[0].long()]
    assert held.shape[2] == 120 - cache.layers[0].engine.held.keys.shape[2]
    assert float((held - want).pow(2).sum() / want.pow(2).sum()) < 0.1


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(bits=2, key_centre=True), r"key_centre=True does not apply to keys in format 'minmax'"),
        (dict(bits=2, value_scheme="codebook", key_centre=True), r"does not apply to keys in format 'minmax'"),
        (
            dict(bits=2, scheme="codebook", key_centre=1),
            r"refuses bits=2, key_centre=1: Codebook: centre must be a bool",
        ),
    ],
)
def test_bad_key_centre_parameters_are_refused_naming_them(kw, match):
    with pytest.raises(ConfigError, match=match):
        Quantize(**kw)


def test_key_centre_is_part_of_equality_and_repr():
    plain, centred = Quantize(bits=3, scheme="codebook"), Quantize(bits=3, scheme="codebook", key_centre=True)
    assert plain != centred and hash(plain) != hash(centred)
    assert "key_centre" not in repr(plain) and "key_centre=True" in repr(centred)
    assert eval(repr(centred), {"Quantize": Quantize}) == centred


def test_backends_without_centred_blocks_refuse_key_centre():
    class NoCentre(TorchBackend):  # a backend refuses the options of a format it cannot read
        name = "nocentre"

        def check_format(self, fmt, role=""):
            super().check_format(fmt, role)
            if fmt.centre:
                raise ConfigError(f"backend {self.name!r} does not store centred codebook blocks; got {role}s {fmt}")

    with pytest.raises(ConfigError, match=r"backend 'nocentre' does not store centred codebook blocks"):
        Quantize(bits=3, scheme="codebook", key_centre=True).check_backend(NoCentre())


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_fused_equals_materialized_across_moves_between_centred_tiers(backend, cpu_kernel):
    from kvpolicy.actions.tiered import Tiered
    from kvpolicy.policies.log import LogWindow

    tiers = [Quantize(key_bits=3, value_bits=2, scheme="codebook", key_centre=True),
             Quantize(bits=2, scheme="codebook", key_centre=True)]  # fmt: skip
    got, ref, cache = fused_and_materialized(
        group_size=None, action=Tiered(tiers=tiers, keep=[LogWindow(4)]), transform="hadamard", backend=backend
    )
    assert set(cache.attention_paths().values()) == {f"fused ({backend})"}
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)
