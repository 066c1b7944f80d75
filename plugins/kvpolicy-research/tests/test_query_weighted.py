"""The ``"query-hadamard"`` transform (kvpolicy_research.query_weighted): keys weighted per channel by the
queries the attention wrapper reports, then rotated."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpolicy_research.query_weighted import QueryWeighted, QueryWeightedBasis
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


def test_query_weighted_keeps_the_transform_contract():
    """Its forward and inverse are the rotation's (the weights live in the store)."""
    check_transform(st.builds(QueryWeighted, seed=st.integers(0, 2**31), power=st.floats(0, 1)))


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [({"power": -0.1}, "power"), ({"power": 1.5}, "power"), ({"power": True}, "power"),
     ({"max_ratio": 0.5}, "max_ratio"), ({"max_ratio": "8"}, "max_ratio"), ({"seed": -1}, "seed")],
)  # fmt: skip
def test_bad_parameters_are_refused_naming_them(kwargs, param):
    with pytest.raises(ConfigError, match=param):
        QueryWeighted(**kwargs)


def test_the_cache_keyword_names_it_and_a_bad_one_lists_the_transforms():
    assert isinstance(CompressedCache(transform="query-hadamard", **CODEBOOK).transform, QueryWeighted)
    with pytest.raises(ConfigError, match="query-hadamard"):
        CompressedCache(transform="query-hadamrd", **CODEBOOK)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    power=st.floats(0, 1),
    max_ratio=st.floats(1, 1e4),
    spread=st.floats(0, 8),
)
def test_fitted_weights_are_the_formula_normalised_and_bounded(seed, power, max_ratio, spread):
    """``w = (m / κ) ** power`` divided by its geometric mean, each within ``√max_ratio`` of it; ordered as
    ``m / κ`` is."""
    g = torch.Generator().manual_seed(seed)
    d, count = 16, 7
    query_sq = torch.exp(spread * torch.randn(2, 3, d, generator=g)) * count
    key_var = torch.exp(spread * torch.randn(2, 3, d, generator=g))
    w = QueryWeighted(power=power, max_ratio=max_ratio).fit(query_sq, count, key_var)
    assert w.shape == (2, 3, 1, d) and w.dtype == torch.float32 and bool((w > 0).all())
    log_w = w.log().squeeze(2).double()
    half = math.log(max_ratio) / 2
    assert float(log_w.abs().max()) <= half + 1e-5
    ratio = (query_sq / count / key_var).double()
    want = power * ratio.log()
    want = (want - want.mean(-1, keepdim=True)).clamp(-half, half)
    torch.testing.assert_close(log_w, want, rtol=0, atol=1e-4)
    order = ratio.argsort(-1)
    assert bool((log_w.gather(-1, order).diff(dim=-1) >= -1e-5).all())


def test_power_zero_gives_unit_weights_and_non_finite_moments_are_refused():
    qw = QueryWeighted(power=0)
    assert torch.equal(qw.fit(torch.rand(1, 2, 8) + 1, 3, torch.rand(1, 2, 8) + 1), torch.ones(1, 2, 1, 8))
    bad = torch.ones(1, 2, 8)
    bad[0, 1, 3] = float("nan")
    with pytest.raises(NonFiniteError, match="not finite"):
        QueryWeighted().fit(bad, 3, torch.ones(1, 2, 8))


# ------------------------------------------------------------------ the store


def _store(transform, bits: int = 2) -> Held:
    return Held(transform, Quantize(bits=bits, scheme="codebook", key_centre=True), TorchBackend())


def test_keys_read_by_the_queries_keep_less_error_than_under_a_plain_rotation():
    """Queries that read 8 of 64 channels: the query-weighted store's score error on fresh queries of the same
    kind is far below the plain rotation's, at the same bytes of codes."""
    g = torch.Generator().manual_seed(0)
    d, n = 64, 256
    reads = torch.zeros(d)
    reads[:8] = 1.0
    queries = torch.randn(1, 3, 64, d, generator=g) * (reads + 0.05)
    keys = torch.randn(1, 1, n, d, generator=g)
    values = torch.randn(1, 1, n, d, generator=g)
    pos = torch.arange(n, dtype=torch.int32)[None]
    errors, codes = {}, {}
    for name, transform in (("plain", Hadamard(0)), ("query", QueryWeighted(0))):
        store = _store(transform)
        store.observe_queries(queries, keys)  # ignored by the plain store
        store.add(keys, values, pos)
        test_q = torch.randn(1, 1, 512, d, generator=torch.Generator().manual_seed(1)) * (reads + 0.05)
        errors[name] = float(((test_q @ (store.keys() - keys).transpose(-1, -2)) ** 2).mean())
        codes[name] = store.nbytes()["codes"]
    assert codes["query"] == codes["plain"]
    assert errors["query"] < 0.5 * errors["plain"], errors


def test_a_first_demotion_without_queries_is_refused_naming_the_remedy():
    store = _store(QueryWeighted())
    x = torch.randn(1, 1, 4, 64)
    with pytest.raises(RuntimeError, match=r"enable_scores\(model\)"):
        store.add(x, x, torch.arange(4, dtype=torch.int32)[None])


def test_beam_reorder_moves_each_rows_weights():
    store = _store(QueryWeighted())
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(3, 1, 8, 64, generator=g) * torch.linspace(0.1, 3, 64)
    store.observe_queries(torch.randn(3, 2, 5, 64, generator=g) * torch.rand(3, 1, 1, 64, generator=g), keys)
    store.add(keys, keys, torch.arange(8, dtype=torch.int32)[None])
    before = store.basis.weights.clone()
    order = torch.tensor([2, 0, 1])
    store.map_batch(lambda t: t.index_select(0, order))
    assert torch.equal(store.basis.weights, before[order])
    assert not torch.equal(before[0], before[1])


# ------------------------------------------------------------------ in a cache


def test_a_model_whose_attention_is_not_wrapped_is_refused_naming_the_remedy():
    model = tiny_model("llama")
    with pytest.raises(RuntimeError, match=r"enable_scores\(model\)"):
        teacher_forced_logits(model, _ids(), 38, CompressedCache(transform="query-hadamard", **CODEBOOK))


def test_a_model_kvpolicy_cannot_wrap_is_refused_as_for_h2o():
    model = tiny_model("llama", "flex_attention", layers=1)
    with pytest.raises(ConfigError, match=r"sdpa.*eager.*flex_attention"):
        enable_scores(model)


@pytest.mark.parametrize("name", ["codebook", "minmax-staged", "tiered"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.usefixtures("cpu_kernel")
def test_fused_equals_materialized(name, family, backend):
    """Across group flushes with staging non-empty (minmax: group 16) and tier moves, GQA, batch 2."""
    model = tiny_model(family)
    ids = _ids()
    chosen = composition(name)
    kw = {**chosen, "transform": "query-hadamard", "backend": backend}
    ref, _ = _logits(model, "scores", ids, 38, **kw)
    got, cache = _logits(model, "fused", ids, 38, **kw)
    assert set(cache.attention_paths().values()) == {f"fused ({backend})"}
    basis = cache.layers[0].engine.held.basis
    heads = model.config.num_key_value_heads
    assert isinstance(basis, QueryWeightedBasis) and basis.weights.shape == (2, heads, 1, 64)
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)


def test_power_zero_is_the_hadamard_cache_bit_for_bit():
    model = tiny_model("llama")
    ids = _ids()
    plain, _ = _logits(model, "fused", ids, 38, transform="hadamard", **CODEBOOK)
    unit, _ = _logits(model, "fused", ids, 38, transform=QueryWeighted(power=0), **CODEBOOK)
    assert torch.equal(plain, unit)


def test_bytes_held_are_the_hadamard_caches_plus_the_weights():
    model = tiny_model("llama")
    ids = _ids()
    _, plain = _logits(model, "fused", ids, 38, transform="hadamard", **CODEBOOK)
    _, query = _logits(model, "fused", ids, 38, transform="query-hadamard", **CODEBOOK)
    a, b = dict(plain.memory_report().segments), dict(query.memory_report().segments)
    layers, batch, heads, d = 2, 2, 2, 64
    assert b.pop("scales") - a.pop("scales") == layers * batch * heads * d * 4
    assert a == b


def test_the_estimate_counts_the_weights():
    from kvpolicy.tiny import random_model
    from kvpolicy_lab.estimation import estimate

    config = random_model("llama").config
    plain = dict(estimate(config, 300, CompressedCache(transform="hadamard", **CODEBOOK)).report.segments)
    query = dict(estimate(config, 300, CompressedCache(transform="query-hadamard", **CODEBOOK)).report.segments)
    heads, d = config.num_key_value_heads, config.head_dim
    assert query.pop("scales") - plain.pop("scales") == config.num_hidden_layers * heads * d * 4
    assert query == plain


def test_each_padded_row_fits_the_weights_it_would_alone():
    """A left-padded batch: each row's weights are those of its prompt run alone (its padding queries and
    keys left out), to float rounding."""
    model = tiny_model("llama")
    ids = _ids(40)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    enable_scores(model)
    try:
        cache = CompressedCache(transform="query-hadamard", **CODEBOOK)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=4, do_sample=False)
        alone = CompressedCache(transform="query-hadamard", **CODEBOOK)
        with torch.no_grad():
            model.generate(input_ids=ids[1:, 5:], cache=alone, max_new_tokens=4, do_sample=False)
    finally:
        disable_scores(model)
    rows = cache.layers[0].engine.rows
    weights = [row.held.basis.weights for row in rows]
    assert all(w.shape == (1, 2, 1, 64) for w in weights) and not torch.equal(weights[0], weights[1])
    torch.testing.assert_close(weights[1], alone.layers[0].engine.held.basis.weights, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("prefill", [30, 6], ids=["fitted", "awaiting-the-fit"])
def test_a_saved_cache_loads_and_continues_bit_for_bit(tmp_path, prefill):
    """Saved after the fit, or before any demotion (the moments gathered so far travel with the file)."""
    model = tiny_model("llama")
    ids = _ids(40)
    enable_scores(model)
    try:
        cache = CompressedCache(transform="query-hadamard", **{**CODEBOOK, "window": 4})
        with torch.no_grad():
            model(ids[:, :prefill], cache=cache, use_cache=True)
        path = tmp_path / "c.kvc"
        cache.save(path, model=model)  # applies the demotions pending
        loaded = CompressedCache.load(path, model=model)
        basis = loaded.layers[0].engine.held.basis
        assert (basis.weights is None) == (prefill == 6)
        assert (basis.query_count == 0) == (prefill == 30)
        want = teacher_forced_logits(model, ids[:, prefill:], 1, copy.deepcopy(cache))
        assert torch.equal(teacher_forced_logits(model, ids[:, prefill:], 1, loaded), want)
    finally:
        disable_scores(model)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: s.update(weights=-s["weights"]), "finite and positive"),
        (lambda s: s.update(weights=s["weights"][:, :, :, :8]), "weights"),
        (lambda s: s.update(query_count=3), "moments"),
        (lambda s: s.pop("key_var"), "lacks"),
    ],
    ids=["negative", "short", "count-without-moments", "missing"],
)
def test_a_corrupt_saved_state_is_refused(edit, match):
    store = _store(QueryWeighted())
    keys = torch.randn(1, 1, 8, 64)
    store.observe_queries(torch.randn(1, 2, 3, 64), keys)
    store.add(keys, keys, torch.arange(8, dtype=torch.int32)[None])
    state = store.state_dict()
    edit(state)
    fresh = _store(QueryWeighted())
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(state)
        fresh.validate(keys, keys)


def test_a_corrupt_file_is_refused_with_a_cache_file_error(tmp_path):
    model = tiny_model("llama")
    enable_scores(model)
    try:
        cache = CompressedCache(transform="query-hadamard", **CODEBOOK)
        with torch.no_grad():
            model(_ids(30), cache=cache, use_cache=True)
    finally:
        disable_scores(model)
    path = tmp_path / "c.kvc"
    cache.save(path, model=model)
    # the weights (batch, kv_heads, 1, head_dim) of both layers (the centres are float16)
    bad = with_nan(path, tmp_path / "bad.kvc", (2, 2, 1, 64), count=2)
    with pytest.raises(CacheFileError):
        CompressedCache.load(bad, model=model)


@pytest.mark.parametrize("name", ["kvpolicy-3bit", "kvpolicy-3.5bit"])
def test_the_example_preset_files_are_the_presets_with_query_weighted_keys(name):
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}-qh.toml"
    cache = CompressedCache.from_config(path)
    assert isinstance(cache.transform, QueryWeighted)
    assert repr(cache) == repr(CompressedCache.from_preset(name, transform="query-hadamard"))
