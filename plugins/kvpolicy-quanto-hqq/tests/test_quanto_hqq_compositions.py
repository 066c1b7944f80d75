"""The plugin's backends in caches, as a user composes them: defaults they cannot serve (fitted key ranges) are
replaced, the options they lack are refused naming them, they are read by materialising (no fused kernel), and
a cache on quanto cannot be saved."""

from __future__ import annotations

import pytest
import torch
from quanto_hqq_cases import BACKENDS, plugin_backends, quanto_extension, teacher_forced_logits, tiny_model  # noqa: F401

from kvpolicy import CompressedCache, ConfigError, LogWindow, Quantize, Tiered, registry
from kvpolicy.fused import disable_fused, enable_fused

pytestmark = pytest.mark.usefixtures("quanto_extension")


def _feed(cache: CompressedCache, keys: torch.Tensor, values: torch.Tensor) -> None:
    """A prompt of ``keys``/``values`` (``(1, H, T, D)``) into layer 0, then released."""
    cache.update(keys, values, 0)
    cache.release_forward()


def _step(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The widest min-max step any group along ``dim`` of ``x`` can have: the range over the whole
    axis divided by the code count (a group's own range is at most that)."""
    span = x.amax(dim=dim, keepdim=True) - x.amin(dim=dim, keepdim=True)
    return span / (2**bits - 1)


# ---------------------------------------------------------------------------------------- defaults adapted
@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_without_range_fitting_take_the_defaults_with_min_max_keys(backend):
    cache = CompressedCache(backend=backend)
    assert cache.action.keys.fit == "minmax" and cache.action.values.fit == "minmax"
    assert "adapted=" in repr(cache) and "key_fit='minmax'" in repr(cache) and repr(backend) in repr(cache)
    # the torch backend keeps its default (fitted keys), and says nothing
    torch_cache = CompressedCache(backend="torch")
    assert torch_cache.action.keys.fit == "mse" and "adapted" not in repr(torch_cache)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("given", [{"key_fit": "mse"}, {"fit": "mse"}])
def test_an_explicit_fit_the_backend_lacks_still_raises(backend, given):
    with pytest.raises(ConfigError, match=rf"backend {backend!r} does not fit min-max ranges"):
        CompressedCache(backend=backend, **given)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiers_are_adapted_one_by_one(backend):
    action = Tiered(tiers=[Quantize(bits=4, key_axis="token"), Quantize(bits=2)], keep=[LogWindow(8)])
    cache = CompressedCache(action=action, backend=backend)
    assert [t.keys.fit for t in cache.action.tiers] == ["minmax", "minmax"]
    assert "tiers[0].key_fit='minmax'" in repr(cache) and "tiers[1].key_fit='minmax'" in repr(cache)


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_caches_on_quanto_and_hqq_agree_with_torch_within_the_quantization_step(backend):
    """The same prompt into the backend's default cache and the torch backend's min-max one: every
    reconstructed element within one quantization step of torch's (min-max rounding leaves each
    within half a step of the input; HQQ moves its zero-points, within a step)."""
    torch.manual_seed(0)
    keys, values = torch.randn(1, 2, 300, 64), torch.randn(1, 2, 300, 64)
    settings = ((backend, {}), ("torch", {"key_fit": "minmax"}))
    caches = {name: CompressedCache(backend=name, **kw) for name, kw in settings}
    views, where = {}, {}
    for name, cache in caches.items():
        _feed(cache, keys, values)
        where[name] = cache.positions(0)  # applies the deferred demotion (an inspection reports the next step)
        views[name] = cache.layers[0].attention_view()
    assert torch.equal(where["torch"]["compressed"], where[backend]["compressed"])
    where = where["torch"]
    compressed = where["compressed"].flatten()
    # keys per channel wait at full precision for a whole group of 128 tokens
    coded_keys = compressed[~torch.isin(compressed, where["staged_keys"].flatten())]
    assert coded_keys.numel() >= 128 and compressed.numel() > 200
    k_b, k_t = (view[0][:, :, coded_keys] for view in (views[backend], views["torch"]))
    v_b, v_t = (view[1][:, :, compressed] for view in (views[backend], views["torch"]))
    k_step = _step(keys[:, :, coded_keys], 2, dim=2)  # keys per channel: a group spans tokens
    v_step = _step(values[:, :, compressed], 2, dim=3)  # values per token: a group spans channels
    assert ((k_b - k_t).abs() <= k_step * (1 + 1e-3)).all()
    assert ((v_b - v_t).abs() <= v_step * (1 + 1e-3)).all()
    # and both are quantized, not the inputs themselves
    for got, x in ((k_b, keys[:, :, coded_keys]), (v_b, values[:, :, compressed])):
        assert (got - x).abs().amax() > 0.05


# ---------------------------------------------------------------------------------------- options refused
@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_without_the_scheme_refuse_it(backend):
    with pytest.raises(
        ConfigError, match=rf"backend '{backend}' does not serve value_scheme='codebook'; it serves \['minmax'\]"
    ):
        CompressedCache(policy="log", bits=2, value_scheme="codebook", transform="hadamard", backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_without_fitted_ranges_refuse_them(backend):
    with pytest.raises(ConfigError, match=rf"backend '{backend}' does not fit .* it supports fit in \['minmax'\]"):
        CompressedCache(policy="log", bits=2, fit="mse", backend=backend)
    with pytest.raises(ConfigError, match=rf"backend '{backend}' does not fit min-max ranges with key_fit='mse'"):
        CompressedCache(policy="log", bits=2, key_fit="mse", backend=backend)


# ---------------------------------------------------------------------------------------- no fused kernel
@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_without_fused_attention(backend):
    kw = dict(
        policy="log", window=8, bits=2, group_size=16, fit="minmax"
    )  # quanto and hqq have no fitted ranges (the keys' default)
    with pytest.raises(ConfigError, match=f"attention='fused' cannot serve this composition: backend '{backend}'"):
        CompressedCache(**kw, backend=backend, attention="fused")
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (1, 48), generator=torch.Generator().manual_seed(1))
    ref = teacher_forced_logits(model, ids, 40, CompressedCache(**kw, backend=backend, attention="materialized"))
    enable_fused(model)
    try:
        cache = CompressedCache(**kw, backend=backend)
        got = teacher_forced_logits(model, ids, 40, cache)
    finally:
        disable_fused(model)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    paths = cache.attention_paths().values()
    assert all(p.startswith(f"materialized ({backend}): backend '{backend}'") for p in paths)


# ---------------------------------------------------------------------------------------- key and value widths
def _group_step(x: torch.Tensor, bits: int, g: int, axis: str) -> torch.Tensor:
    """Per-element min-max step of ``x`` (``(b, h, t, d)``) in groups of ``g`` along ``axis``."""
    b, h, t, d = x.shape
    if axis == "token":
        xg = x.double().reshape(b, h, t, d // g, g)
        return ((xg.amax(-1) - xg.amin(-1)) / (2**bits - 1)).repeat_interleave(g, dim=3)
    xg = x.double().reshape(b, h, t // g, g, d)
    return ((xg.amax(3) - xg.amin(3)) / (2**bits - 1)).repeat_interleave(g, dim=2)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(("key_bits", "value_bits"), [(4, 2), (2, 4)])
def test_each_kind_is_stored_at_its_width(name, key_bits, value_bits):
    """Keys and values at their own widths: quanto within half a step of the input and one step of the
    ``torch`` reference; hqq's optimiser moves its grid, not its width, so its mean error stays within a step."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 64, 32, generator=g), torch.randn(1, 2, 64, 32, generator=g)
    action = Quantize(key_bits=key_bits, value_bits=value_bits, group_size=16, fit="minmax")
    stores = {}
    for backend in (name, "torch"):
        be = registry.get("backends", backend)()
        action.check_backend(be)
        stores[backend] = action.new_store(be, 0)
        stores[backend].add(k, v, torch.arange(64, dtype=torch.int32)[None])
    store, ref = stores[name], stores["torch"]
    assert (store.k.q.bits, store.v.q.bits) == (key_bits, value_bits)
    for kind, x, bits, axis, got, want in (
        ("keys", k, key_bits, "channel", store.keys(), ref.keys()),
        ("values", v, value_bits, "token", store.values(), ref.values()),
    ):
        s = _group_step(x, bits, 16, axis)
        err = (got.double() - x.double()).abs()
        if name == "quanto":
            assert (err <= s / 2 + 1e-3 * s + 1e-6).all(), f"{name} {kind}: beyond half a {bits}-bit step"
            assert ((got.double() - want.double()).abs() <= s + 1e-3 * s + 1e-6).all(), f"{name} {kind} vs torch"
        else:
            assert err.mean() < s.mean()


# ---------------------------------------------------------------------------------------- saving
def test_a_cache_on_quanto_cannot_be_saved_and_writes_nothing(tmp_path):
    model = tiny_model("llama")
    cache = CompressedCache(policy="log", window=4, bits=2, group_size=16, fit="minmax", backend="quanto")
    ids = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model(ids[:, :30], cache=cache, use_cache=True)
        for t in range(30, 40):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
    with pytest.raises(NotImplementedError, match="backend 'quanto' cannot save"):
        cache.save(tmp_path / "q.kvc")
    assert list(tmp_path.iterdir()) == []
