"""Bounded memory over an 8k-token teacher-forced decode (one step at a time) on a tiny model."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvpolicy import CompressedCache

STEPS = 8192


@pytest.fixture(scope="module")
def one_layer_model() -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=STEPS + 64, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


@torch.inference_mode()
def _decode(model, cache, check) -> None:
    ids = torch.randint(0, 64, (1, STEPS), generator=torch.Generator().manual_seed(0))
    model(ids[:, :16], cache=cache, use_cache=True)
    for t in range(16, STEPS):
        model(ids[:, t : t + 1], cache=cache, use_cache=True)
        check(t + 1, cache)


@pytest.mark.slow
def test_log_quantize_8k_full_precision_bounded_and_bytes_linear(one_layer_model):
    window, group = 16, 16
    cache = CompressedCache(policy="log", window=window, action="quantize", bits=2, group_size=group)
    # per compressed token (1 head, head_dim 64, 2 bits): keys per channel 16 B codes + 64 channels x 4 B of
    # scale/min per 16 tokens = 16 B; values per token 16 B codes + 4 groups x 4 B = 16 B; position 4 B (int32)
    per_token = 16 + 16 + 16 + 16 + 4
    worst = {"fp": 0}

    def check(length, cache):
        layer = cache.layers[0]
        n_full = layer.engine.held.full_pos.shape[1]
        assert n_full <= 3 * window
        worst["fp"] = max(worst["fp"], n_full)
        if length % 1024 == 0:
            seg = cache.memory_report().segments
            compressed = length - n_full
            staged = layer.engine.held.store.k.staging.shape[2] if layer.engine.held.store.k.staging is not None else 0
            assert staged < group
            expected = n_full * (64 * 2 * 4 + 4) + (compressed - staged) * per_token
            expected += staged * (64 * 4 + 16 + 4 + 4)  # staged key (fp32) + its value codes/meta + position
            assert cache.memory_report().total_bytes == expected, (length, seg)

    _decode(one_layer_model, cache, check)
    assert worst["fp"] == 3 * window
    assert cache.memory_report().ratio > 3.0


@pytest.mark.slow
def test_recent_evict_8k_holds_a_constant_number_of_tokens(one_layer_model):
    cache = CompressedCache(policy="recent", window=32, action="evict")
    sizes = set()

    def check(length, cache):
        layer = cache.layers[0]
        assert layer.keys.shape[2] == min(length, 32)  # tokens held
        if length >= 32 and length % 256 == 0:
            assert cache.positions(0)["full"].tolist() == list(range(length - 32, length))
            sizes.add(cache.memory_report().total_bytes)

    _decode(one_layer_model, cache, check)
    assert sizes == {32 * 64 * 2 * 4 + 32 * 4}  # fp32 keys and values, int32 positions
