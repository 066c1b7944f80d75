"""Cases a cache must refuse clearly (or serve correctly): head dims, hybrid models, ``config=``, crop."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config

from kvpolicy import CompressedCache
from kvpolicy.backends.base import dense_attention
from kvpolicy.errors import ConfigError
from kvpolicy.fused import attend_parts
from kvpolicy.layer.parts import Part

KW = dict(policy="log", window=8, bits=2, group_size=16)


def _kv(n: int, dk: int = 64, dv: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, n, dk, generator=g), torch.randn(1, 2, n, dv, generator=g)


# ---------------------------------------------------------------------- key and value head dims
def test_value_head_dim_the_group_size_does_not_divide():
    cache = CompressedCache(policy="log", window=8, bits=2, group_size=64)
    with pytest.raises(
        ConfigError, match=r"group_size=64 does not divide the value head_dim=48.*\[4, 8, 12, 16, 24, 48\]"
    ):
        cache.update(*_kv(80, 64, 48), 0)


def test_key_head_dim_checked_only_for_per_token_keys():
    CompressedCache(policy="log", window=8, bits=2, group_size=64).update(*_kv(80, 48, 64), 0)  # keys per channel
    cache = CompressedCache(policy="log", window=8, bits=2, group_size=64, key_axis="token")
    with pytest.raises(ConfigError, match="the key head_dim=48"):
        cache.update(*_kv(80, 48, 64), 0)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize(("dk", "dv"), [(64, 32), (96, 64)])
def test_different_key_and_value_head_dims_are_served(dk, dv, backend, request):
    """MLA-style dims: the fused decode computation equals attention over the materialised history."""
    if backend == "cpu":
        request.getfixturevalue("cpu_kernel")
    cache = CompressedCache(**KW, backend=backend)
    cache.update(*_kv(70, dk, dv), 0)
    for step in range(3):
        keys, values = cache.update(*_kv(1, dk, dv, seed=step + 1), 0)
        assert keys.shape[-1] == dk and values.shape[-1] == dv
    layer = cache.layers[0]
    query = torch.randn(1, 4, 1, dk, generator=torch.Generator().manual_seed(9))
    got = attend_parts(query, [*layer.engine.held.store.parts(), Part(layer.engine.keys, layer.engine.values)], 0.125)
    k, v = layer.attention_view("ordered")
    ref, _ = dense_attention(query.reshape(1, 2, 2, dk), k, v, 0.125)
    torch.testing.assert_close(got, ref.reshape(1, 4, 1, dv), rtol=0, atol=1e-5)


# ---------------------------------------------------------------------- config=
@pytest.mark.parametrize("config", ["abc", {"sliding_window": 4}, 3])
def test_config_of_the_wrong_type(config):
    with pytest.raises(
        ConfigError, match=f"config must be the model's transformers PretrainedConfig.*{type(config).__name__}"
    ):
        CompressedCache(**KW, config=config)


def test_config_that_leaves_no_layer_compressed_warns():
    cfg = Qwen2Config(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, sliding_window=16,
        use_sliding_window=True, max_window_layers=0, layer_types=["sliding_attention", "sliding_attention"],
    )  # fmt: skip
    with pytest.warns(UserWarning, match="leaves no layer compressed"):
        CompressedCache(**KW, config=cfg)


def test_hybrid_model_without_config_names_the_remedy():
    """A model with linear-attention layers asks the cache for their state: without config= there are
    no such layers, and the message says what to pass (transformers itself raised an IndexError)."""
    from conftest import tiny_qwen3_next_config
    from transformers import Qwen3NextForCausalLM

    cfg = tiny_qwen3_next_config()
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(cfg).eval()
    ids = torch.randint(3, 96, (1, 40))
    with torch.no_grad(), pytest.raises(ConfigError, match=r"layer 0 .* not an attention layer.*config=model.config"):
        model(ids, cache=CompressedCache(**KW))
    cache = CompressedCache(**KW, config=cfg)
    with torch.no_grad():
        model(ids, cache=cache)
        model(ids[:, :1], cache=cache)
    assert [type(layer).__name__ for layer in cache.layers] == ["LinearAttentionLayer", "CompressedLayer"]
    assert cache.get_seq_length(1) == 41


# ---------------------------------------------------------------------- crop and is_croppable agree
@pytest.mark.parametrize(("policy", "action"), [("log", "quantize"), ("recent", "evict"), ("log", "none")])
def test_is_croppable_says_whether_crop_works(policy, action):
    cache = CompressedCache(policy=policy, window=8, action=action, **({"bits": 2} if action == "quantize" else {}))
    layer = lambda: cache.layers[0]  # noqa: E731
    cache.update(*_kv(40), 0)
    assert layer().is_croppable
    cache.crop(-2)  # the prompt's last two tokens were never handed to the policy
    assert cache.get_seq_length() == 38
    held = set(cache.positions(0)["full"].tolist()) if action != "none" else set()
    cache.update(*_kv(1, seed=1), 0)  # a decode step: a sliding window demotes, a log window not always
    demoted = action != "none" and not held <= set(cache.positions(0)["full"].tolist())
    assert demoted == (policy == "recent")
    if not demoted:  # nothing to take back but the token: served (the log policy's state is its length's)
        assert layer().is_croppable
        cache.crop(-1)
        assert cache.get_seq_length() == 38
    else:
        assert not layer().is_croppable
        with pytest.raises(ValueError, match="only the 0 token"):
            cache.crop(-1)
    cache.update(*_kv(5, seed=2), 0)  # a multi-token update (assisted decoding's verification)
    assert layer().is_croppable


def test_score_policies_are_never_croppable():
    cache = CompressedCache(policy="h2o", heavy=4, recent=4, bits=2)
    cache.update(*_kv(20), 0)
    assert not cache.layers[0].is_croppable
    with pytest.raises(ValueError, match="score-based"):
        cache.crop(-1)


# ---------------------------------------------------------------------- a failed demotion stops the layer
def test_a_layer_that_failed_to_demote_refuses_to_go_on():
    """fp32 keys beyond the float16 metadata range raise when they are quantized; the policy already
    moved them out of its full-precision set, so the layer must not serve a half-updated history."""
    from kvpolicy.errors import MetadataOverflowError

    cache = CompressedCache(policy="recent", window=4, bits=2, group_size=4)
    keys, values = _kv(12)
    cache.update(keys * 1e6, values, 0)
    with pytest.raises(MetadataOverflowError):
        cache.update(*_kv(1, seed=1), 0)
    with pytest.raises(RuntimeError, match=r"failed while demoting tokens.*MetadataOverflowError"):
        cache.update(*_kv(1, seed=2), 0)
    with pytest.raises(RuntimeError, match="Start a new cache"):
        cache.positions(0)
    cache.reset()
    cache.update(*_kv(12), 0)  # usable again after reset
    assert cache.get_seq_length() == 12
