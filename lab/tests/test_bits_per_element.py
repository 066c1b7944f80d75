"""Bits per element (issue 11, item 1): as held, and with full-precision tensors counted at 16 bits."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig

from kvpolicy import CompressedCache
from kvpolicy.memory import LayerBytes, MemoryReport
from kvpolicy_lab.eval.caches import baseline_bytes, held_bytes


def _fill(cache, dtype, layers=3, tokens=300, steps=5):
    g = torch.Generator().manual_seed(0)
    for n in (tokens,) + (1,) * steps:
        for layer in range(layers):
            k = torch.randn(1, 2, n, 32, generator=g).to(dtype)
            v = torch.randn(1, 2, n, 32, generator=g).to(dtype)
            cache.update(k, v, layer)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(policy="log", window=8, action="quantize", bits=2, group_size=16),
        dict(policy="recent", window=16, action="quantize", bits=4, group_size=16),
        dict(policy="log", window=8, action="none"),
    ],
)
def test_bits_per_element_is_eight_bytes_held_per_element(kwargs):
    cache = CompressedCache(**kwargs)
    _fill(cache, torch.float16)
    report = cache.memory_report()
    elements = 305 * 3 * 2 * (32 + 32)
    assert report.bits_per_element == pytest.approx(8 * report.total_bytes / elements)
    assert report.bits_per_element == pytest.approx(16 / report.ratio)
    # a 16-bit model: nothing to re-count
    assert report.bits_per_element_16bit == report.bits_per_element


@pytest.mark.parametrize("policy", ["log", "recent", "sink"])
def test_sixteen_bit_figure_of_an_fp32_cache_is_what_the_fp16_cache_holds(policy):
    """Codes, 16-bit metadata and positions do not depend on the model's dtype; only the
    full-precision window and the staging do, and those are what the 16-bit figure re-counts."""
    caches = {}
    for dtype in (torch.float32, torch.float16):
        caches[dtype] = CompressedCache(policy=policy, window=8, action="quantize", bits=2, group_size=16)
        _fill(caches[dtype], dtype)
    wide, narrow = (caches[d].memory_report() for d in (torch.float32, torch.float16))
    assert wide.total_bytes > narrow.total_bytes
    assert wide.total_bytes_16bit == narrow.total_bytes
    assert wide.bits_per_element_16bit == pytest.approx(narrow.bits_per_element)
    assert "with full-precision tensors at 16 bits" in str(wide)
    assert "with full-precision tensors at 16 bits" not in str(narrow)


def test_layer_bytes_sixteen_bit_arithmetic():
    layer = LayerBytes(0, 10, {"full_precision": 400, "codes": 30, "staging": 40, "positions": 8}, 1000, 4)
    assert layer.total_bytes_16bit == 200 + 30 + 20 + 8
    report = MemoryReport([layer])
    assert report.bits_per_element == pytest.approx(16 * 478 / 1000)
    assert report.bits_per_element_16bit == pytest.approx(16 * 258 / 1000)
    assert MemoryReport([]).bits_per_element != MemoryReport([]).bits_per_element  # nan when empty


def test_held_bytes_at_16bit_for_caches_kvpolicy_does_not_own():
    cfg = LlamaConfig(num_hidden_layers=3, num_key_value_heads=2, num_attention_heads=2, hidden_size=64)
    held = {}
    for dtype in (torch.float32, torch.float16):
        cache = DynamicCache()
        _fill(cache, dtype)
        held[dtype] = (held_bytes(cache), held_bytes(cache, at_16bit=True))
    assert held[torch.float32][0] == 2 * held[torch.float16][0]
    assert held[torch.float32][1] == held[torch.float16][0] == held[torch.float16][1]
    assert held[torch.float16][0] == baseline_bytes(cfg, 305)  # a 16-bit DynamicCache is the baseline
