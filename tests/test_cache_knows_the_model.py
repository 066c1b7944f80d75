"""A cache that fits the model it serves: defaults that work with every backend and head dim, and
sliding-window layers found without the user passing ``config=``.

- Defaults a backend cannot serve are replaced (a backend that fits no key ranges gets min-max keys),
  defaults a head dim cannot serve too (value groups of 64 channels on head dims 32, 48, 80, 96);
  ``repr(cache)`` says so (``adapted=[...]``), and the same values given explicitly still raise.
- ``CompressedCache.for_model`` reads the model's config; a cache built without it on a model with
  sliding layers warns once, with the remedy, when kvpolicy's forward hook sees the model.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import tiny_gemma3
from transformers import LlamaConfig, LlamaForCausalLM

from kvpolicy import CompressedCache, ConfigError, LogWindow, Quantize, Tiered, registry
from kvpolicy.backends._optional import refuse_fitted_ranges
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.fused import disable_fused, enable_fused
from kvpolicy.hookspecs import hookimpl

pytestmark = pytest.mark.usefixtures("one_thread")


def _feed(cache: CompressedCache, keys: torch.Tensor, values: torch.Tensor, layers: int = 1) -> None:
    """A prompt of ``keys``/``values`` (``(1, H, T, D)``) into ``layers`` layers, then released."""
    for i in range(layers):
        cache.update(keys, values, i)
    cache.release_forward()


def _step(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The widest min-max step any group along ``dim`` of ``x`` can have: the range over the whole
    axis divided by the code count (a group's own range is at most that)."""
    span = x.amax(dim=dim, keepdim=True) - x.amin(dim=dim, keepdim=True)
    return span / (2**bits - 1)


# ---------------------------------------------------------------------------------------- backends
class _NoFittedRanges(TorchBackend):
    """The torch backend refusing fitted ranges, as a backend whose library chooses every group's range does."""

    name = "no-fitted-ranges"

    def check_format(self, fmt, role=""):
        super().check_format(fmt, role)
        refuse_fitted_ranges(self.name, fmt, role)


class _Plugin:
    @hookimpl
    def kvpolicy_register_backends(self):
        return {_NoFittedRanges.name: _NoFittedRanges}


@pytest.fixture
def no_fitted_ranges():
    """The name of a backend that fits no ranges, registered as a plugin's for the test."""
    plugin = _Plugin()
    registry.register(plugin, "no-fitted-ranges")
    yield _NoFittedRanges.name
    registry.unregister(plugin)


def test_a_backend_without_range_fitting_takes_the_defaults_with_min_max_keys(no_fitted_ranges):
    cache = CompressedCache(backend=no_fitted_ranges)
    assert cache.action.keys.fit == "minmax" and cache.action.values.fit == "minmax"
    assert "adapted=" in repr(cache) and "key_fit='minmax'" in repr(cache) and repr(no_fitted_ranges) in repr(cache)
    # the torch backend keeps its default (fitted keys), and says nothing
    torch_cache = CompressedCache(backend="torch")
    assert torch_cache.action.keys.fit == "mse" and "adapted" not in repr(torch_cache)


@pytest.mark.parametrize("given", [{"key_fit": "mse"}, {"fit": "mse"}])
def test_an_explicit_fit_the_backend_lacks_still_raises(no_fitted_ranges, given):
    with pytest.raises(ConfigError, match=rf"backend {no_fitted_ranges!r} does not fit min-max ranges"):
        CompressedCache(backend=no_fitted_ranges, **given)


def test_tiers_are_adapted_one_by_one(no_fitted_ranges):
    action = Tiered(tiers=[Quantize(bits=4, key_axis="token"), Quantize(bits=2)], keep=[LogWindow(8)])
    cache = CompressedCache(action=action, backend=no_fitted_ranges)
    assert [t.keys.fit for t in cache.action.tiers] == ["minmax", "minmax"]
    assert "tiers[0].key_fit='minmax'" in repr(cache) and "tiers[1].key_fit='minmax'" in repr(cache)


# ---------------------------------------------------------------------------------------- head dims
def _llama(head_dim: int) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=2 * head_dim, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=head_dim,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize(("head_dim", "group"), [(32, 32), (48, 48), (80, 40), (96, 48)])
def test_the_default_cache_serves_small_and_odd_head_dims(head_dim, group):
    model = _llama(head_dim)
    ids = torch.randint(0, 64, (1, 600))
    cache = CompressedCache()
    with torch.no_grad():
        fused_out = None
        enable_fused(model)
        try:
            fused_out = model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False)
        finally:
            disable_fused(model)
    assert [layer.engine.action.values.group_size for layer in cache.layers] == [group, group]
    assert f"value_group_size={group} (the default 64 does not divide the value head_dim {head_dim})" in repr(cache)
    assert cache.memory_report().bits_per_element_16bit < 8  # it compresses (16 bits at full precision)
    assert set(cache.attention_paths().values()) == {"fused (cpu)"}
    # the materialised path gives the same tokens
    again = CompressedCache(attention="materialized")
    with torch.no_grad():
        plain_out = model.generate(ids, cache=again, max_new_tokens=4, do_sample=False)
    assert torch.equal(fused_out, plain_out)


def test_a_config_shows_the_adapted_group_before_the_first_update():
    model = _llama(80)
    cache = CompressedCache.for_model(model)
    assert "value_group_size=40" in repr(cache)


@pytest.mark.parametrize("given", [{"group_size": 64}, {"value_group_size": 64}])
def test_an_explicit_group_that_does_not_divide_the_head_dim_still_raises(given):
    cache = CompressedCache(**given, key_group_size=128) if "value_group_size" in given else CompressedCache(**given)
    with pytest.raises(ConfigError, match=r"does not divide"):
        cache.update(torch.randn(1, 1, 4, 48), torch.randn(1, 1, 4, 48), 0)


def test_a_head_dim_no_group_divides_keeps_the_clear_error():
    # 2 channels: no multiple of the backend's granularity (4) divides it, so nothing is adapted
    with pytest.raises(ConfigError, match=r"does not divide"):
        CompressedCache(backend="torch").update(torch.randn(1, 1, 4, 2), torch.randn(1, 1, 4, 2), 0)


def test_a_loaded_cache_keeps_the_adapted_group(tmp_path):
    torch.manual_seed(1)
    keys, values = torch.randn(1, 1, 300, 48), torch.randn(1, 1, 300, 48)
    cache = CompressedCache(backend="torch")
    _feed(cache, keys, values, layers=2)
    path = tmp_path / "c.kvc"
    cache.save(path)
    copy = CompressedCache.load(path)
    assert [layer.engine.action.values.group_size for layer in copy.layers] == [48, 48]
    nxt = torch.randn(1, 1, 1, 48), torch.randn(1, 1, 1, 48)
    for i in range(2):
        a, b = cache.update(*nxt, i), copy.update(*nxt, i)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------------------------------- the model
def test_for_model_leaves_sliding_layers_to_transformers():
    model = tiny_gemma3()
    ids = torch.randint(0, 96, (1, 120))
    built = CompressedCache.for_model(model, policy="log", window=8, bits=2)
    by_hand = CompressedCache(config=model.config, policy="log", window=8, bits=2)
    with torch.no_grad():
        for cache in (built, by_hand):
            model(ids, cache=cache, use_cache=True)
    assert [type(layer).__name__ for layer in built.layers] == [type(layer).__name__ for layer in by_hand.layers]
    assert built.memory_report().total_bytes == by_hand.memory_report().total_bytes
    assert sum(type(layer).__name__ == "CompressedLayer" for layer in built.layers) == 1


def test_for_model_takes_a_preset_or_a_preset_file():
    model = tiny_gemma3()
    preset = CompressedCache.for_model(model, "kvpolicy-3bit")
    assert repr(preset) == repr(CompressedCache.from_preset("kvpolicy-3bit", config=model.config))
    shipped = CompressedCache.for_model(model, "smollm2-8k-2.5bit")
    assert isinstance(shipped.action, Tiered)
    with pytest.raises(ConfigError, match="drop config="):
        CompressedCache.for_model(model, config=model.config)


def test_for_model_refuses_what_it_cannot_compress_naming_the_model_class():
    class NotAModel(torch.nn.Module):
        pass

    with pytest.raises(ConfigError, match="a NotAModel has no transformers config"):
        CompressedCache.for_model(NotAModel())
    model = tiny_gemma3(layer_types=["sliding_attention"] * 6)
    with pytest.raises(ConfigError, match=r"Gemma3ForCausalLM has no full-attention layer"):
        CompressedCache.for_model(model)
    model = _llama(64)
    model.config.layer_types = ["full_attention", "warp_attention"]
    with pytest.raises(ConfigError, match=r"LlamaForCausalLM has layers of type\(s\) \['warp_attention'\]"):
        CompressedCache.for_model(model)


def test_a_cache_without_config_on_a_sliding_model_warns_once_with_the_remedy():
    model = tiny_gemma3()
    ids = torch.randint(0, 96, (1, 40))
    cache = CompressedCache(policy="log", window=8, bits=2)
    enable_fused(model)
    try:
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.generate(ids, cache=cache, max_new_tokens=3, do_sample=False)
    finally:
        disable_fused(model)
    ours = [w for w in caught if "built without config=" in str(w.message)]
    assert len(ours) == 1
    assert "sliding_attention" in str(ours[0].message) and "CompressedCache.for_model(model" in str(ours[0].message)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_cache_without_config_warns_once_on_a_plain_generate_too(attn):
    """No kvpolicy attention and no hook: the first update sees the calling attention module's config."""
    model = tiny_gemma3()
    model.set_attn_implementation(attn)
    ids = torch.randint(0, 96, (1, 40))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(ids, cache=CompressedCache(policy="log", window=8, bits=2), max_new_tokens=3, do_sample=False)
        model(ids, cache=CompressedCache(policy="log", window=8, bits=2), use_cache=True)  # a plain forward
    ours = [str(w.message) for w in caught if "built without config=" in str(w.message)]
    assert len(ours) == 2 and all("gemma3_text model" in m and "for_model" in m for m in ours)


def test_a_full_attention_model_never_warns():
    model = _llama(64)
    ids = torch.randint(0, 64, (1, 40))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*built without config=.*")
        model.generate(ids, cache=CompressedCache(), max_new_tokens=3, do_sample=False)


def test_a_cache_built_for_the_model_does_not_warn():
    model = tiny_gemma3()
    ids = torch.randint(0, 96, (1, 40))
    cache = CompressedCache.for_model(model, policy="log", window=8, bits=2)
    enable_fused(model)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*built without config=.*")
            model.generate(ids, cache=cache, max_new_tokens=3, do_sample=False)
    finally:
        disable_fused(model)


# ---------------------------------------------------------------------------------------- shipped preset files
def test_shipped_preset_files_load_by_name_and_misspellings_get_a_suggestion():
    from kvpolicy import preset_files

    assert preset_files.names() == ["gemma3-270m-3.5bit", "smollm2-3bit", "smollm2-8k-2.5bit"]
    # the tuned file holds 16-bit codebook scales; the preset the same composition with one-byte scales
    want = CompressedCache.from_preset("kvpolicy-3bit", norm_bits=16)
    assert repr(CompressedCache.from_config("smollm2-3bit")) == repr(want)
    with pytest.raises(ConfigError, match=r"did you mean 'smollm2-3bit'\?"):
        CompressedCache.from_config("smollm2-3bits")
    with pytest.raises(ConfigError, match=r"preset file 'no/such/file.toml' does not exist"):
        CompressedCache.from_config("no/such/file.toml")
