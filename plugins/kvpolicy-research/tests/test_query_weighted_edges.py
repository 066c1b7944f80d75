"""Query-weighted keys at their edges: degenerate moments and crafted weights never give NaN silently.

The weights come from the queries and keys a forward reported (zeros, huge, tiny or non-finite moments), or
from a saved file whose author chose them. Fitted weights are finite and positive and stay within the
transform's bounds whatever finite moments they come from; non-finite moments are refused by name; a file's
weights are refused unless they are weights a fit can give; and a cache holding the most extreme weights a fit
can give still decodes finite logits.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpolicy_research.query_weighted import MAX_RATIO, QueryWeighted
from research_cases import tiny_model
from research_parts import one_thread, research_parts  # noqa: F401 - fixtures, and the plugin's parts registered

from kvpolicy import CompressedCache
from kvpolicy.attention import disable_scores, enable_scores
from kvpolicy.errors import CacheFileError, ConfigError, MetadataOverflowError, NonFiniteError

pytestmark = pytest.mark.usefixtures("one_thread")

KW = dict(policy="log", window=4, bits=4, group_size=16, transform="query-hadamard")


def _bounded(w: torch.Tensor, transform: QueryWeighted) -> None:
    assert w.dtype == torch.float32 and bool((torch.isfinite(w) & (w > 0)).all())
    assert float(w.double().log().abs().max()) <= math.log(transform.max_ratio) / 2 + 1e-5
    transform.check_weights(w)  # what a file's weights must pass


EXTREMES = st.sampled_from([0.0, 1e-45, 1e-38, 1e-20, 1.0, 1e20, 1e38, 3.4e38])


@settings(max_examples=60, deadline=None)
@given(
    query=st.lists(EXTREMES, min_size=8, max_size=8),
    key=st.lists(EXTREMES, min_size=8, max_size=8),
    power=st.sampled_from([0.0, 0.25, 1.0]),
    max_ratio=st.sampled_from([1.0, 64.0, 1e6, MAX_RATIO]),
    count=st.sampled_from([1, 7, 2**40]),
)
def test_weights_fitted_on_any_finite_moments_are_finite_and_bounded(query, key, power, max_ratio, count):
    transform = QueryWeighted(power=power, max_ratio=max_ratio)
    query_sq = torch.tensor(query, dtype=torch.float32).view(1, 1, 8)
    key_var = torch.tensor(key, dtype=torch.float32).view(1, 1, 8)
    _bounded(transform.fit(query_sq, count, key_var), transform)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("which", ["query", "key"])
def test_non_finite_moments_are_refused_by_name(bad, which):
    moments = {"query": torch.ones(1, 1, 8), "key": torch.ones(1, 1, 8)}
    moments[which][0, 0, 3] = bad
    with pytest.raises(NonFiniteError, match="not finite"):
        QueryWeighted().fit(moments["query"], 4, moments["key"])


def test_negative_moments_are_refused():
    with pytest.raises(ValueError, match="negative query or key moments"):
        QueryWeighted().fit(torch.ones(1, 1, 8), 4, -torch.ones(1, 1, 8))


@pytest.mark.parametrize("max_ratio", [MAX_RATIO * 2, math.inf])
def test_a_max_ratio_beyond_the_bound_is_a_config_error(max_ratio):
    with pytest.raises(ConfigError, match=r"max_ratio must be a number in \[1, 4\.29497e\+09\]"):
        QueryWeighted(max_ratio=max_ratio)


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama")
    enable_scores(m)
    yield m
    disable_scores(m)


def _filled(model, prompt: int = 30) -> tuple[CompressedCache, torch.Tensor]:
    ids = torch.randint(3, 96, (2, 60), generator=torch.Generator().manual_seed(6))
    cache = CompressedCache(**KW)
    with torch.no_grad():
        model(ids[:, :prompt], cache=cache, use_cache=True)
        model(ids[:, prompt : prompt + 1], cache=cache, use_cache=True)
    assert all(layer.engine.held.basis.weights is not None for layer in cache.layers)
    return cache, ids


def _crafted(weights: torch.Tensor, kind: str) -> torch.Tensor:
    w = weights.clone()
    if kind == "zero":
        w[..., 0] = 0.0
    elif kind == "inf":
        w[..., 0] = math.inf
    elif kind == "nan":
        w[..., 0] = math.nan
    elif kind == "negative":
        w[..., 0] = -w[..., 0]
    elif kind == "huge-range":  # geometric mean 1, ratio 1e60
        w[..., 0::2], w[..., 1::2] = 1e30, 1e-30
    elif kind == "past-max-ratio":  # each 64 or 1/64 times the unit weight, beyond sqrt(max_ratio) = 8
        w[..., 0::2], w[..., 1::2] = 64.0, 1 / 64.0
    return w


@pytest.mark.parametrize("kind", ["zero", "inf", "nan", "negative", "huge-range", "past-max-ratio"])
def test_a_file_with_crafted_weights_is_refused(model, tmp_path, kind):
    cache, _ = _filled(model)
    store = cache.layers[1].engine.held.basis
    store.weights = _crafted(store.weights, kind)
    path = tmp_path / "c.kvc"
    cache.save(path, model=model)
    with pytest.raises(CacheFileError, match=r"layer 1: .*query-hadamard store.*weights"):
        CompressedCache.load(path, model=model)


@pytest.mark.parametrize("which", ["query_sq", "key_var"])
def test_a_file_with_negative_moments_is_refused(model, tmp_path, which):
    ids = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(7))
    cache = CompressedCache(**{**KW, "window": 32})  # nothing demoted: the moments wait for the fit
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    store = cache.layers[0].engine.held.basis
    assert store.weights is None and store.query_sq is not None
    setattr(store, which, -getattr(store, which))
    cache.save(tmp_path / "c.kvc", model=model)
    with pytest.raises(CacheFileError, match=f"{which} must be >= 0"):
        CompressedCache.load(tmp_path / "c.kvc", model=model)


@pytest.mark.parametrize("meta_dtype", ["float16", "float32"])
def test_the_most_extreme_weights_a_fit_gives_decode_finite_logits_or_refuse(model, tmp_path, meta_dtype):
    """Weights at the bound of the largest max_ratio (channels 2**16 times the unit weight, or 1 over that) in a
    loaded cache: keys and queries weighted by them stay finite, and so do the logits; with float16 metadata the
    weighted keys' range overflows it, which the quantizer refuses naming the remedy (never NaN)."""
    transform = QueryWeighted(max_ratio=MAX_RATIO)
    cache = CompressedCache(**{**KW, "transform": transform, "meta_dtype": meta_dtype})
    ids = torch.randint(3, 96, (2, 60), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        model(ids[:, :30], cache=cache, use_cache=True)
        model(ids[:, 30:31], cache=cache, use_cache=True)
    for layer in cache.layers:
        store = layer.engine.held.basis
        w = torch.ones_like(store.weights)
        w[..., 0::2], w[..., 1::2] = 2.0**16, 2.0**-16
        transform.check_weights(w)
        store.weights = w
    cache.save(tmp_path / "c.kvc", model=model)
    loaded = CompressedCache.load(tmp_path / "c.kvc", model=model)
    with torch.no_grad():
        for t in range(31, 60):
            try:
                logits = model(ids[:, t : t + 1], cache=loaded, use_cache=True).logits
            except MetadataOverflowError as exc:
                assert meta_dtype == "float16" and "meta_dtype='float32'" in str(exc)
                return
            assert bool(torch.isfinite(logits).all()), t
    assert meta_dtype == "float32"
