"""Layers kvpolicy does not own: transformers' sliding, chunked, linear-attention, convolution and state-space
layers of hybrid models, and models with no full-attention layer at all.

``memory_report()`` counts what each such layer holds (its keys and values, or its conv and recurrent states)
as kept by transformers, and never fails on a layer kind it does not know; ``for_model`` with ``action="none"``
serves a model whose layers are all sliding-window, exactly as ``DynamicCache`` does.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import tiny_qwen3_next_config
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING

from kvpolicy import CompressedCache
from kvpolicy.cache import _layer_memory, held_tensors
from kvpolicy.errors import ConfigError
from kvpolicy.tiny import tiny_gemma3

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(name: str):
    """Tiny configs of hybrid models transformers ships: each mixes full attention with another layer kind."""
    import transformers as tf

    if name == "qwen3_next":  # three gated-delta-net (linear attention) layers, then one full
        cfg = tiny_qwen3_next_config()
        cfg.num_hidden_layers = 4
        cfg.layer_types = ["linear_attention"] * 3 + ["full_attention"]
        return cfg
    if name == "lfm2":  # short convolutions ("conv" layers)
        return tf.Lfm2Config(
            vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, layer_types=["conv", "full_attention", "conv"],
        )  # fmt: skip
    if name == "jamba":  # a Mamba layer (held as linear attention: conv and SSM states), then attention
        return tf.JambaConfig(
            vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
            expert_layer_offset=1, num_experts=2, mamba_d_state=8, mamba_dt_rank=8, mamba_expand=2,
        )  # fmt: skip
    if name == "llama4":  # chunked attention (a window that restarts every chunk), then full
        return tf.Llama4TextConfig(
            vocab_size=96, hidden_size=64, intermediate_size=96, intermediate_size_mlp=96, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, attention_chunk_size=8, num_local_experts=1,
            layer_types=["chunked_attention", "full_attention"], no_rope_layers=[1, 1], moe_layers=[],
        )  # fmt: skip
    raise AssertionError(name)


def _model(name: str) -> torch.nn.Module:
    if name == "gemma3":
        return tiny_gemma3()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reference kernels of the linear layers
        return AutoModelForCausalLM.from_config(_config(name)).eval()


def _expected_bytes(layer) -> int:
    """What a transformers layer holds, read off the attributes its class documents."""
    held = []
    for name in ("keys", "values", "indexer_keys"):
        t = getattr(layer, name, None)
        if isinstance(t, torch.Tensor):
            held.append(t)
    for states in ("conv_states", "recurrent_states"):
        held += [t for t in getattr(layer, states, {}).values() if t is not None]
    return sum(t.numel() * t.element_size() for t in held)


@pytest.mark.parametrize("name", ["qwen3_next", "lfm2", "jamba", "llama4", "gemma3"])
def test_memory_report_counts_what_each_layer_left_to_transformers_holds(name):
    model = _model(name)
    cache = CompressedCache.for_model(model, window=4, bits=4, group_size=16)
    ids = torch.randint(3, 96, (2, 20), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.generate(ids, cache=cache, max_new_tokens=3, do_sample=False)
    report = cache.memory_report()
    others = [i for i, layer in enumerate(cache.layers) if not isinstance(layer, CompressedCache.layer_class)]
    assert others and report.compressed_layers == [i for i in range(len(cache.layers)) if i not in others]
    for i in others:
        layer, entry = cache.layers[i], report.layers[i]
        assert entry.kind == type(layer).__name__
        assert entry.total_bytes == entry.segments["full_precision"] == _expected_bytes(layer) > 0
        assert entry.tokens == 22  # 20 prompt tokens and 2 fed back
        assert entry.element_size == 4  # float32 model
        assert entry.baseline_bytes == entry.total_bytes // 2  # the same elements at 16 bits
    assert f"left to transformers ({type(cache.layers[others[0]]).__name__}" in str(report)


def test_a_hybrid_qwen3_next_reports_its_linear_attention_states():
    """Three linear-attention layers and one full: the report has all four, the full one compressed."""
    model = _model("qwen3_next")
    cache = CompressedCache.for_model(model, window=4, bits=4, group_size=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.generate(torch.randint(3, 96, (1, 24)), cache=cache, max_new_tokens=4, do_sample=False)
    report = cache.memory_report()
    assert [entry.kind for entry in report.layers] == ["LinearAttentionLayer"] * 3 + ["compressed"]
    for layer, entry in zip(cache.layers[:3], report.layers[:3], strict=True):
        conv, recurrent = layer.conv_states[0], layer.recurrent_states[0]
        assert entry.total_bytes == conv.numel() * 4 + recurrent.numel() * 4
    assert report.layers[3].segments["codes"] > 0


def _fed(kind: str, layer_class: type):
    """A layer of ``layer_class`` (transformers' class for layer type ``kind``) after one update of each state it
    keeps: keys and values for attention layers, conv and recurrent states for linear ones."""
    kwargs = {"sliding_window": 4} if "sliding" in kind or kind == "chunked_attention" else {}
    layer = layer_class(**kwargs)
    keys, values = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    if hasattr(layer, "update_conv_state"):
        layer.update_conv_state(torch.randn(1, 16, 3))
        layer.update_recurrent_state(torch.randn(1, 2, 8, 8))
    if hasattr(layer, "update") and kind not in ("dummy", "conv", "linear_attention"):
        layer.update(keys, values)
    return layer


@pytest.mark.parametrize("kind", sorted(DYNAMIC_LAYER_TYPE_MAPPING))
def test_every_transformers_layer_kind_is_reported_fresh_and_fed(kind):
    layer_class = DYNAMIC_LAYER_TYPE_MAPPING[kind]
    kwargs = {"sliding_window": 4} if "sliding" in kind or kind == "chunked_attention" else {}
    fresh = _layer_memory(layer_class(**kwargs), 0, set())
    assert fresh.total_bytes == fresh.baseline_bytes == 0 and fresh.kind == layer_class.__name__
    layer = _fed(kind, layer_class)
    entry = _layer_memory(layer, 3, set())
    assert entry.layer_idx == 3 and entry.total_bytes == _expected_bytes(layer)
    assert (entry.total_bytes > 0) == (kind != "dummy")


def test_a_layer_of_an_unknown_kind_is_counted_and_never_fails():
    class Odd:
        """A layer from some other library: states in nested containers, a length it cannot tell."""

        def __init__(self):
            self.state = {"a": [torch.zeros(3, 4), (torch.zeros(2, dtype=torch.int64),)]}
            self.counter = torch.tensor(7)  # bookkeeping, not held state
            self.itself = self.state  # the same container twice: counted once

        def get_seq_length(self):
            raise RuntimeError("no idea")

    entry = _layer_memory(Odd(), 1, set())
    assert entry.tokens == 0 and entry.kind == "Odd"
    assert entry.total_bytes == 3 * 4 * 4 + 2 * 8
    assert entry.baseline_bytes == 3 * 4 * 2 + 2 * 8  # floating elements at 16 bits, integers as held
    assert held_tensors(object()) == []  # nothing to walk: nothing held


# ---------------------------------------------------------------------- a model without full attention
def test_for_model_serves_an_all_sliding_model_with_action_none_as_dynamic_cache():
    model = tiny_gemma3(layer_types=["sliding_attention"] * 6)
    ids = torch.randint(3, 96, (2, 30), generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: the cache holds what DynamicCache holds, as asked
        cache = CompressedCache.for_model(model, action="none")
    want = model.generate(ids, cache=DynamicCache(config=model.config), max_new_tokens=8, do_sample=False,
                          output_scores=True, return_dict_in_generate=True)  # fmt: skip
    got = model.generate(ids, cache=cache, max_new_tokens=8, do_sample=False, output_scores=True,
                         return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.scores, want.scores, strict=True))
    report = cache.memory_report()
    assert report.compressed_layers == [] and report.bits_per_element_16bit == pytest.approx(16.0)


@pytest.mark.parametrize("keywords", [{}, {"bits": 2}, {"preset": "kivi"}])
def test_for_model_refuses_to_compress_a_model_without_full_attention_naming_the_remedy(keywords):
    model = tiny_gemma3(layer_types=["sliding_attention"] * 6)
    with pytest.raises(ConfigError, match=r"no full-attention layer.*action='none'"):
        CompressedCache.for_model(model, **keywords)
