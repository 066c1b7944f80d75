"""Attention scores for score-based policies (``kvpolicy.attention``) and H2O inside tiny models.

The reference for "the scores are the attention probabilities" is transformers' own eager
attention: its returned weights ``(batch, q_heads, q_len, k_len)`` summed over the batch, the query
positions and the query heads of each kv group (``repeat_kv`` maps query head ``i`` to kv head
``i // group``).
"""

from __future__ import annotations

import types

import pytest
import torch
from conftest import teacher_forced_logits, tiny_model
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from kvpolicy import CompressedCache, handoff
from kvpolicy.attention import disable_scores, enable_scores
from kvpolicy.errors import ConfigError
from kvpolicy.layer.engine import LayerEngine

KV_HEADS = 2  # tiny_model("llama"): 4 query heads, 2 kv heads (GQA)


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (batch, length), generator=g)


def _mass(weights: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``(batch, q_heads, q, k)`` probabilities -> ``(kv_heads, k)`` mass per kv group."""
    b, hq, q, k = weights.shape
    return weights.float().reshape(b, kv_heads, hq // kv_heads, q, k).sum(dim=(0, 2, 3))


@pytest.fixture
def recorded(monkeypatch):
    """Every ``(engine, scores)`` that a layer's engine (``LayerEngine.observe``) receives."""
    seen: list[tuple[LayerEngine, torch.Tensor]] = []
    original = LayerEngine.observe

    def spy(self, scores, layout="ordered"):
        """Record the scores in position order (the agnostic view puts the demoted tokens first)."""
        ordered = scores.detach().clone()
        if layout == "agnostic" and len(self.held.store):
            order = torch.cat([self.held.store.positions, self.held.full_pos], dim=1).expand(scores.shape[0], -1)
            ordered = torch.empty_like(ordered).scatter_(1, order, ordered)
        seen.append((self, ordered))
        return original(self, scores, layout)

    monkeypatch.setattr(LayerEngine, "observe", spy)
    return seen


# --------------------------------------------------------------------------------------------------
# enable_scores changes nothing but the reporting
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "phi3"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_enable_scores_leaves_logits_unchanged(family, attn):
    model = tiny_model(family, attn)
    ids = _ids(2, 20)
    ref = teacher_forced_logits(model, ids, 8, DynamicCache())
    enable_scores(model)
    assert model.config._attn_implementation == f"kvpolicy_{attn}"
    got = teacher_forced_logits(model, ids, 8, DynamicCache())
    assert torch.allclose(ref, got, atol=1e-5)
    if attn == "eager":
        assert torch.allclose(ref, got, atol=1e-6, rtol=0)
    # a compressing cache without a score-based policy is not affected either
    log = teacher_forced_logits(model, ids, 8, CompressedCache(policy="log", window=2, action="quantize"))
    disable_scores(model)
    assert model.config._attn_implementation == attn
    log_ref = teacher_forced_logits(model, ids, 8, CompressedCache(policy="log", window=2, action="quantize"))
    assert torch.allclose(log_ref, log, atol=1e-5)


def test_enable_and_disable_are_idempotent():
    model = tiny_model("llama", "sdpa", layers=1)
    enable_scores(model)
    enable_scores(model)
    assert model.config._attn_implementation == "kvpolicy_sdpa"
    disable_scores(model)
    disable_scores(model)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_disable_scores_leaves_fused_attention_alone(attn):
    # "kvpolicy_fused_sdpa" starts with the score wrapper's prefix "kvpolicy_": stripping that prefix
    # would leave "fused_sdpa", which transformers refuses
    from kvpolicy.fused import disable_fused, enable_fused

    model = tiny_model("llama", attn, layers=1)
    enable_fused(model)
    disable_scores(model)
    assert model.config._attn_implementation == f"kvpolicy_fused_{attn}"
    disable_fused(model)
    assert model.config._attn_implementation == attn
    enable_scores(model)
    disable_fused(model)  # likewise: the score wrapper is not fused attention
    assert model.config._attn_implementation == f"kvpolicy_{attn}"


@pytest.mark.parametrize("impl", ["flex_attention", "flash_attention_2", "paged|sdpa"])
def test_enable_scores_rejects_unsupported_implementations(impl):
    fake = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation=impl))
    with pytest.raises(ConfigError) as info:
        enable_scores(fake)
    message = str(info.value)
    assert "sdpa" in message and "eager" in message and repr(impl) in message


def test_enable_scores_rejects_a_real_flex_attention_model():
    model = tiny_model("llama", "flex_attention", layers=1)
    with pytest.raises(ConfigError, match=r"sdpa.*eager.*flex_attention"):
        enable_scores(model)
    assert model.config._attn_implementation == "flex_attention"


# --------------------------------------------------------------------------------------------------
# the reported scores are the attention probabilities
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("action", ["evict", "quantize"])
def test_prefill_scores_equal_eager_attention_probabilities(recorded, attn, action):
    """GQA (4 query heads, 2 kv heads), batch 2: sum over batch, queries and each group's query heads."""
    ids = _ids(2, 12)
    reference = tiny_model("llama", "eager", layers=1)
    out = reference(ids, cache=DynamicCache(), use_cache=True, output_attentions=True)
    expected = _mass(out.attentions[0], KV_HEADS)  # (2, 12)
    assert torch.allclose(expected.sum(), torch.tensor(2.0 * 4 * 12))  # rows of probabilities

    model = tiny_model("llama", attn, layers=1)
    enable_scores(model)
    cache = CompressedCache(policy="h2o", heavy=3, recent=2, action=action)
    model(ids, cache=cache, use_cache=True)
    assert [engine for engine, _ in recorded] == [cache.layers[0].engine]
    scores = recorded[0][1]
    assert scores.shape == (KV_HEADS, 12)
    assert torch.allclose(scores, expected, atol=1e-5)

    # the prompt selection is the top-3 column sums before the last 2 positions, per kv head
    full = cache.positions(0)["full"]
    assert full.shape == (2, KV_HEADS, 5)
    for h in range(KV_HEADS):
        top = torch.topk(expected[h, :10], 3).indices.sort().values.tolist()
        assert full[0, h].tolist() == [*top, 10, 11]
        assert torch.equal(full[0, h], full[1, h])


@pytest.mark.parametrize(
    ("action", "layout"), [("evict", "ordered"), ("quantize", "ordered"), ("quantize", "agnostic")]
)
def test_scores_equal_eager_probabilities_at_every_step(recorded, action, layout):
    """Prefill and decode steps with demotions: the sdpa wrapper's scores vs. transformers' eager weights.

    The reference model runs plain (unwrapped) eager attention with its own cache of the same
    configuration; a forward hook feeds that cache's layer the mass of transformers' weights.
    """
    ids = _ids(2, 22, seed=3)
    prefill = 10
    kw = dict(policy="h2o", heavy=3, recent=2, action=action, layout=layout)

    model = tiny_model("llama", "sdpa", layers=1)
    enable_scores(model)
    cache = CompressedCache(**kw)

    reference = tiny_model("llama", "eager", layers=1)
    ref_cache = CompressedCache(**kw)
    expected: list[torch.Tensor] = []

    def feed(module, args, kwargs, output):
        mass = _mass(output[1], KV_HEADS)
        expected.append(mass)
        ref_cache.layers[0].observe_attention(mass)

    def reference_eager(module, query, key, value, attention_mask, **kwargs):
        """transformers' eager attention over the reference layer's history; its weights are fed to
        that layer by ``feed`` above (so the hand-off reports nothing itself)."""
        from transformers.models.llama.modeling_llama import eager_attention_forward

        key, value = handoff.ticket_of(key).view("ordered")
        return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("test_reference_eager", reference_eager)
    AttentionMaskInterface.register("test_reference_eager", ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    reference.set_attn_implementation("test_reference_eager")

    handle = reference.model.layers[0].self_attn.register_forward_hook(feed, with_kwargs=True)
    try:
        with torch.inference_mode():
            for start, stop in [(0, prefill), *((t, t + 1) for t in range(prefill, ids.shape[1]))]:
                model(ids[:, start:stop], cache=cache, use_cache=True)
                reference(ids[:, start:stop], cache=ref_cache, use_cache=True)
                assert recorded[-1][0] is ref_cache.layers[0].engine and recorded[-2][0] is cache.layers[0].engine
                got = recorded[-2][1]
                assert got.shape == expected[-1].shape
                assert torch.allclose(got, expected[-1], atol=1e-5), (start, (got - expected[-1]).abs().max())
                a, b = cache.positions(0), ref_cache.positions(0)
                assert torch.equal(a["full"], b["full"]) and torch.equal(a["compressed"], b["compressed"])
    finally:
        handle.remove()
    assert len(recorded) == 2 * len(expected) == 2 * (1 + ids.shape[1] - prefill)
    full = cache.positions(0)["full"]
    assert full.shape == (2, KV_HEADS, 5)
    if action == "quantize":
        compressed = cache.positions(0)["compressed"]
        merged = torch.cat([full, compressed], dim=-1).sort(dim=-1).values
        assert torch.equal(merged[0, 0], torch.arange(ids.shape[1]))


# --------------------------------------------------------------------------------------------------
# without enable_scores
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("action", ["evict", "quantize"])
def test_h2o_without_enable_scores_raises(attn, action):
    model = tiny_model("llama", attn)
    ids = _ids(1, 10)
    cache = CompressedCache(policy="h2o", heavy=2, recent=2, action=action)
    with pytest.raises(RuntimeError, match="enable_scores"):  # in the forward whose scores are missing
        model(ids[:, :8], cache=cache, use_cache=True)
    with pytest.raises(RuntimeError, match="enable_scores"):
        cache.positions(0)


def test_h2o_without_enable_scores_raises_in_generate():
    model = tiny_model("llama", "sdpa")
    ids = _ids(1, 8)
    cache = CompressedCache(policy="h2o", heavy=2, recent=2, action="evict")
    with pytest.raises(RuntimeError, match="enable_scores"):
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=3, do_sample=False)


def test_h2o_after_disable_scores_raises():
    model = tiny_model("llama", "sdpa")
    enable_scores(model)
    disable_scores(model)
    ids = _ids(1, 10)
    cache = CompressedCache(policy="h2o", heavy=2, recent=2, action="evict")
    with pytest.raises(RuntimeError, match="enable_scores"):
        model(ids[:, :8], cache=cache, use_cache=True)


def test_forgotten_enable_scores_is_not_masked_by_another_models_forward():
    ids = _ids(1, 10)
    plain = tiny_model("llama", "sdpa", layers=1)
    cache = CompressedCache(policy="h2o", heavy=2, recent=2, action="evict")
    with pytest.raises(RuntimeError, match="enable_scores"):
        plain(ids[:, :8], cache=cache, use_cache=True)  # no scores
    other = tiny_model("llama", "sdpa", layers=1, seed=1)
    enable_scores(other)
    other(ids[:, :8], cache=DynamicCache(), use_cache=True)
    with pytest.raises(RuntimeError, match="enable_scores"):
        cache.positions(0)


# --------------------------------------------------------------------------------------------------
# end to end
# --------------------------------------------------------------------------------------------------


def test_h2o_generate_keeps_heavy_plus_recent():
    model = tiny_model("llama", "sdpa")
    enable_scores(model)
    ids = _ids(2, 14)
    cache = CompressedCache(policy="h2o", heavy=4, recent=4, action="evict")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=6, do_sample=False)
    assert out.shape == (2, 20)
    total = 14 + 5  # the last generated token is never fed back
    assert cache.get_seq_length() == total
    for layer in range(2):
        pos = cache.positions(layer)
        full = pos["full"]
        assert full.shape == (2, KV_HEADS, 8)
        assert full.dtype == torch.int64
        assert torch.equal(full, full.sort(dim=-1).values)
        assert ((full >= 0) & (full < total)).all()
        assert (full[..., 4:] == torch.arange(total - 4, total)).all()  # the newest 4
        assert torch.equal(full[0], full[1])  # one selection per kv head, shared by the batch rows
        assert pos["compressed"].numel() == 0
    assert cache.memory_report().segments["full_precision"] > 0


def test_h2o_eager_and_sdpa_agree():
    ids = _ids(2, 28, seed=5)
    logits, kept = {}, {}
    for attn in ("sdpa", "eager"):
        model = tiny_model("llama", attn)
        enable_scores(model)
        cache = CompressedCache(policy="h2o", heavy=4, recent=4, action="evict")
        logits[attn] = teacher_forced_logits(model, ids, 12, cache)
        kept[attn] = [cache.positions(layer)["full"] for layer in range(2)]
    assert torch.allclose(logits["sdpa"], logits["eager"], atol=1e-4)
    for a, b in zip(kept["sdpa"], kept["eager"], strict=True):
        assert a.shape == (2, KV_HEADS, 8)
        assert torch.equal(a, b)
    # eviction made a difference (the selection is not the trivial "everything")
    model = tiny_model("llama", "sdpa")
    assert not torch.allclose(teacher_forced_logits(model, ids, 12, DynamicCache()), logits["sdpa"], atol=1e-4)
