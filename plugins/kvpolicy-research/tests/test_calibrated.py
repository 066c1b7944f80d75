"""The ``"calibrated-hadamard"`` transform (kvpolicy_research.calibrated): keys rotated into the queries'
eigenbasis and weighted there, values into their attention-weighted eigenbasis, then the Hadamard."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpolicy_research.calibrated import (
    BASIS_DTYPE,
    CalibratedBasis,
    CalibratedRotation,
    expected_attention,
)
from research_cases import CODEBOOK, Held, composition, teacher_forced_logits, tiny_model, with_nan
from research_cases import ids as _ids
from research_cases import logits as _logits
from research_parts import cpu_kernel, research_parts  # noqa: F401 - fixtures, and the plugin's parts registered

from kvpolicy import CompressedCache
from kvpolicy.actions.quantize import Quantize
from kvpolicy.attention import disable_scores, enable_scores
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.errors import CacheFileError, ConfigError, NonFiniteError
from kvpolicy.testing import check_transform
from kvpolicy.transforms import Hadamard

# ------------------------------------------------------------------ the transform


def test_the_calibrated_rotation_keeps_the_transform_contract():
    """Its forward and inverse are the Hadamard's (the fitted rotations live in the layer's basis), and the
    basis it binds serves the seam: tokens back, fused equals softmax, saved and loaded bit for bit, rows moved."""
    check_transform(
        st.builds(CalibratedRotation, seed=st.integers(0, 2**31), power=st.floats(0, 1), rotate_values=st.booleans())
    )


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [({"power": -0.1}, "power"), ({"power": 2}, "power"), ({"max_ratio": 0.5}, "max_ratio"),
     ({"max_ratio": True}, "max_ratio"), ({"rotate_values": 1}, "rotate_values"), ({"seed": -1}, "seed")],
)  # fmt: skip
def test_bad_parameters_are_refused_naming_them(kwargs, param):
    with pytest.raises(ConfigError, match=param):
        CalibratedRotation(**kwargs)


def test_the_cache_keyword_names_it():
    cache = CompressedCache(transform="calibrated-hadamard", rotate_values=False, **CODEBOOK)
    assert cache.transform == CalibratedRotation(rotate_values=False)
    assert "CalibratedRotation(" in repr(cache)


def _moments(g: torch.Generator, d: int, spread: float) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.randn(2, 3, d, d, generator=g, dtype=torch.float64) * torch.exp(spread * torch.randn(d, generator=g))
    b = torch.randn(2, 3, d, d, generator=g, dtype=torch.float64)
    return a @ a.mT / d, b @ b.mT / d


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), power=st.floats(0, 1), max_ratio=st.floats(1, 1e4), spread=st.floats(0, 3))
def test_key_rotation_is_the_queries_eigenbasis_with_the_formula_weights(seed, power, max_ratio, spread):
    """``U`` diagonalises ``M`` (eigenvalues descending), and ``w = (λ / κ) ** power`` with ``κ`` the keys'
    variance along each eigenvector, divided by the geometric mean and clamped within ``√max_ratio``."""
    g = torch.Generator().manual_seed(seed)
    d = 16
    m, c = _moments(g, d, spread)
    u, w = CalibratedRotation(power=power, max_ratio=max_ratio).key_rotation(m, c)
    assert u.dtype == BASIS_DTYPE and u.shape == (2, 3, d, d) and w.shape == (2, 3, 1, d) and w.dtype == torch.float32
    uf = u.double()
    torch.testing.assert_close(uf.mT @ uf, torch.eye(d, dtype=torch.float64).expand(2, 3, d, d), rtol=0, atol=5e-3)
    diag = uf.mT @ m @ uf  # nearly diagonal, eigenvalues descending
    lam = torch.linalg.eigvalsh(m).flip(-1)
    scale = float(lam.abs().max())
    torch.testing.assert_close(diag.diagonal(dim1=-2, dim2=-1), lam, rtol=0, atol=5e-3 * scale)
    off = diag - torch.diag_embed(diag.diagonal(dim1=-2, dim2=-1))
    assert float(off.abs().max()) <= 5e-3 * scale
    kappa = torch.einsum("...ci,...cd,...di->...i", uf, c, uf)
    want = power * (lam.clamp_min(1e-300).log() - kappa.log())
    half = math.log(max_ratio) / 2
    want = (want - want.mean(-1, keepdim=True)).clamp(-half, half)
    # float16 rounding of U moves κ by about 1e-3 relative
    torch.testing.assert_close(w.squeeze(-2).double().log(), want, rtol=0, atol=5e-3 * max(power, 1e-3) + 1e-5)


def test_power_zero_gives_unit_weights_and_non_finite_moments_are_refused():
    g = torch.Generator().manual_seed(0)
    m, c = _moments(g, 8, 1.0)
    assert torch.equal(CalibratedRotation(power=0).key_rotation(m, c)[1], torch.ones(2, 3, 1, 8))
    m[0, 1, 2, 2] = float("nan")
    with pytest.raises(NonFiniteError, match="not finite"):
        CalibratedRotation().key_rotation(m, c)


def test_expected_attention_is_the_mean_of_exp_scores_over_gaussian_queries():
    """A Monte Carlo mean of ``exp(s q·k)`` over queries drawn with the given mean and covariance, normalised
    over the keys, within sampling error of the closed form."""
    g = torch.Generator().manual_seed(3)
    d, n = 8, 5
    keys = torch.randn(n, d, generator=g, dtype=torch.float64)
    mean = torch.randn(d, generator=g, dtype=torch.float64)
    root = torch.randn(d, d, generator=g, dtype=torch.float64) * 0.5
    cov = root @ root.T
    q = mean + torch.randn(400_000, d, generator=g, dtype=torch.float64) @ root.T
    scale = d**-0.5
    mc = torch.exp(scale * q @ keys.T).mean(0)
    got = expected_attention(keys, mean, cov, scale)
    torch.testing.assert_close(got, mc / mc.sum(), rtol=2e-2, atol=0)
    assert abs(float(got.sum()) - 1) < 1e-12


# ------------------------------------------------------------------ the store


def _store(transform, bits: int = 2) -> Held:
    return Held(transform, Quantize(bits=bits, scheme="codebook", key_centre=True), TorchBackend())


def test_keys_read_along_a_few_directions_keep_less_error_than_under_a_plain_or_diagonal_weighting():
    """Queries that read a random 8-dimensional subspace of 64 channels (not aligned with the channels, so a
    per-channel weighting cannot find it): the calibrated store's score error on fresh queries of the same kind
    is far below the plain rotation's, at the same bytes of codes."""
    g = torch.Generator().manual_seed(0)
    d, n = 64, 256
    basis = torch.linalg.qr(torch.randn(d, d, generator=g))[0]
    reads = torch.full((d,), 0.05)
    reads[:8] = 1.0
    mix = torch.diag(reads) @ basis.T  # a query is z · mix: it reads the first 8 columns of basis
    queries = torch.randn(1, 3, 64, d, generator=g) @ mix
    keys = torch.randn(1, 1, n, d, generator=g)
    values = torch.randn(1, 1, n, d, generator=g)
    pos = torch.arange(n, dtype=torch.int32)[None]
    test_q = torch.randn(1, 1, 512, d, generator=torch.Generator().manual_seed(1)) @ mix
    errors, codes = {}, {}
    from kvpolicy_research.query_weighted import QueryWeighted

    for name, transform in (
        ("plain", Hadamard(0)),
        ("diagonal", QueryWeighted(0)),
        ("calibrated", CalibratedRotation(0)),
    ):
        store = _store(transform)
        store.observe_queries(queries, keys)  # ignored by the plain store
        store.add(keys, values, pos)
        errors[name] = float(((test_q @ (store.keys() - keys).transpose(-1, -2)) ** 2).mean())
        codes[name] = store.nbytes()["codes"]
    assert codes["calibrated"] == codes["plain"]
    assert errors["calibrated"] < 0.5 * errors["plain"], errors
    assert errors["calibrated"] < 0.5 * errors["diagonal"], errors


def test_values_in_their_eigenbasis_keep_less_error_than_under_the_hadamard_alone():
    """Values whose energy lies in a few correlated directions: rotated into their eigenbasis first, every
    coordinate after the Hadamard has the same variance, and the codebook's error falls."""
    g = torch.Generator().manual_seed(4)
    d, n = 64, 512
    mix = torch.randn(d, d, generator=g) * torch.exp(torch.linspace(0, -4, d))[:, None]
    values = (
        torch.randn(1, 1, n, 8, generator=g) @ torch.randn(8, d, generator=g)
        + 0.1 * torch.randn(1, 1, n, d, generator=g) @ mix
    )
    keys = torch.randn(1, 1, n, d, generator=g)
    queries = torch.randn(1, 2, 16, d, generator=g)
    pos = torch.arange(n, dtype=torch.int32)[None]
    errors = {}
    for name, transform in (("plain", CalibratedRotation(rotate_values=False)), ("calibrated", CalibratedRotation())):
        store = _store(transform)
        store.observe_queries(queries, keys)
        store.add(keys, values, pos)
        errors[name] = float((store.values() - values).pow(2).mean())
    assert errors["calibrated"] < 0.8 * errors["plain"], errors


def test_a_first_demotion_without_queries_is_refused_naming_the_remedy():
    store = _store(CalibratedRotation())
    x = torch.randn(1, 1, 4, 64)
    with pytest.raises(RuntimeError, match=r"enable_scores\(model\)"):
        store.add(x, x, torch.arange(4, dtype=torch.int32)[None])


def test_beam_reorder_moves_each_rows_rotation():
    store = _store(CalibratedRotation())
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(3, 1, 8, 64, generator=g) * torch.linspace(0.1, 3, 64)
    store.observe_queries(torch.randn(3, 2, 5, 64, generator=g) * torch.rand(3, 1, 1, 64, generator=g), keys)
    store.add(keys, keys, torch.arange(8, dtype=torch.int32)[None])
    basis = store.basis
    before = [t.clone() for t in (basis.key_basis, basis.key_weights, basis.value_basis)]
    order = torch.tensor([2, 0, 1])
    store.map_batch(lambda t: t.index_select(0, order))
    for got, old in zip((basis.key_basis, basis.key_weights, basis.value_basis), before, strict=True):
        assert torch.equal(got, old[order])
    assert not torch.equal(before[0][0], before[0][1])


# ------------------------------------------------------------------ in a cache


def test_a_model_whose_attention_is_not_wrapped_is_refused_naming_the_remedy():
    model = tiny_model("llama")
    with pytest.raises(RuntimeError, match=r"enable_scores\(model\)"):
        teacher_forced_logits(model, _ids(), 38, CompressedCache(transform="calibrated-hadamard", **CODEBOOK))


@pytest.mark.parametrize(
    ("name", "rotate_values"), [("codebook", True), ("minmax-staged", True), ("tiered", True), ("tiered", False)]
)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.usefixtures("cpu_kernel")
def test_fused_equals_materialized(name, family, backend, rotate_values):
    """Across group flushes with staging non-empty (minmax: group 16) and tier moves, GQA, batch 2."""
    model = tiny_model(family)
    ids = _ids()
    kw = {**composition(name), "transform": CalibratedRotation(rotate_values=rotate_values), "backend": backend}
    ref, _ = _logits(model, "scores", ids, 38, **kw)
    got, cache = _logits(model, "fused", ids, 38, **kw)
    assert set(cache.attention_paths().values()) == {f"fused ({backend})"}
    basis = cache.layers[0].engine.held.basis
    heads = model.config.num_key_value_heads
    assert isinstance(basis, CalibratedBasis) and basis.key_basis.shape == (2, heads, 64, 64)
    assert (basis.value_basis is not None) == rotate_values
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)


@pytest.mark.parametrize("rotate_values", [True, False])
def test_bytes_held_are_the_hadamard_caches_plus_the_rotations(rotate_values):
    """Everything the basis holds is counted: per layer, row and KV head, one or two float16 matrices and the
    float32 weights, under ``scales``; codes and the rest as the Hadamard cache's."""
    model = tiny_model("llama")
    ids = _ids()
    _, plain = _logits(model, "fused", ids, 38, transform="hadamard", **CODEBOOK)
    _, cal = _logits(model, "fused", ids, 38, transform=CalibratedRotation(rotate_values=rotate_values), **CODEBOOK)
    a, b = dict(plain.memory_report().segments), dict(cal.memory_report().segments)
    layers, batch, heads, d = 2, 2, 2, 64
    matrices = 2 if rotate_values else 1
    assert b.pop("scales") - a.pop("scales") == layers * batch * heads * (matrices * d * d * 2 + d * 4)
    assert a == b


def test_the_estimate_counts_the_rotations():
    from kvpolicy.tiny import random_model
    from kvpolicy_lab.estimation import estimate

    config = random_model("llama").config
    plain = dict(estimate(config, 300, CompressedCache(transform="hadamard", **CODEBOOK)).report.segments)
    cal = dict(estimate(config, 300, CompressedCache(transform="calibrated-hadamard", **CODEBOOK)).report.segments)
    heads, d = config.num_key_value_heads, config.head_dim
    assert cal.pop("scales") - plain.pop("scales") == config.num_hidden_layers * heads * (2 * d * d * 2 + d * 4)
    assert cal == plain


def test_each_padded_row_fits_the_rotation_it_would_alone():
    model = tiny_model("llama")
    ids = _ids(40)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    enable_scores(model)
    try:
        cache = CompressedCache(transform="calibrated-hadamard", **CODEBOOK)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=4, do_sample=False)
        alone = CompressedCache(transform="calibrated-hadamard", **CODEBOOK)
        with torch.no_grad():
            model.generate(input_ids=ids[1:, 5:], cache=alone, max_new_tokens=4, do_sample=False)
    finally:
        disable_scores(model)
    rows = [row.held.basis for row in cache.layers[0].engine.rows]
    assert not torch.equal(rows[0].key_basis, rows[1].key_basis)
    want = alone.layers[0].engine.held.basis
    torch.testing.assert_close(rows[1].key_weights, want.key_weights, rtol=1e-3, atol=1e-4)
    # the bases agree up to float16 rounding, wherever the eigenvalues are apart
    torch.testing.assert_close(
        (rows[1].key_basis.float().mT @ want.key_basis.float()).diagonal(dim1=-2, dim2=-1).abs().mean(-1),
        torch.ones(1, 2), rtol=0, atol=0.05,
    )  # fmt: skip


@pytest.mark.parametrize("prefill", [30, 6], ids=["fitted", "awaiting-the-fit"])
def test_a_saved_cache_loads_and_continues_bit_for_bit(tmp_path, prefill):
    """Saved after the fit, or before any demotion (the moments gathered so far travel with the file)."""
    model = tiny_model("llama")
    ids = _ids(40)
    enable_scores(model)
    try:
        cache = CompressedCache(transform="calibrated-hadamard", **{**CODEBOOK, "window": 4})
        with torch.no_grad():
            model(ids[:, :prefill], cache=cache, use_cache=True)
        path = tmp_path / "c.kvc"
        cache.save(path, model=model)
        loaded = CompressedCache.load(path, model=model)
        basis = loaded.layers[0].engine.held.basis
        assert (basis.key_basis is None) == (prefill == 6)
        assert (basis.query_count == 0) == (prefill == 30)
        want = teacher_forced_logits(model, ids[:, prefill:], 1, copy.deepcopy(cache))
        assert torch.equal(teacher_forced_logits(model, ids[:, prefill:], 1, loaded), want)
    finally:
        disable_scores(model)


def _not_orthogonal(s):
    s["key_basis"] = (s["key_basis"].float() * 1.2).to(BASIS_DTYPE)


@pytest.mark.parametrize(
    ("transform", "edit", "match"),
    [
        (CalibratedRotation(), lambda s: s.update(key_weights=-s["key_weights"]), "finite and positive"),
        (CalibratedRotation(), lambda s: s.update(key_weights=s["key_weights"] * 1e3), "beyond sqrt"),
        (CalibratedRotation(), _not_orthogonal, "orthogonal"),
        (CalibratedRotation(), lambda s: s.update(key_basis=s["key_basis"].float()), "key_basis"),
        (CalibratedRotation(), lambda s: s.update(key_basis=torch.cat([s["key_basis"]] * 2)), "key_basis"),
        (CalibratedRotation(), lambda s: s.update(value_basis=None), "value basis"),
        (CalibratedRotation(rotate_values=False), lambda s: s.update(value_basis=s["key_basis"]), "value basis"),
        (CalibratedRotation(), lambda s: s.update(query_count=3), "moments"),
        (CalibratedRotation(), lambda s: s.pop("key_moment"), "lacks"),
    ],
    ids=["negative", "huge", "not-orthogonal", "float32", "short", "no-values", "values-not-fitted",
         "count-without-moments", "missing"],
)  # fmt: skip
def test_a_corrupt_saved_state_is_refused(transform, edit, match):
    keys = torch.randn(1, 1, 8, 64, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 3, 64)
    store = _store(CalibratedRotation())
    store.observe_queries(torch.randn(1, 2, 3, 64) * torch.linspace(3, 0.1, 64), keys)
    store.add(keys, keys, torch.arange(8, dtype=torch.int32)[None])
    state = store.state_dict()
    edit(state)
    fresh = _store(transform)
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(state)
        fresh.validate(keys, keys)


def test_a_corrupt_file_is_refused_with_a_cache_file_error(tmp_path):
    model = tiny_model("llama")
    enable_scores(model)
    try:
        cache = CompressedCache(transform="calibrated-hadamard", rotate_values=False, **CODEBOOK)
        with torch.no_grad():
            model(_ids(30), cache=cache, use_cache=True)
    finally:
        disable_scores(model)
    path = tmp_path / "c.kvc"
    cache.save(path, model=model)
    # the key weights (batch, kv_heads, 1, head_dim) of both layers
    bad = with_nan(path, tmp_path / "bad.kvc", (2, 2, 1, 64), count=2)
    with pytest.raises(CacheFileError):
        CompressedCache.load(bad, model=model)


def test_the_example_preset_file_is_kvpolicy_3bit_with_the_calibrated_rotation():
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "kvpolicy-3bit-cal.toml"
    cache = CompressedCache.from_config(path)
    assert cache.transform == CalibratedRotation()
    assert repr(cache) == repr(CompressedCache.from_preset("kvpolicy-3bit", transform="calibrated-hadamard"))
