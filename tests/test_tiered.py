"""Precision tiers: ``action=Tiered(tiers=[...], keep=[...])``."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import fused_and_materialized, teacher_forced_logits, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy import CacheSpec, CompressedCache
from kvpolicy.actions.quantize import Quantize
from kvpolicy.actions.tiered import Tiered
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.errors import ConfigError
from kvpolicy.policies import HeavyHitters, LogWindow, RecentWindow, log_full_positions
from kvpolicy.testing import chunkings

MIDDLE_CB = Quantize(bits=4, scheme="codebook")
BOTTOM = Quantize(bits=2, group_size=16)


def _tiers(cache: CompressedCache, layer: int = 0) -> tuple[list[int], list[list[int]]]:
    """Full-precision positions and each tier's positions (one row)."""
    full = cache.positions(layer)["full"].flatten().tolist()
    store = cache.layers[layer].engine.held.store
    store = getattr(store, "inner", store)  # behind a transform
    return full, [p[0].tolist() for p in store.tier_positions()]


def _feed(cache: CompressedCache, plan: list[int], seed: int = 0, d: int = 64) -> None:
    g = torch.Generator().manual_seed(seed)
    for n in plan:
        if n:
            k, v = torch.randn(1, 2, n, d, generator=g), torch.randn(1, 2, n, d, generator=g)
            cache.update(k, v, 0)
    cache.positions(0)  # settle deferred demotions


def _cache(window: int, keep: int, **kw) -> CompressedCache:
    action = Tiered(tiers=[MIDDLE_CB, BOTTOM], keep=[LogWindow(keep)])
    return CompressedCache(policy=LogWindow(window), action=action, transform="hadamard", backend="torch", **kw)


# ------------------------------------------------------------------ invariants


@settings(max_examples=40, deadline=None)
@given(window=st.integers(1, 8), keep=st.integers(1, 8), data=st.data())
def test_each_token_sits_in_exactly_one_tier_and_tiers_follow_the_keep_policy(window, keep, data):
    """Every position is in one of: full precision, the middle tier, the last tier. The middle tier
    holds the demoted tokens whose arrival index the keep policy keeps (the log rule over the order
    of demotion), the last tier the others."""
    plan = data.draw(chunkings(data.draw(st.integers(1, 150)), first_nonzero=True))
    cache = _cache(window, keep)
    state = LogWindow(window).new_state()
    demoted: list[int] = []
    for n in plan:
        demoted += state.append(n)
    _feed(cache, plan)
    full, (middle, bottom) = _tiers(cache)
    total = sum(plan)
    assert sorted(full + middle + bottom) == list(range(total))
    kept = set(log_full_positions(keep, len(demoted))) if demoted else set()
    assert sorted(middle) == sorted(p for j, p in enumerate(demoted) if j in kept)
    assert sorted(bottom) == sorted(p for j, p in enumerate(demoted) if j not in kept)


@settings(max_examples=30, deadline=None)
@given(window=st.integers(1, 6), keep=st.integers(1, 6), data=st.data())
def test_tokens_only_move_down(window, keep, data):
    plan = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=40))
    cache = _cache(window, keep)
    g = torch.Generator().manual_seed(1)
    level: dict[int, int] = {}
    for n in plan:
        cache.update(torch.randn(1, 2, n, 64, generator=g), torch.randn(1, 2, n, 64, generator=g), 0)
        full, tiers = _tiers(cache)
        now = {p: 0 for p in full} | {p: i + 1 for i, ps in enumerate(tiers) for p in ps}
        for p, was in level.items():
            assert now[p] >= was, (p, was, now[p])
        level = now


@pytest.mark.parametrize("plan", [[100], [30, *[1] * 50], [7, 13, 1, 1, 40]])
def test_bytes_held_equal_the_formula(plan):
    """Middle tier (4-bit codebook): ``D·4/8`` bytes of codes and a 2-byte scale per token, head and
    kind, plus a 4-byte arrival index; last tier (2-bit, per-token groups of 16): ``D·2/8`` bytes of
    codes and a 2-byte scale and minimum per group; 4-byte positions everywhere."""
    b, h, d = 1, 2, 64
    action = Tiered(tiers=[MIDDLE_CB, Quantize(bits=2, group_size=16, key_axis="token")], keep=[RecentWindow(6)])
    cache = CompressedCache(policy=LogWindow(4), action=action, transform="hadamard", backend="torch")
    _feed(cache, plan)
    _, (middle, bottom) = _tiers(cache)
    m, n = len(middle), len(bottom)
    seg = cache.layers[0].memory().segments
    assert seg["codes"] == 2 * b * h * (m * d * 4 // 8 + n * d * 2 // 8)
    assert seg["scales"] == 2 * b * h * (m * 2 + n * (d // 16) * 2)
    assert seg["zeros"] == 2 * b * h * n * (d // 16) * 2
    assert seg["staging"] == 0
    assert seg["positions"] == 4 * (len(cache.positions(0)["full"]) + m + n) + 4 * m


def test_a_token_moving_down_is_requantized_from_its_middle_tier_reconstruction():
    be = TorchBackend()
    per_token = dict(key_axis="token", group_size=16, fit="minmax")  # min-max like the reference below
    action = Tiered(tiers=[Quantize(bits=4, **per_token), Quantize(bits=2, **per_token)], keep=[RecentWindow(2)])
    store = action.new_store(be, 0)
    x = torch.randn(1, 1, 5, 64)
    store.positions = torch.empty(1, 0, dtype=torch.int32)
    store.add(x, x, torch.arange(5, dtype=torch.int32).view(1, -1))
    middle = be.dequantize(be.quantize(x, 4, 16, "token"))
    want = be.dequantize(be.quantize(middle[:, :, :3], 2, 16, "token"))
    assert store.bottom.positions.tolist() == [[0, 1, 2]]
    assert torch.equal(store.bottom.keys(), want)
    assert torch.equal(store.middles[0].inner.keys(), middle[:, :, 3:])


# ------------------------------------------------------------------ in a model


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_fused_equals_materialized_across_tier_moves(backend, cpu_kernel):
    got, ref, cache = fused_and_materialized(
        length=120, group_size=None, action="tiered", keep=[{"name": "log", "window": 8}], transform="hadamard",
        tiers=[{"bits": 4, "scheme": "codebook"}, {"bits": 2, "group_size": 16}], backend=backend,
    )  # fmt: skip
    assert set(cache.attention_paths().values()) == {f"fused ({backend})"}
    _, (middle, bottom) = _tiers(cache)
    assert middle and bottom  # both tiers in use
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)


def test_three_tiers_hold_the_middle_between_the_ends():
    """8-bit, then 4-bit, then 2-bit: the mean error of each tier's reconstruction grows downward."""
    action = Tiered(
        tiers=[Quantize(bits=8, key_axis="token", group_size=16), Quantize(bits=4, scheme="codebook"), BOTTOM],
        keep=[RecentWindow(10), RecentWindow(10)],
    )
    cache = CompressedCache(policy=LogWindow(4), action=action, transform="hadamard", backend="torch")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 100, 64, generator=g)
    cache.update(x, x, 0)
    cache.update(x[:, :, :1], x[:, :, :1], 0)
    store = cache.layers[0].engine.held.store
    errors = []
    for tier in [*store.middles, None]:
        inner = store.bottom if tier is None else tier.inner
        pos = inner.positions[0].long()
        got = cache.layers[0].engine.held.basis.transform.inverse(inner.keys())
        errors.append(float((got - x[:, :, pos]).pow(2).mean()))
    assert len(store.middles) == 2 and errors[0] < errors[1] < errors[2]


def test_saved_cache_continues_identically(tmp_path):
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (2, 90), generator=torch.Generator().manual_seed(2))
    cache = _cache(4, 4)
    with torch.no_grad():
        model(ids[:, :60], cache=cache, use_cache=True)
        for t in range(60, 75):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
    cache.save(tmp_path / "c.kvc", model=model)
    loaded = CompressedCache.load(tmp_path / "c.kvc", model=model)
    assert loaded.action == cache.action and repr(loaded) == repr(cache)
    want = teacher_forced_logits(model, ids[:, 75:], 1, copy.deepcopy(cache))
    assert torch.equal(teacher_forced_logits(model, ids[:, 75:], 1, loaded), want)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(tiers=[Quantize(bits=2, key_axis="token"), Quantize(bits=4)], keep=[LogWindow(4)]),
         r"tier widths may not increase downward; tiers\[1\] has key_bits=4 below tiers\[0\] with key_bits=2"),
        (dict(tiers=[Quantize(bits=4), BOTTOM], keep=[LogWindow(4)]),
         r"tiers\[0\] is a middle tier.*keys must be grouped per token.*got key_axis='channel'"),
        (dict(tiers=[MIDDLE_CB, BOTTOM], keep=[HeavyHitters(2, 2)]),
         r"keep\[0\]=HeavyHitters.*shared and data-independent"),
        (dict(tiers=[MIDDLE_CB, BOTTOM], keep=[]), r"keep needs one policy per tier but the last \(1\); got 0"),
        (dict(tiers=[BOTTOM], keep=[]), r"at least two tiers"),
        (dict(tiers=[{"bitz": 4}, BOTTOM], keep=[LogWindow(4)]), r"tiers\[0\]=\{'bitz': 4\}"),
        (dict(tiers=[MIDDLE_CB, BOTTOM], keep=[{"name": "log", "window": 8}]),
         r"keep\[0\]=\{'name': 'log', 'window': 8\} is a policy by name; names become policies in CacheSpec.resolve"),
        (dict(tiers=[MIDDLE_CB, BOTTOM], keep=LogWindow(4)), r"keep must be a list of policies"),
    ],
)  # fmt: skip
def test_bad_tiers_are_refused_naming_them(kw, match):
    with pytest.raises(ConfigError, match=match):
        Tiered(**kw)


@pytest.mark.parametrize(
    "keep, match",
    [
        ([{"name": "nope"}], r"unknown policy 'nope'; registered policies"),
        ([{"name": "log", "windw": 8}], r"Tiered: keep\[0\]=\{'name': 'log', 'windw': 8\}: .*windw"),
    ],
)
def test_keep_policies_by_name_are_resolved_by_the_spec(keep, match):
    assert CacheSpec.resolve(action="tiered", tiers=[MIDDLE_CB, BOTTOM], keep=[{"name": "log", "window": 8}],
                             transform="hadamard").action.keep == (LogWindow(8),)  # fmt: skip
    with pytest.raises(ConfigError, match=match):
        CacheSpec.resolve(action="tiered", tiers=[MIDDLE_CB, BOTTOM], keep=keep)


def test_a_codebook_tier_without_rotation_and_a_backend_without_a_width_are_refused():
    action = Tiered(tiers=[MIDDLE_CB, BOTTOM], keep=[LogWindow(4)])
    with pytest.raises(ConfigError, match=r"scheme='codebook'.*transform='hadamard'"):
        CompressedCache(policy="log", action=action)
    eight = Tiered(tiers=[Quantize(bits=8, key_axis="token"), BOTTOM], keep=[LogWindow(4)])
    with pytest.raises(ConfigError, match=r"backend 'cpu' does not support bits=8"):
        CompressedCache(policy="log", action=eight, backend="cpu")
