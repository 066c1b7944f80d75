"""Per-layer precision: ``CompressedCache(..., layer_bits={...})`` and ``kvpolicy.layer_bits.boundary``."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import teacher_forced_logits, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy import CompressedCache
from kvpolicy.actions.quantize import Quantize
from kvpolicy.errors import ConfigError
from kvpolicy.layer_bits import boundary, normalize, resolve

LAYERS = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=LAYERS)


def _run(model, cache, length: int = 80, seed: int = 3):
    ids = torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(seed))
    return teacher_forced_logits(model, ids, 40, cache)


def test_boundary_names_the_first_and_last_layers():
    assert boundary(2, 2, 4) == {0: 4, 1: 4, -2: 4, -1: 4}
    assert boundary(1, 0, (4, 2)) == {0: (4, 2)}
    assert resolve(normalize(boundary(2, 2, 4)), 30) == {0: (4, 4), 1: (4, 4), 28: (4, 4), 29: (4, 4)}


def test_each_layer_gets_its_widths_and_the_rest_the_action(model):
    cache = CompressedCache(
        policy="log", window=8, bits=2, group_size=16, layer_bits={0: 4, -1: (4, 3)}, config=model.config
    )
    _run(model, cache)
    widths = [(layer.engine.action.keys.bits, layer.engine.action.values.bits) for layer in cache.layers]
    assert widths == [(4, 4), (2, 2), (2, 2), (4, 3)]
    assert all(layer.engine.action.keys.group_size == 16 for layer in cache.layers)  # everything else is the action's
    assert cache.layer_bits == {0: (4, 4), 3: (4, 3)}
    assert "layer_bits={0: (4, 4), 3: (4, 3)}" in repr(cache)


@pytest.fixture(scope="module")
def uniform_layers(model):
    """The per-layer memory report of a uniform cache at ``bits`` (run once per width: the runs are
    deterministic, the same model and tokens for every example)."""
    reports = {}

    def get(bits: int):
        if bits not in reports:
            uniform = CompressedCache(policy="log", window=8, bits=bits, group_size=16, backend="torch")
            _run(model, uniform)
            reports[bits] = uniform.memory_report().layers
        return reports[bits]

    return get


@settings(max_examples=15, deadline=None)
@given(widths=st.dictionaries(st.integers(0, LAYERS - 1), st.sampled_from([2, 3, 4]), max_size=LAYERS))
def test_bytes_held_per_layer_equal_a_uniform_cache_at_that_layers_widths(model, uniform_layers, widths):
    """Layer ``i`` of a mixed cache holds exactly the bytes of layer ``i`` of a uniform cache at its
    widths (same policy, same tokens): the map changes widths and nothing else."""
    mixed = CompressedCache(policy="log", window=8, bits=2, group_size=16, layer_bits=widths, backend="torch")
    _run(model, mixed)
    got = mixed.memory_report().layers
    for bits in {2, *widths.values()}:
        want = uniform_layers(bits)
        for i in range(LAYERS):
            if widths.get(i, 2) == bits:
                assert got[i].segments == want[i].segments, (i, bits)


def test_higher_bits_on_some_layers_move_logits_towards_uncompressed(model):
    ref = _run(model, CompressedCache(action="none"))

    def kl(cache):
        p, q = torch.log_softmax(ref, -1), torch.log_softmax(_run(model, cache), -1)
        return float((p.exp() * (p - q)).sum(-1).mean())

    base = dict(policy="log", window=8, bits=2, group_size=16, backend="torch")
    assert kl(CompressedCache(**base, layer_bits=dict.fromkeys(range(LAYERS), 8))) < 0.1 * kl(CompressedCache(**base))


def test_fused_equals_materialized_with_mixed_layers(model, cpu_kernel):
    from kvpolicy.fused import disable_fused, enable_fused

    kw = dict(policy="log", window=8, bits=2, group_size=16, layer_bits={1: (4, 2), 3: 3}, backend="cpu")
    ref = _run(model, CompressedCache(**kw, attention="materialized"))
    enable_fused(model)
    try:
        cache = CompressedCache(**kw)
        got = _run(model, cache)
    finally:
        disable_fused(model)
    assert set(cache.attention_paths().values()) == {"fused (cpu)"}
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)


def test_saved_cache_keeps_its_layer_widths(model, tmp_path):
    cache = CompressedCache(
        policy="log", window=4, bits=2, group_size=16, layer_bits={0: 4, -1: 3}, config=model.config
    )
    ids = torch.randint(3, 96, (2, 50), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids[:, :40], cache=cache, use_cache=True)
    cache.save(tmp_path / "c.kvc", model=model)
    loaded = CompressedCache.load(tmp_path / "c.kvc", model=model)
    assert loaded.layer_bits == {0: (4, 4), 3: (3, 3)} and repr(loaded) == repr(cache)
    want = teacher_forced_logits(model, ids[:, 40:], 1, copy.deepcopy(cache))
    assert torch.equal(teacher_forced_logits(model, ids[:, 40:], 1, loaded), want)


def test_toml_style_string_keys_are_layer_indices():
    assert normalize({"0": 4, "-1": [4, 2]}) == {0: (4, 4), -1: (4, 2)}


def test_auto_backend_falls_back_to_torch_only_when_a_layer_needs_it(cpu_kernel):
    assert CompressedCache(policy="log", bits=2, layer_bits={0: 4}).backend.name == "cpu"
    assert CompressedCache(policy="log", bits=2, layer_bits={0: 8}).backend.name == "torch"  # 8 bits: torch only


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(bits=2, layer_bits={9: 4}), r"layer_bits names layer 9, but the model has 4 layers"),
        (dict(bits=2, layer_bits={-5: 4}), r"layer_bits names layer -5, but the model has 4 layers"),
        (dict(bits=2, layer_bits={0: "four"}), r"layer_bits\[0\] must be bits \(an int\) or \(key_bits, value_bits\)"),
        (dict(bits=2, layer_bits={"first": 4}), r"layer_bits keys must be layer indices"),
        (dict(bits=2, layer_bits={0: 4, -4: 3}), r"layer_bits names layer 0 twice"),
        (dict(bits=2, layer_bits={0: 5}, backend="cpu"), r"backend 'cpu' does not support bits=5"),
        (dict(layer_bits={0: 4}, action="evict"), r"action 'evict' has none"),
        (dict(bits=2, layer_bits=[4, 4]), r"layer_bits must map layer indices"),
    ],
)
def test_bad_maps_are_refused_naming_the_layer(model, kw, match):
    with pytest.raises(ConfigError, match=match):
        CompressedCache(policy="log", window=8, config=model.config, **kw)


def test_negative_indices_need_the_config():
    with pytest.raises(ConfigError, match=r"negative layer index -1 counts from the end.*config=model.config"):
        CompressedCache(policy="log", bits=2, layer_bits={-1: 4})


def test_without_config_a_layer_the_model_lacks_is_refused_on_the_second_forward(model):
    cache = CompressedCache(policy="log", window=8, bits=2, group_size=16, layer_bits={7: 4})
    ids = torch.randint(3, 96, (1, 20))
    with torch.no_grad():
        model(ids[:, :10], cache=cache, use_cache=True)
        with pytest.raises(ConfigError, match=r"layer_bits names layer\(s\) \[7\], but the model has 4 layers"):
            model(ids[:, 10:11], cache=cache, use_cache=True)


def test_a_sliding_layer_of_a_hybrid_model_is_refused():
    from test_policy_action_matrix import _gemma2

    gemma = _gemma2("eager")
    sliding = gemma.config.layer_types.index("sliding_attention")
    with pytest.raises(
        ConfigError, match=rf"layer_bits names layer\(s\) \[{sliding}\], which are \['sliding_attention'\]"
    ):
        CompressedCache(policy="log", bits=2, layer_bits={sliding: 4}, config=gemma.config)


def test_the_layer_actions_equal_quantize_at_those_widths():
    cache = CompressedCache(policy="log", bits=2, scheme="codebook", transform="hadamard", layer_bits={0: (3, 2)})
    assert cache.composition.layer_actions[0] == Quantize(key_bits=3, value_bits=2, scheme="codebook")
