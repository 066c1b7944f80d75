"""The transform stage (kvpolicy.transforms): the contract, the Hadamard rotation, and the cache with it."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from conftest import fused_and_materialized, teacher_forced_logits
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy import CompressedCache, LogWindow, registry
from kvpolicy.errors import ConfigError
from kvpolicy.fused import decode_attention, disable_fused, enable_fused
from kvpolicy.testing import check_transform
from kvpolicy.transforms import Hadamard, NoTransform, Transform, TransformedStore
from kvpolicy.transforms.hadamard import block_size, walsh_hadamard

# ------------------------------------------------------------------ the contract


def test_hadamard_keeps_the_transform_contract():
    check_transform(st.builds(Hadamard, seed=st.integers(0, 2**31)))


def test_none_keeps_the_transform_contract():
    check_transform(NoTransform)


def _sylvester(n: int) -> torch.Tensor:
    """The Sylvester Hadamard matrix of order ``n`` by its definition: ``H[i, j] = (-1)^popcount(i & j)``."""
    i = torch.arange(n)
    bits = torch.tensor([bin(v).count("1") for v in (i[:, None] & i[None, :]).flatten().tolist()]).view(n, n)
    return (1 - 2 * (bits % 2)).double()


@pytest.mark.parametrize("n", [1, 2, 8, 64, 256])
def test_fast_walsh_hadamard_equals_the_matrix_definition(n):
    x = torch.randn(3, n, dtype=torch.float64)
    torch.testing.assert_close(walsh_hadamard(x), x @ _sylvester(n))


@settings(max_examples=30, deadline=None)
@given(d=st.sampled_from([8, 16, 24, 40, 64, 80, 96, 128, 192, 256]), seed=st.integers(0, 2**31))
def test_hadamard_is_signs_times_block_diagonal_hadamard(d, seed):
    """``R = diag(s) · blockdiag(H_B) / √B`` with B the largest power of two dividing d and s = ±1."""
    r = Hadamard(seed).matrix(d).double()
    b = block_size(d)
    assert b == max(2**k for k in range(9) if d % 2**k == 0)
    rows = torch.arange(d)
    signs = torch.sign(r[rows, rows // b * b])  # each block of H starts with a column of +1
    h = torch.block_diag(*[_sylvester(b)] * (d // b)) / math.sqrt(b)
    torch.testing.assert_close(r, signs[:, None] * h, rtol=0, atol=1e-7)


def test_seeds_draw_different_rotations_and_the_same_seed_the_same():
    a, b = Hadamard(0).matrix(64), Hadamard(1).matrix(64)
    assert not torch.equal(a, b)
    assert torch.equal(a, Hadamard(0).matrix(64))
    assert Hadamard(0) == Hadamard(0) and Hadamard(0) != Hadamard(1)


def test_the_same_seed_gives_the_same_rotation_in_another_process():
    code = (
        "import sys, torch; from kvpolicy.transforms import Hadamard; torch.save(Hadamard(7).matrix(96), sys.argv[1])"
    )
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/r.pt"
        subprocess.run([sys.executable, "-c", code, path], check=True, timeout=120)
        assert torch.equal(torch.load(path), Hadamard(7).matrix(96))


@pytest.mark.parametrize("d", [4, 12, 60, 100])
def test_a_head_dim_the_rotation_cannot_serve_is_refused_naming_it(d):
    with pytest.raises(ConfigError, match=rf"head_dim={d} is not a multiple of 8.*64, 80, 96"):
        Hadamard().check_head_dim(d)
    cache = CompressedCache(policy="log", window=4, group_size=4, transform="hadamard", backend="torch")
    with pytest.raises(ConfigError, match=rf"head_dim={d}"):
        cache.update(torch.randn(1, 1, 8, d), torch.randn(1, 1, 8, d), 0)


def test_bad_seed_is_refused():
    with pytest.raises(ConfigError, match="seed must be an integer >= 0; got seed=-1"):
        Hadamard(seed=-1)
    with pytest.raises(ConfigError, match="seed must be an integer"):
        CompressedCache(transform="hadamard", seed="a")


# ------------------------------------------------------------------ composition and registry


def test_cache_keywords_route_seed_to_the_transform():
    cache = CompressedCache(policy="log", transform="hadamard", seed=3)
    assert cache.transform == Hadamard(3)
    assert "transform=Hadamard(seed=3)" in repr(cache)
    assert "transform" not in repr(CompressedCache(policy="log"))  # the default stays out of result names
    with pytest.raises(ConfigError, match=r"unknown keyword\(s\) \['seed'\].*'transform': \[\]"):
        CompressedCache(policy="log", seed=3)
    with pytest.raises(ConfigError, match=r"unknown transform 'rotate'; registered transforms: \['hadamard', 'none'\]"):
        CompressedCache(transform="rotate")
    with pytest.raises(ConfigError, match="transform must be a registered name or a Transform object"):
        CompressedCache(transform=42)


def test_with_eviction_the_transform_is_idle_and_says_so(models):
    model = models("llama")
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    plain = CompressedCache(policy="recent", window=8, action="evict")
    rotated = CompressedCache(policy="recent", window=8, action="evict", transform="hadamard")
    assert "[idle: action 'evict' keeps no demoted tokens to transform]" in repr(rotated)
    a = teacher_forced_logits(model, ids, 20, plain)
    b = teacher_forced_logits(model, ids, 20, rotated)
    assert torch.equal(a, b)
    assert not isinstance(rotated.layers[0].store, TransformedStore)
    assert "transform" not in rotated.memory_report().segments


@dataclass(frozen=True)
class Reverse(Transform):
    """A plugin transform: reverse the channels (a permutation, so orthogonal)."""

    name = "reverse"

    def forward(self, x):
        return x.flip(-1)

    def inverse(self, y):
        return y.flip(-1)


def test_a_plugin_transform_registers_checks_and_composes(models):
    from kvpolicy.hookspecs import hookimpl

    class Plugin:
        @hookimpl
        def kvpolicy_register_transforms(self):
            return {"reverse": Reverse}

    plugin = Plugin()
    registry.register(plugin, "reverse-plugin")
    try:
        assert "reverse" in registry.names("transforms")
        check_transform(Reverse, max_examples=10)
        model = models("llama")
        ids = torch.randint(3, 96, (1, 60), generator=torch.Generator().manual_seed(4))
        kw = dict(policy="log", window=8, group_size=16, backend="torch", attention="materialized")
        a = teacher_forced_logits(model, ids, 30, CompressedCache(**kw))
        rev = CompressedCache(**kw, transform="reverse")
        b = teacher_forced_logits(model, ids, 30, rev)
        # per-token value groups see the same values in another order: values come back the same;
        # per-channel key groups are the same channels renamed: keys too. The logits agree.
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        inner = rev.layers[0].store.inner
        assert torch.equal(inner.keys().flip(-1), rev.layers[0].store.keys())
    finally:
        registry.unregister(plugin)
    assert "reverse" not in registry.names("transforms")


def test_a_class_that_is_not_a_transform_is_skipped_with_a_warning():
    from kvpolicy.hookspecs import hookimpl
    from kvpolicy.registry import PluginWarning

    class Bad:
        @hookimpl
        def kvpolicy_register_transforms(self):
            return {"bad": int}

    plugin = Bad()
    registry.register(plugin, "bad-transform")
    try:
        with pytest.warns(PluginWarning, match=r"'bad': class builtins.int is not a subclass of .*Transform"):
            names = registry.names("transforms")
        assert "bad" not in names
    finally:
        registry.unregister(plugin)


# ------------------------------------------------------------------ what rotation does to stored tokens


def _outlier_tokens(n: int = 256, d: int = 64, seed: int = 0) -> torch.Tensor:
    """Keys with a few large outlier channels, as real models have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 2, n, d, generator=g)
    x[..., [3, 17]] *= 20
    return x


@pytest.mark.parametrize("axis", ["token", "channel"])
def test_rotation_spreads_outlier_channels_and_lowers_the_2bit_error(axis):
    """Per-token groups suffer from outlier channels (one large channel sets the whole group's
    scale); rotation spreads them, so 2-bit reconstruction error falls. Per-channel groups already
    isolate each channel, so there the rotation must at least not hurt much."""
    x = _outlier_tokens()
    errors = {}
    for name in ("none", "hadamard"):
        cache = CompressedCache(
            policy="recent", window=1, bits=2, group_size=64, key_axis=axis, value_axis=axis, transform=name,
            backend="torch", fit="minmax",
        )  # fmt: skip
        cache.update(x, x.clone(), 0)
        cache.update(x[:, :, :1], x[:, :, :1], 0)  # a decode step demotes the prompt
        store = cache.layers[0].store
        n = store.k.num_quantized if name == "none" else store.inner.k.num_quantized
        got = store.keys()[:, :, :n]
        errors[name] = float(((got - x[:, :, :n]) ** 2).mean())
    if axis == "token":
        assert errors["hadamard"] < 0.5 * errors["none"]
    else:
        assert errors["hadamard"] < 3 * errors["none"]


def test_the_store_holds_rotated_tokens_and_gives_back_the_originals_at_8_bits():
    x = _outlier_tokens(128)
    cache = CompressedCache(policy="recent", window=4, bits=8, group_size=64, transform="hadamard", backend="torch")
    cache.update(x, x * 0.5, 0)
    cache.update(x[:, :, :1], x[:, :, :1], 0)
    store = cache.layers[0].store
    n = store.inner.k.num_quantized
    r = Hadamard().matrix(64)
    rotated = store.inner.keys()[:, :, :n]
    step = float((x @ r).abs().max()) * 2 / 255
    assert float((rotated - x[:, :, :n] @ r).abs().max()) <= step
    assert float((store.keys()[:, :, :n] - x[:, :, :n]).abs().max()) <= 8 * step  # un-rotated on read
    assert not torch.allclose(rotated, x[:, :, :n], atol=1.0)  # really held in another basis


def test_bytes_held_equal_the_unrotated_cache_plus_the_matrix_once():
    """Rotation changes no code, scale or position count; the cache adds its d x d float32 matrix,
    counted once however many layers hold it."""
    x = torch.randn(2, 2, 300, 64)
    reports = {}
    for name in ("none", "hadamard"):
        cache = CompressedCache(policy="log", window=16, bits=2, transform=name, backend="torch")
        for layer in range(3):
            cache.update(x, x, layer)
            cache.update(x[:, :, :1], x[:, :, :1], layer)
        reports[name] = cache.memory_report()
    plain, rot = reports["none"].segments, reports["hadamard"].segments
    assert rot.pop("transform") == 64 * 64 * 4
    assert rot == plain


# ------------------------------------------------------------------ fused equals materialised


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_fused_equals_materialized_with_rotation(family, backend, cpu_kernel):
    """Across group flushes with staging non-empty (group 16, window 8, 75 tokens, batch 2), GQA."""
    got, ref, cache = fused_and_materialized(family, transform="hadamard", backend=backend, key_bits=4, value_bits=2)
    assert set(cache.attention_paths().values()) == {f"fused ({backend})"}
    store = cache.layers[0].store
    assert isinstance(store, TransformedStore) and store.inner.k.staging is not None
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)


def test_decode_attention_in_the_rotated_basis_equals_softmax_over_everything():
    """The fused computation rotates the query once and un-rotates the stored parts' output: it equals
    plain softmax attention over the un-rotated history (quantization aside: 8-bit keys of a tiny grid)."""
    from kvpolicy.backends.torch_backend import TorchBackend

    g = torch.Generator().manual_seed(3)
    be, h = TorchBackend(), Hadamard(5)
    q = torch.randn(1, 2, 3, 64, generator=g)
    full_k, full_v = torch.randn(1, 2, 5, 64, generator=g), torch.randn(1, 2, 5, 64, generator=g)
    hist_k, hist_v = torch.randn(1, 2, 40, 64, generator=g), torch.randn(1, 2, 40, 64, generator=g)
    qk = be.quantize(h.forward(hist_k[:, :, :32]), 8, 16, "channel")
    qv = be.quantize(h.forward(hist_v[:, :, :32]), 8, 16, "token")
    tail = (h.forward(hist_k[:, :, 32:]), h.forward(hist_v[:, :, 32:]))
    got = decode_attention(q, full_k, full_v, ((qk, qv), tail), be, 0.125, basis=h)
    keys = torch.cat([h.inverse(be.dequantize(qk)), hist_k[:, :, 32:], full_k], dim=2)
    values = torch.cat([h.inverse(be.dequantize(qv)), hist_v[:, :, 32:], full_v], dim=2)
    want = torch.softmax(q @ keys.transpose(-1, -2) * 0.125, dim=-1) @ values
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


def test_eight_bit_quantization_with_rotation_stays_close_to_uncompressed(models):
    model = models("llama")
    ids = torch.randint(3, 96, (1, 90), generator=torch.Generator().manual_seed(6))
    ref = teacher_forced_logits(model, ids, 60, CompressedCache(action="none"))
    got = teacher_forced_logits(
        model, ids, 60, CompressedCache(policy="log", window=8, bits=8, group_size=16, transform="hadamard")
    )
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    assert kl < 1e-3
    assert (ref.argmax(-1) == got.argmax(-1)).float().mean() > 0.95


def test_beam_search_reorders_the_rotated_store(models):
    model = models("llama")
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(8))
    kw = dict(max_new_tokens=12, num_beams=3, do_sample=False)
    make = dict(policy="log", window=8, group_size=16, bits=4, transform="hadamard")
    mask = torch.ones_like(ids)
    ref = model.generate(ids, attention_mask=mask, cache=CompressedCache(**make, attention="materialized"), **kw)
    enable_fused(model)
    try:
        got = model.generate(ids, attention_mask=torch.ones_like(ids), cache=CompressedCache(**make), **kw)
    finally:
        disable_fused(model)
    assert torch.equal(ref, got)


@pytest.mark.parametrize(
    ("name", "bottom"),
    [("kvpolicy-3bit", (3, 2)), ("kvpolicy-3.5bit", (3, 3)), ("kvpolicy-4bit", (4, 3))],
)
def test_kvpolicy_presets_are_the_measured_tiered_compositions(name, bottom):
    """Each preset is log W=4, a centred 4-bit codebook middle tier kept by the log rule at W′=32, a
    centred codebook bottom tier of its widths, and the rotation; tier for tier the frontier cell
    that docs/frontier.md measures (tests/test_frontier_report.py checks the cell's label)."""
    from kvpolicy.actions.tiered import Tiered

    cache = CompressedCache.from_preset(name)
    assert cache.transform == Hadamard(0) and cache.policy == LogWindow(window=4) and isinstance(cache.action, Tiered)
    widths = [(t.key_width, t.value_width, t.key_method, t.value_method, t.key_centre) for t in cache.action.tiers]
    assert widths == [(4, 4, "codebook", "codebook", True), (*bottom, "codebook", "codebook", True)]
    assert [k.window for k in cache.action.keep] == [32]
    other = CompressedCache.from_preset(name, window=8, middle_window=64, seed=3)
    assert (other.policy.window, other.action.keep[0].window, other.transform) == (8, 64, Hadamard(3))
    with pytest.raises(ConfigError, match=f"preset '{name}'"):
        CompressedCache.from_preset(name, middle_window=0)


def test_kvpolicy_4_5bit_is_one_tier_of_per_channel_keys_and_codebook_values():
    """``kvpolicy-4.5bit``: log W=4, 4-bit min-max keys per channel in groups of 64, 3-bit codebook
    values, the rotation; the frontier cell ``log4-k4v3c`` (tests/test_frontier_report.py)."""
    cache = CompressedCache.from_preset("kvpolicy-4.5bit")
    assert cache.transform == Hadamard(0) and cache.policy == LogWindow(window=4)
    a = cache.action
    assert (a.key_width, a.value_width, a.key_method, a.value_method) == (4, 3, "minmax", "codebook")
    assert (a.key_axis, a.key_group) == ("channel", 64)
    other = CompressedCache.from_preset("kvpolicy-4.5bit", window=16, seed=2)
    assert (other.policy.window, other.transform) == (16, Hadamard(2))
    with pytest.raises(ConfigError, match=r"preset 'kvpolicy-4\.5bit'"):
        CompressedCache.from_preset("kvpolicy-4.5bit", window=0)
