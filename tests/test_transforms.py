"""The transform stage (kvpolicy.transforms): the contract, the Hadamard rotation, and the cache with it."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from dataclasses import dataclass
from dataclasses import field as dataclass_field

import pytest
import torch
from conftest import fused_and_materialized, teacher_forced_logits
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy import CompressedCache, LogWindow, registry
from kvpolicy.errors import ConfigError, MetadataOverflowError, NonFiniteError
from kvpolicy.fused import attend_parts, disable_fused, enable_fused
from kvpolicy.layer.parts import Part
from kvpolicy.testing import check_transform
from kvpolicy.transforms import BindContext, Hadamard, NoTransform, Transform
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


@pytest.mark.parametrize("seed", [-1, 2**64, 2**70, True, 1.0, "a", None])
def test_a_seed_a_generator_cannot_take_is_refused_at_construction(seed):
    """torch.Generator takes seeds in [0, 2**64 - 1]: anything else fails when the cache is built, not at
    the first demotion (where it would mark the layer failed)."""
    allowed = rf"Hadamard: seed must be an integer in \[0, 2\*\*64 - 1\] .*; got seed={re.escape(repr(seed))}$"
    with pytest.raises(ConfigError, match=allowed):
        Hadamard(seed=seed)
    with pytest.raises(ConfigError, match=allowed):
        CompressedCache(transform="hadamard", seed=seed)
    with pytest.raises(ConfigError, match=allowed):
        CompressedCache.from_preset("kvpolicy-4.5bit", seed=seed)


def test_the_largest_seed_builds_its_rotation_and_serves_a_demotion():
    r = Hadamard(seed=2**64 - 1).matrix(64)
    torch.testing.assert_close(r @ r.T, torch.eye(64), rtol=0, atol=1e-6)
    cache = CompressedCache(policy="recent", window=4, group_size=16, transform="hadamard", seed=2**64 - 1)
    x = torch.randn(1, 2, 40, 64)
    cache.update(x, x, 0)
    cache.update(x[:, :, :1], x[:, :, :1], 0)
    assert len(cache.layers[0].engine.held.store) > 0 and cache.layers[0].engine.held.failed is None


# ------------------------------------------------------------------ composition and registry


def test_cache_keywords_route_seed_to_the_transform():
    cache = CompressedCache(policy="log", transform="hadamard", seed=3)
    assert cache.transform == Hadamard(3)
    assert "transform=Hadamard(seed=3)" in repr(cache)
    assert "transform" not in repr(CompressedCache(policy="log"))  # the default stays out of result names
    with pytest.raises(ConfigError, match=r"unknown keyword\(s\) \['seed'\].*'transform': \[\]"):
        CompressedCache(policy="log", seed=3)
    registered = re.escape(str(registry.names("transforms")))  # the built-in ones, and any plugin's
    assert {"hadamard", "none"} <= set(registry.names("transforms"))
    with pytest.raises(ConfigError, match=rf"unknown transform 'rotate'; registered transforms: {registered}"):
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
    assert rotated.layers[0].engine.held.basis is None
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
        inner = rev.layers[0].engine.held.store
        assert torch.equal(inner.keys().flip(-1), _held_keys(rev.layers[0].engine))
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
        n = cache.layers[0].engine.held.store.k.num_quantized
        got = _held_keys(cache.layers[0].engine)[:, :, :n]
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
    store = cache.layers[0].engine.held.store
    n = store.k.num_quantized
    r = Hadamard().matrix(64)
    rotated = store.keys()[:, :, :n]
    step = float((x @ r).abs().max()) * 2 / 255
    assert float((rotated - x[:, :, :n] @ r).abs().max()) <= step
    assert float((_held_keys(cache.layers[0].engine)[:, :, :n] - x[:, :, :n]).abs().max()) <= 8 * step  # un-rotated
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
    store = cache.layers[0].engine.held.store
    assert cache.layers[0].engine.held.basis is not None and store.k.staging is not None
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)


def test_attend_parts_in_the_rotated_basis_equals_softmax_over_everything():
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
    got = attend_parts(
        q, [Part(*tail), Part(qk, qv, be), Part(full_k, full_v)], 0.125, h.bind(BindContext.of(0, full_k, full_v))
    )
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
    widths = [(t.keys.bits, t.values.bits, t.keys.name, t.values.name, t.keys.centre) for t in cache.action.tiers]
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
    assert (a.keys.bits, a.values.bits, a.keys.name, a.values.name) == (4, 3, "minmax", "codebook")
    assert (a.keys.axis, a.keys.group_size) == ("channel", 64)
    other = CompressedCache.from_preset("kvpolicy-4.5bit", window=16, seed=2)
    assert (other.policy.window, other.transform) == (16, Hadamard(2))
    with pytest.raises(ConfigError, match=r"preset 'kvpolicy-4\.5bit'"):
        CompressedCache.from_preset("kvpolicy-4.5bit", window=0)


# ------------------------------------------------------------------ the range of the model's dtype


def _fused_function():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from kvpolicy.fused import register

    register()
    return ALL_ATTENTION_FUNCTIONS["kvpolicy_fused_sdpa"]


def _read_both_ways(cache, keys, values, query):
    """Prefill ``keys``/``values`` into ``cache``, demote them with one decode step, and read the history
    both ways: the materialised view in position order and the fused function's output (batch, q, heads, d)."""
    cache.update(keys, values, 0)
    hk, hv = cache.update(keys[:, :, -1:], values[:, :, -1:], 0)
    out, _ = _fused_function()(torch.nn.Module().eval(), query, hk, hv, None, scaling=0.125)
    assert cache.attention_paths() == {0: f"fused ({cache.backend.name})"}
    return cache.layers[0].attention_view("ordered"), out


def _aligned(n: int, d: int, size: float, channels: int, seed: int) -> torch.Tensor:
    """Tokens of magnitude ~4 with, at a few positions, ``size`` in the first ``channels`` channels, signed
    so that the rotation adds them up: rotated coordinate 0 is ``size * channels / √d``."""
    x = torch.randn(1, 2, n, d, generator=torch.Generator().manual_seed(seed)) * 4
    signs = torch.sign(Hadamard(0).matrix(d)[:, 0])
    x[:, :, [3, 20, 41], :channels] = size * signs[:channels]
    return x


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("check_finite", [True, False])
def test_float16_tokens_whose_rotation_passes_65504_read_back_as_in_float32(backend, check_finite, cpu_kernel):
    """Finite float16 keys and values (30000 in 24 of 64 channels) whose rotated coordinates reach 90000:
    the rotation is held and quantized in float32 with the float16 model's metadata (float16 scales), so
    both reads equal those of the same tokens in a float32 model, up to the final rounding to float16."""
    k, v = (_aligned(70, 64, 30000.0, 24, seed).half().float() for seed in (0, 1))  # the same tokens in both
    assert float((k @ Hadamard(0).matrix(64)).abs().max()) > 80000  # beyond float16's 65504
    query = torch.randn(1, 4, 1, 64, generator=torch.Generator().manual_seed(2)).half()
    runs = {}
    for dtype in (torch.float32, torch.float16):
        cache = CompressedCache(
            policy="recent", window=4, bits=4, group_size=16, transform="hadamard", backend=backend,
            check_finite=check_finite,
        )  # fmt: skip
        runs[dtype] = _read_both_ways(cache, k.to(dtype), v.to(dtype), query.to(dtype))
        inner = cache.layers[0].engine.held.store
        assert inner.k.q.dtype == torch.float32 and inner.k.q.tensors()["scales"].dtype == torch.float16
    (view16, out16), (view32, out32) = runs[torch.float16], runs[torch.float32]
    for got, want in ((view16[0], view32[0]), (view16[1], view32[1]), (out16, out32)):
        assert got.dtype == torch.float16 and bool(torch.isfinite(got).all())
        torch.testing.assert_close(got.float(), want, rtol=1e-3, atol=1e-3)


def test_float16_reads_just_past_65504_are_clamped_towards_the_tokens():
    """Keys and values of 65504 (float16's largest) in one channel: the 2-bit reconstruction, un-rotated
    in float32, passes 65504 by quantization error; read back in float16 it is clamped to 65504 (closer
    to the token than the float32 reading) rather than turned into inf, materialised and fused (a query
    that attends to the token whose value comes back largest)."""
    x = (torch.randn(1, 2, 64, 64, generator=torch.Generator().manual_seed(0)) * 100).half().float()
    x[..., 0] = 65504.0
    kw = dict(policy="recent", window=4, bits=2, group_size=16, transform="hadamard", backend="torch")
    caches = {dtype: CompressedCache(**kw) for dtype in (torch.float32, torch.float16)}
    handed = {}
    for dtype, cache in caches.items():
        cache.update(x.to(dtype), x.to(dtype), 0)
        handed[dtype] = cache.update(x[:, :, -1:].to(dtype), x[:, :, -1:].to(dtype), 0)
    view32, view16 = (caches[dtype].layers[0].attention_view("ordered") for dtype in (torch.float32, torch.float16))
    assert float(view32[0].abs().max()) > 65520 and float(view32[1].abs().max()) > 65520  # would round to inf
    top = view32[1][0, :, :, 0].argmax(dim=-1)  # per kv head, the token whose value reads back largest
    query = torch.zeros(1, 2, 1, 64)
    for h in range(2):
        query[0, h, 0, 1:] = x[0, h, top[h], 1:] / x[0, h, top[h], 1:].norm() * 40  # scores it ~500 above others
    query = query.half().float()
    fused = _fused_function()
    out32, out16 = (
        fused(torch.nn.Module().eval(), query.to(dtype), *handed[dtype], None, scaling=0.125)[0]
        for dtype in (torch.float32, torch.float16)
    )
    assert float(out32[..., 0].min()) > 65520
    for got, want in ((view16[0], view32[0]), (view16[1], view32[1]), (out16, out32)):
        assert bool(torch.isfinite(got).all()) and float(got.abs().max()) == 65504.0
        torch.testing.assert_close(got.float(), want.clamp(-65504, 65504), rtol=1e-3, atol=1e-3)


def test_float16_metadata_that_cannot_hold_the_rotated_groups_names_the_rotation_and_the_remedy():
    """30000 in every channel, aligned: rotated coordinate 240000, so a 2-bit group's scale (80000) does
    not fit float16 metadata. The error names the rotation and meta_dtype='float32', which then serves."""
    k = _aligned(70, 64, 30000.0, 64, 0).half().float()
    kw = dict(policy="recent", window=4, bits=2, group_size=16, transform="hadamard", backend="torch")
    cache = CompressedCache(**kw)
    cache.update(k.half(), k.half(), 0)
    with pytest.raises(MetadataOverflowError) as info:
        cache.update(k[:, :, -1:].half(), k[:, :, -1:].half(), 0)
    message = str(info.value)
    assert "meta_dtype='float32'" in message
    assert "float16 tokens rotated by Hadamard(seed=0), held in float32" in message
    query = torch.randn(1, 2, 1, 64, generator=torch.Generator().manual_seed(2)).half()
    (view16, out16), (view32, out32) = (
        _read_both_ways(CompressedCache(**kw, meta_dtype="float32"), k.to(dtype), k.to(dtype), query.to(dtype))
        for dtype in (torch.float16, torch.float32)
    )
    for got, want in ((view16[0], view32[0]), (out16, out32)):
        assert bool(torch.isfinite(got).all())
        torch.testing.assert_close(got.float(), want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rotation_beyond_float32s_range_is_blamed_on_the_rotation(dtype):
    """float32 and bfloat16 share float32's range, so their rotation stays in their dtype; finite tokens of
    1e38 in 32 aligned channels rotate to 4e38, past it. The error names the rotation, not the input;
    non-finite input keeps the input's error."""
    x = _aligned(48, 64, 1e38, 32, 0).to(dtype)
    assert bool(torch.isfinite(x).all())
    cache = CompressedCache(policy="recent", window=4, bits=4, group_size=16, transform="hadamard", backend="torch")
    cache.update(x, x, 0)
    with pytest.raises(NonFiniteError, match=r"Hadamard\(seed=0\) turned finite .* keys .*transform='none'"):
        cache.update(x[:, :, :1], x[:, :, :1], 0)
    x = torch.randn(1, 2, 40, 64).to(dtype)
    x[0, 0, 5, 7] = float("nan")
    cache = CompressedCache(policy="recent", window=4, bits=4, group_size=16, transform="hadamard", backend="torch")
    cache.update(x, x, 0)
    with pytest.raises(NonFiniteError, match="reached the quantizer"):
        cache.update(x[:, :, :1], x[:, :, :1], 0)


def test_a_float16_rotated_store_saves_and_loads_its_model_dtype(tmp_path):
    """The store records the model's dtype beside its float32 blocks: a loaded cache reads back float16,
    bit for bit; a state without it (saved when rotated tokens were held in the model's dtype) reads back
    in the dtype its blocks hold, and an unknown dtype name is refused."""
    x = _aligned(70, 64, 30000.0, 24, 0).half()
    cache = CompressedCache(policy="recent", window=4, bits=4, group_size=16, transform="hadamard", backend="torch")
    cache.update(x, x, 0)
    cache.update(x[:, :, :1], x[:, :, :1], 0)
    cache.save(tmp_path / "c")
    loaded = CompressedCache.load(tmp_path / "c")
    want, got = cache.layers[0].attention_view("ordered"), loaded.layers[0].attention_view("ordered")
    assert got[0].dtype == torch.float16 and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    basis = loaded.layers[0].engine.held.basis
    state = basis.state_dict()
    assert state["dtype"] == "float16"
    basis.load_state_dict({**state, "dtype": None}, x.device)
    assert _held_keys(loaded.layers[0].engine).dtype == torch.float32  # what its blocks hold
    with pytest.raises(ValueError, match=r"dtype must be one of \[.*'float16'.*\]; got dtype='int8'"):
        basis.load_state_dict({**state, "dtype": "int8"}, x.device)


def _held_keys(engine) -> torch.Tensor:
    """The demoted keys of a layer's engine in the model's basis (its store's, through its basis)."""
    store, basis = engine.held.store, engine.held.basis
    return store.keys() if basis is None else basis.unmap_keys(store.keys(), store.positions)


def test_check_basis_catches_a_basis_that_breaks_the_seam():
    """The seam half of check_transform fails a bound basis whose fused reading disagrees with its materialised
    one (a query left in the model's basis), or whose state does not survive saving."""
    from kvpolicy.testing import check_basis
    from kvpolicy.transforms.base import Basis

    class Unrotated(Basis):
        def map_query(self, query):
            return query.float()

    class Forgetful(Basis):
        def state_dict(self):
            return {"dims": None, "dtype": None}

    check_basis(Hadamard(), 64)
    for broken, error, match in ((Unrotated, AssertionError, "fused attention"), (Forgetful, ValueError, "dims")):
        transform = Hadamard()
        object.__setattr__(transform, "bind", lambda context, t=transform, b=broken: b(t))
        with pytest.raises(error, match=match):
            check_basis(transform, 64)


# ------------------------------------------------------------------ the bind context


@dataclass(frozen=True)
class _Recording(Hadamard):
    """The Hadamard, recording the context of every bind (in a list shared by its copies)."""

    seen: list = dataclass_field(default_factory=list, compare=False, hash=False, repr=False)

    def bind(self, context: BindContext):
        self.seen.append(context)
        return super().bind(context)


@pytest.mark.parametrize("padded", [False, True], ids=["batch", "left-padded"])
def test_every_layer_binds_with_its_own_context(padded):
    """Each compressed layer binds once (a left-padded batch: once per row) with its index, shapes, dtype,
    device and the model's identity, all from the one place that builds it."""
    from kvpolicy.tiny import random_model

    model = random_model("qwen2", layers=3)
    transform = _Recording()
    cache = CompressedCache.for_model(model, transform=transform, policy="log", window=4, bits=4, group_size=16)
    ids = torch.randint(3, 96, (2, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :3] = 0
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=2, do_sample=False)
    config = model.config
    want = [i for i in range(3) for _ in range(3 if padded else 1)]  # a padded batch: the head and each row
    assert sorted(c.layer_idx for c in transform.seen) == want
    for c in transform.seen:
        assert (c.num_layers, c.model_type, c.name_or_path) == (3, "qwen2", config.name_or_path)
        assert (c.num_kv_heads, c.key_head_dim, c.value_head_dim) == (config.num_key_value_heads, 64, 64)
        assert (c.dtype, c.device, c.config) == (torch.float32, torch.device("cpu"), config)


def test_a_cache_built_without_a_config_binds_with_no_model_identity():
    from kvpolicy.tiny import random_model

    model = random_model("llama")
    transform = _Recording()
    cache = CompressedCache(transform=transform, policy="log", window=4, bits=4, group_size=16)
    with torch.no_grad():
        model(input_ids=torch.randint(3, 96, (1, 12)), cache=cache, use_cache=True)
    assert [c.layer_idx for c in transform.seen] == [0, 1]
    assert all(c.num_layers is None and c.model_type is None and c.config is None for c in transform.seen)
