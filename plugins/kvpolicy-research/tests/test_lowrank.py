"""The ``"lowrank"`` transform (kvpolicy_research.lowrank): each KV head's principal key directions held
beside the codes as coefficients, the residual rotated and quantized."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpolicy_research.lowrank import GROW, LowRank, LowRankBasis
from research_cases import CODEBOOK, Held, composition, teacher_forced_logits, tiny_model, with_nan
from research_cases import ids as _ids
from research_cases import logits as _logits
from research_parts import cpu_kernel, research_parts  # noqa: F401 - fixtures, and the plugin's parts registered

from kvpolicy import CompressedCache
from kvpolicy.actions.quantize import Quantize
from kvpolicy.attention import disable_scores, enable_scores
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.errors import CacheFileError, ConfigError, NonFiniteError
from kvpolicy.fused import disable_fused, enable_fused
from kvpolicy.testing import check_transform
from kvpolicy.transforms import Hadamard


def _store(transform: LowRank, bits: int = 2, backend=None, rows: int = 1) -> Held:
    return Held(transform, Quantize(bits=bits, scheme="codebook", key_centre=True), backend or TorchBackend(), rows)


def _low_rank_keys(b: int, h: int, n: int, d: int, r: int, seed: int) -> torch.Tensor:
    """Keys ``μ + c Uᵀ`` in an ``r``-dimensional affine subspace of ``d`` channels."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(b, h, d, r, generator=g))
    c = torch.randn(b, h, n, r, generator=g) * torch.linspace(4, 1, r)
    return torch.randn(b, h, 1, d, generator=g) + c @ u.transpose(-1, -2)


# ------------------------------------------------------------------ the transform


def test_lowrank_keeps_the_transform_contract():
    """Its forward and inverse are the rotation's (the basis and coefficients live in the store)."""
    check_transform(st.builds(LowRank, seed=st.integers(0, 2**31), rank=st.integers(1, 8)))


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [({"rank": 0}, "rank"), ({"rank": True}, "rank"), ({"rank": 2.0}, "rank"),
     ({"coefficient_bits": 4}, "coefficient_bits"), ({"coefficient_bits": True}, "coefficient_bits"),
     ({"seed": -1}, "seed")],
)  # fmt: skip
def test_bad_parameters_are_refused_naming_them(kwargs, param):
    with pytest.raises(ConfigError, match=param):
        LowRank(**kwargs)


def test_a_rank_larger_than_the_head_dim_is_refused_naming_both_at_the_first_update():
    model = tiny_model("llama")  # head_dim 64
    with pytest.raises(ConfigError, match=r"rank=65 is larger than the keys' head_dim=64; rank must be in \[1, 64\]"):
        teacher_forced_logits(model, _ids(), 38, CompressedCache(transform="lowrank", rank=65, **CODEBOOK))


def test_the_cache_keyword_names_it_and_takes_its_parameters():
    cache = CompressedCache(transform="lowrank", rank=4, coefficient_bits=16, **CODEBOOK)
    assert cache.transform == LowRank(rank=4, coefficient_bits=16)
    assert "rank=4" in repr(cache) and "coefficient_bits=16" in repr(cache)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), d=st.sampled_from([16, 64]), r=st.integers(1, 8), n=st.integers(9, 40))
def test_a_rank_r_input_is_reconstructed_up_to_the_coefficients_rounding(seed, d, r, n):
    """Keys in an ``r``-dimensional affine subspace: the residual is zero, so the 2-bit codes add nothing and
    the keys come back as exactly as their 16-bit coefficients hold them."""
    keys = _low_rank_keys(2, 3, n, d, r, seed)
    store = _store(LowRank(rank=r, coefficient_bits=16))
    store.add(keys, keys, torch.arange(n, dtype=torch.int32)[None])
    scale = float(keys.abs().max())
    err = float((store.keys() - keys).abs().max())
    assert err <= 2e-3 * scale, (err, scale)  # float16 coefficients: a relative 2⁻¹¹ each, r of them
    plain = _store(Hadamard())  # the rotation alone
    plain.add(keys, keys, torch.arange(n, dtype=torch.int32)[None])
    assert float((plain.keys() - keys).abs().max()) > 10 * err  # 2-bit codes of the whole key lose far more


def test_rank_equal_to_the_head_dim_holds_everything_in_the_coefficients():
    keys = torch.randn(1, 2, 20, 16, generator=torch.Generator().manual_seed(3))
    store = _store(LowRank(rank=16, coefficient_bits=16))
    store.add(keys, keys, torch.arange(20, dtype=torch.int32)[None])
    torch.testing.assert_close(store.keys(), keys, rtol=0, atol=2e-3 * float(keys.abs().max()))


def test_the_fit_is_the_mean_and_the_leading_eigenvectors():
    g = torch.Generator().manual_seed(4)
    keys = torch.randn(2, 3, 50, 16, generator=g) * torch.linspace(5, 0.1, 16) + 2
    centre, u = LowRank(rank=3).fit(keys)
    torch.testing.assert_close(centre, keys.mean(2, keepdim=True), rtol=0, atol=1e-5)
    torch.testing.assert_close(u.transpose(-1, -2) @ u, torch.eye(3).expand(2, 3, 3, 3), rtol=0, atol=1e-5)
    xc = (keys - centre).double()
    variance = ((xc @ u.double()) ** 2).sum(2)  # (2, 3, rank): largest first
    assert bool((variance.diff(dim=-1) <= 1e-6).all())
    top = torch.linalg.eigvalsh(xc.transpose(-1, -2) @ xc)[..., -3:].flip(-1)
    torch.testing.assert_close(variance, top, rtol=1e-6, atol=1e-6)


def test_non_finite_keys_are_refused_at_the_fit():
    keys = torch.randn(1, 1, 8, 16)
    keys[0, 0, 3, 2] = float("nan")
    with pytest.raises(NonFiniteError, match="not finite"):
        LowRank(rank=2).fit(keys)


def test_coefficients_round_trip_within_half_a_step():
    c = torch.randn(2, 3, 40, 8) * torch.logspace(-3, 3, 40)[:, None]
    codes, scales = LowRank().encode(c)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float16 and scales.shape == (2, 3, 40, 1)
    step = scales.float()
    assert bool(((LowRank.decode(codes, scales) - c).abs() <= step * 0.5 + step * 2e-3).all())
    zero, zero_scale = LowRank().encode(torch.zeros(1, 1, 2, 8))
    assert not bool(zero.any()) and not bool(zero_scale.any())


# ------------------------------------------------------------------ the store


def test_low_rank_keys_keep_less_error_than_the_rotation_alone_at_the_same_codes():
    """Keys whose variance lies mostly in 4 directions: the residual's codes have less to cover."""
    g = torch.Generator().manual_seed(5)
    keys = _low_rank_keys(1, 2, 200, 64, 4, 6) + 0.05 * torch.randn(1, 2, 200, 64, generator=g)
    pos = torch.arange(200, dtype=torch.int32)[None]
    low, plain = _store(LowRank(rank=4)), _store(Hadamard())
    low.add(keys, keys, pos)
    plain.add(keys, keys, pos)
    assert float((low.keys() - keys).pow(2).mean()) < 0.1 * float((plain.keys() - keys).pow(2).mean())


def test_the_coefficient_table_grows_by_whole_steps_and_holds_rows_by_position():
    store = _store(LowRank(rank=2))
    keys = _low_rank_keys(1, 2, 70, 16, 2, 7)
    store.add(keys[:, :, :30], keys[:, :, :30], torch.arange(5, 35, dtype=torch.int32)[None])
    assert store.basis.coefficients.shape == (1, 2, 2, GROW)
    assert not bool(store.basis.coefficients[..., :5].any())  # positions never demoted hold zeros
    store.add(keys[:, :, 30:], keys[:, :, 30:], torch.arange(35, 75, dtype=torch.int32)[None])
    assert store.basis.coefficients.shape == (1, 2, 2, 2 * GROW)
    want = (keys.float() - store.basis.centre) @ store.basis.directions
    got = store.basis.coefficients_at(torch.arange(5, 75, dtype=torch.int32)[None])
    torch.testing.assert_close(got, want, rtol=0, atol=float(store.basis.coefficient_scales.float().max()))


def test_beam_reorder_moves_each_rows_fit_and_coefficients():
    store = _store(LowRank(rank=3))
    keys = torch.randn(3, 1, 12, 16, generator=torch.Generator().manual_seed(8))
    store.add(keys, keys, torch.arange(12, dtype=torch.int32)[None])
    before = {
        k: getattr(store.basis, k).clone() for k in ("centre", "directions", "coefficients", "coefficient_scales")
    }
    order = torch.tensor([2, 0, 1])
    materialised = store.keys()[order]
    store.map_batch(lambda t: t.index_select(0, order))
    for name, t in before.items():
        assert torch.equal(getattr(store.basis, name), t[order]), name
    assert torch.equal(store.keys(), materialised)


# ------------------------------------------------------------------ in a cache


@pytest.mark.parametrize("name", ["codebook", "minmax-staged", "tiered"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.usefixtures("cpu_kernel")
def test_fused_equals_materialized(name, family, backend):
    """Across group flushes with staging non-empty (minmax: group 16) and tier moves, GQA, batch 2."""
    model = tiny_model(family)
    ids = _ids()
    chosen = composition(name)
    kw = {**chosen, "transform": "lowrank", "rank": 4, "backend": backend}
    ref, _ = _logits(model, "scores", ids, 38, **kw)
    got, cache = _logits(model, "fused", ids, 38, **kw)
    assert set(cache.attention_paths().values()) == {f"fused ({backend})"}
    basis = cache.layers[0].engine.held.basis
    heads = model.config.num_key_value_heads
    assert isinstance(basis, LowRankBasis) and basis.directions.shape == (2, heads, 64, 4)
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)


@dataclass(frozen=True)
class _Recording(LowRank):
    """A low-rank transform that records the number of tokens of each fit."""

    def fit(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        FITS.append(keys.shape[2])
        return super().fit(keys)


FITS: list[int] = []


@pytest.mark.parametrize("per_layer_prompt", [True, False], ids=["fused", "scores"])
def test_the_first_demotion_is_fitted_whole_though_it_is_demoted_in_chunks(per_layer_prompt):
    """A prompt longer than a demotion chunk: the basis is fitted once per layer, on every token the prompt
    demoted (a probe fed the whole demotion, then adopted), not on the first chunk."""
    from kvpolicy.layer.held import DEMOTE_CHUNK

    model = tiny_model("llama")
    ids = _ids(DEMOTE_CHUNK + 200, batch=1)
    enable, disable = (enable_fused, disable_fused) if per_layer_prompt else (enable_scores, disable_scores)
    FITS.clear()
    enable(model)
    try:
        cache = CompressedCache(transform=_Recording(rank=4), **CODEBOOK)
        with torch.no_grad():
            out = model(ids, cache=cache, use_cache=True)
            model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
    finally:
        disable(model)
    held = len(cache.layers[0].engine.held.store)
    assert held > DEMOTE_CHUNK
    assert len(FITS) == model.config.num_hidden_layers  # one fit per layer (a probe's, adopted, or the store's)
    assert all(DEMOTE_CHUNK < n <= held for n in FITS), (FITS, held)


def test_bytes_held_are_the_hadamard_caches_plus_the_table_and_the_fit():
    model = tiny_model("llama")
    ids = _ids()
    _, plain = _logits(model, "fused", ids, 38, transform="hadamard", **CODEBOOK)
    _, low = _logits(model, "fused", ids, 38, transform="lowrank", rank=4, **CODEBOOK)
    a, b = dict(plain.memory_report().segments), dict(low.memory_report().segments)
    layers, batch, heads, d, r = 2, 2, 2, 64, 4
    table = GROW  # the largest demoted position of 75 tokens is below 64
    assert b.pop("codes") - a.pop("codes") == layers * batch * heads * table * r
    fit = batch * heads * (d + d * r) * 4
    assert b.pop("scales") - a.pop("scales") == layers * (batch * heads * table * 2 + fit)
    assert a == b


def test_the_estimate_counts_the_table_and_the_fit():
    from kvpolicy.tiny import random_model
    from kvpolicy_lab.estimation import estimate

    config = random_model("llama").config
    plain = dict(estimate(config, 300, CompressedCache(transform="hadamard", **CODEBOOK)).report.segments)
    low = dict(estimate(config, 300, CompressedCache(transform="lowrank", rank=4, **CODEBOOK)).report.segments)
    heads, d, layers = config.num_key_value_heads, config.head_dim, config.num_hidden_layers
    table = -(-300 // GROW) * GROW
    assert low.pop("codes") - plain.pop("codes") == layers * heads * table * 4
    assert low.pop("scales") - plain.pop("scales") == layers * heads * (table * 2 + (d + d * 4) * 4)
    assert low == plain


def test_each_padded_row_fits_the_basis_it_would_alone():
    model = tiny_model("llama")
    ids = _ids(40)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    enable_fused(model)
    try:
        cache = CompressedCache(transform="lowrank", rank=4, **CODEBOOK)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=4, do_sample=False)
        alone = CompressedCache(transform="lowrank", rank=4, **CODEBOOK)
        with torch.no_grad():
            model.generate(input_ids=ids[1:, 5:], cache=alone, max_new_tokens=4, do_sample=False)
    finally:
        disable_fused(model)
    row, single = Held.of(cache.layers[0].engine.rows[1]), Held.of(alone.layers[0].engine)
    torch.testing.assert_close(row.basis.centre, single.basis.centre, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(row.keys(), single.keys(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prefill", [30, 6], ids=["fitted", "awaiting-the-fit"])
def test_a_saved_cache_loads_and_continues_bit_for_bit(tmp_path, prefill):
    model = tiny_model("llama")
    ids = _ids(40)
    enable_fused(model)
    try:
        cache = CompressedCache(transform="lowrank", rank=4, **{**CODEBOOK, "window": 4})
        with torch.no_grad():
            model(ids[:, :prefill], cache=cache, use_cache=True)
        path = tmp_path / "c.kvc"
        cache.save(path, model=model)  # applies the demotions pending
        loaded = CompressedCache.load(path, model=model)
        assert (loaded.layers[0].engine.held.basis.directions is None) == (prefill == 6)
        want = teacher_forced_logits(model, ids[:, prefill:], 1, copy.deepcopy(cache))
        assert torch.equal(teacher_forced_logits(model, ids[:, prefill:], 1, loaded), want)
    finally:
        disable_fused(model)


def _fitted_state() -> tuple[dict, torch.Tensor]:
    store = _store(LowRank(rank=2))
    keys = torch.randn(1, 1, 8, 16, generator=torch.Generator().manual_seed(10))
    store.add(keys, keys, torch.arange(8, dtype=torch.int32)[None])
    return store.state_dict(), keys


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: s.update(directions=s["directions"] * 2), "orthonormal"),
        (lambda s: s.update(directions=s["directions"][..., :1]), "rank 1"),
        (
            lambda s: s.update(
                coefficients=s["coefficients"][..., :4], coefficient_scales=s["coefficient_scales"][..., :4]
            ),
            "position 7 held, coefficients for 4 positions",
        ),
        (lambda s: s.update(coefficient_scales=s["coefficient_scales"][..., :4]), "coefficient scales"),
        (lambda s: s.update(coefficient_scales=-s["coefficient_scales"]), "negative"),
        (lambda s: s.update(coefficient_scales=None), "scales missing"),
        (lambda s: s.update(centre=None), "together"),
        (lambda s: s.update(coefficients=s["coefficients"].float()), "int8"),
        (lambda s: s.pop("directions"), "lacks"),
    ],
    ids=[
        "not-orthonormal",
        "rank",
        "short-table",
        "short-scales",
        "negative-scales",
        "no-scales",
        "no-centre",
        "dtype",
        "missing",
    ],
)
def test_a_corrupt_saved_state_is_refused(edit, match):
    state, keys = _fitted_state()
    edit(state)
    fresh = _store(LowRank(rank=2))
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(state)
        fresh.validate(keys, keys)


def test_a_corrupt_file_is_refused_with_a_cache_file_error(tmp_path):
    model = tiny_model("llama")
    cache = CompressedCache(transform="lowrank", rank=4, **CODEBOOK)
    with torch.no_grad():
        model(_ids(30), cache=cache, use_cache=True)
    path = tmp_path / "c.kvc"
    cache.save(path, model=model)
    # the directions (batch, kv_heads, head_dim, rank) of both layers
    bad = with_nan(path, tmp_path / "bad.kvc", (2, 2, 64, 4), count=2)
    with pytest.raises(CacheFileError):
        CompressedCache.load(bad, model=model)


def test_the_example_preset_file_is_kvpolicy_3bit_with_the_low_rank_part():
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "kvpolicy-3bit-lowrank.toml"
    cache = CompressedCache.from_config(path)
    assert cache.transform == LowRank(rank=8)
    assert repr(cache) == repr(CompressedCache.from_preset("kvpolicy-3bit", transform="lowrank"))


def test_per_head_positions_find_each_heads_own_coefficients():
    """A per-head policy demotes other positions in each KV head (positions ``(kv_heads, n)``): each head's
    coefficients are put and found at its own positions, and the fused parts agree with the materialised keys."""
    from kvpolicy.backends.base import dense_attention

    store = _store(LowRank(rank=16, coefficient_bits=16), rows=2)
    keys = torch.randn(2, 2, 12, 16, generator=torch.Generator().manual_seed(12))
    positions = torch.stack([torch.arange(0, 24, 2), torch.arange(40, 52)]).to(torch.int32)  # (kv_heads, n)
    store.add(keys, keys, positions)
    assert store.basis.coefficients.shape[-1] == GROW and bool(store.basis.coefficients[:, 1, :, 40:52].any())
    assert not bool(store.basis.coefficients[:, 0, :, 40:52].any()) and not bool(
        store.basis.coefficients[:, 1, :, :24].any()
    )
    torch.testing.assert_close(store.keys(), keys, rtol=0, atol=2e-3 * float(keys.abs().max()))
    q = torch.randn(2, 2, 1, 16, generator=torch.Generator().manual_seed(13))
    want, _ = dense_attention(q, store.keys(), store.values(), 0.25)
    got = store.attend(q, 0.25)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
