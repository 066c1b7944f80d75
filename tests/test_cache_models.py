"""CompressedCache inside real transformers models (tiny random Llama, Qwen2, Phi-3, Mistral)."""

from __future__ import annotations

import pytest
import torch
from conftest import ATTN, FAMILIES, teacher_forced_logits
from transformers import DynamicCache

from kvpolicy import CompressedCache
from kvpolicy.policies.log import log_full_positions


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (batch, length), generator=g)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ATTN)
def test_none_action_equals_dynamic_cache_bit_for_bit(models, family, attn):
    model = models(family, attn)
    ids = _ids(3, 48)
    ref = teacher_forced_logits(model, ids, 32, DynamicCache())
    got = teacher_forced_logits(model, ids, 32, CompressedCache(policy="log", window=4, action="none"))
    assert torch.equal(ref, got)

    kw = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref_gen = model.generate(ids[:, :20], attention_mask=torch.ones_like(ids[:, :20]), **kw)
    cache = CompressedCache(action="none")
    got_gen = model.generate(ids[:, :20], attention_mask=torch.ones_like(ids[:, :20]), cache=cache, **kw)
    assert torch.equal(ref_gen.sequences, got_gen.sequences)
    for a, b in zip(ref_gen.logits, got_gen.logits, strict=True):
        assert torch.equal(a, b)
    assert cache.get_seq_length() == 20 + 11


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("batch", [1, 3])
def test_default_logquant_generate_and_forward(models, family, attn, batch):
    """The advertised one-liner, defaults untouched, in generate and in plain forward calls."""
    model = models(family, attn)
    ids = _ids(batch, 140)  # > 3 * 42 so the default window demotes, and a per-channel key group fills
    cache = CompressedCache(policy="log", action="quantize", bits=2)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=8, do_sample=False)
    assert out.shape == (batch, 148)
    total = 140 + 7  # the last generated token is never fed back
    assert cache.get_seq_length() == total
    pos = cache.positions(0)
    assert pos["full"].tolist() == log_full_positions(42, total)
    assert sorted(pos["full"].tolist() + pos["compressed"].tolist()) == list(range(total))
    assert cache.memory_report().segments["codes"] > 0

    ref = teacher_forced_logits(model, ids, 120, DynamicCache())
    got = teacher_forced_logits(model, ids, 120, CompressedCache(policy="log", action="quantize", bits=2))
    assert torch.isfinite(got).all()
    # identical until the first demotion (T = 3W + 1 = 127 -> step index 127 - 120 = 7)
    assert torch.equal(ref[:, :7], got[:, :7])
    assert not torch.equal(ref[:, 8:], got[:, 8:])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ATTN)
def test_layouts_agree_on_decode(models, family, attn):
    model = models(family, attn)
    ids = _ids(3, 90)
    kw = dict(policy="log", window=6, action="quantize", bits=2, group_size=16)
    ordered = teacher_forced_logits(model, ids, 40, CompressedCache(layout="ordered", **kw))
    agnostic = teacher_forced_logits(model, ids, 40, CompressedCache(layout="agnostic", **kw))
    torch.testing.assert_close(agnostic, ordered, rtol=1e-4, atol=1e-4)


def test_generate_equals_teacher_forced_decode(models):
    """generate() and a hand-written decode loop drive the cache identically."""
    model = models("llama")
    ids = _ids(1, 30)
    kw = dict(policy="log", window=4, action="quantize", bits=2, group_size=16)
    gen = model.generate(
        ids, attention_mask=torch.ones_like(ids), cache=CompressedCache(**kw), max_new_tokens=40,
        do_sample=False, output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    tf = teacher_forced_logits(model, gen.sequences, 30, CompressedCache(**kw))
    torch.testing.assert_close(torch.stack(gen.logits, dim=1), tf, rtol=0, atol=1e-5)


class _Recorder(CompressedCache):
    """Records what each layer receives and returns, to check the cache against its inputs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: dict[int, list[torch.Tensor]] = {}
        self.returned: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.seen.setdefault(layer_idx, []).append((key_states.clone(), value_states.clone()))
        k, v = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        self.returned[layer_idx] = (k, v)
        return k, v


@pytest.mark.parametrize(("key_axis", "key_fit"), [("channel", None), ("token", "minmax")])
def test_long_decode_positions_and_contents(models, key_axis, key_fit):
    """Several hundred decode steps: FP(T) at every step, FP tokens bit-exact, compressed tokens
    equal to the backend's dequantization of their stored codes (and, for min-max groups, within s/2
    of the input; the keys' default fitted ranges give that bound up: tests/test_fit.py)."""
    model = models("llama")
    window, prefill, steps = 8, 20, 300
    ids = _ids(2, prefill + steps, seed=7)
    cache = _Recorder(
        policy="log", window=window, action="quantize", bits=2, group_size=16, key_axis=key_axis, key_fit=key_fit
    )
    minmax_keys = cache.action.keys.fit == "minmax"
    assert minmax_keys == (key_fit == "minmax")
    model(ids[:, :prefill], cache=cache, use_cache=True)
    for t in range(prefill, prefill + steps):
        model(ids[:, t : t + 1], cache=cache, use_cache=True)
        T = t + 1
        for layer_idx in range(len(cache.layers)):
            pos = cache.positions(layer_idx)
            assert pos["full"].tolist() == log_full_positions(window, T)
        if t % 25 and t != prefill + steps - 1:
            continue
        for layer_idx, layer in enumerate(cache.layers):
            raw_k = torch.cat([k for k, _ in cache.seen[layer_idx]], dim=2)
            raw_v = torch.cat([v for _, v in cache.seen[layer_idx]], dim=2)
            ret_k, ret_v = cache.returned[layer_idx]
            full = layer.positions()["full"]
            assert torch.equal(ret_k[:, :, full], raw_k[:, :, full])
            assert torch.equal(ret_v[:, :, full], raw_v[:, :, full])
            store = layer.engine.held.store
            order = store.positions[0]  # demotion order = storage order (shared policy: one row)
            nq_k, nq_v = store.k.num_quantized, store.v.num_quantized
            if nq_k:
                deq = cache.backend.dequantize(store.k.q)
                assert torch.equal(ret_k[:, :, order[:nq_k]], deq)
                if minmax_keys:
                    _within_half_step(raw_k[:, :, order[:nq_k]], deq, store.k.q)
            assert torch.equal(ret_k[:, :, order[nq_k:]], raw_k[:, :, order[nq_k:]])  # staged keys: exact
            deq_v = cache.backend.dequantize(store.v.q)
            assert torch.equal(ret_v[:, :, order[:nq_v]], deq_v)
            _within_half_step(raw_v[:, :, order[:nq_v]], deq_v, store.v.q)


def _within_half_step(x: torch.Tensor, x_hat: torch.Tensor, q) -> None:
    """|x - x_hat| <= s/2 (+ float rounding), with s broadcast back to every element."""
    # token axis: scales (b, h, n, d // G); channel axis: (b, h, n // G, d) -> both to (b, h, n, d)
    s = q.scales.float().repeat_interleave(q.group_size, dim=-1 if q.axis == "token" else 2)
    err = (x.float() - x_hat.float()).abs()
    assert (err <= s / 2 + 1e-5 * x.float().abs() + 1e-6).all()


def test_beam_search_and_batch_ops(models):
    model = models("qwen2")
    ids = _ids(2, 40)
    cache = CompressedCache(policy="log", window=4, action="quantize", bits=4, group_size=16)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), cache=cache, num_beams=3, max_new_tokens=10, do_sample=False
    )
    assert out.shape == (2, 50)

    # reorder/select/repeat act on every held tensor consistently
    cache = CompressedCache(policy="log", window=4, action="quantize", bits=4, group_size=16)
    teacher_forced_logits(model, _ids(3, 60), 30, cache)
    before = [layer.positions() for layer in cache.layers]
    layer = cache.layers[0]
    k0, v0 = layer.attention_view()
    cache.reorder_cache(torch.tensor([2, 0, 1]))
    k1, v1 = layer.attention_view()
    assert torch.equal(k1, k0[[2, 0, 1]]) and torch.equal(v1, v0[[2, 0, 1]])
    cache.batch_select_indices(torch.tensor([0, 2]))
    k2, _ = layer.attention_view()
    assert torch.equal(k2, k0[[2, 1]])
    cache.batch_repeat_interleave(2)
    k3, _ = layer.attention_view()
    assert torch.equal(k3, k0[[2, 2, 1, 1]])
    after = [lay.positions() for lay in cache.layers]
    assert all(torch.equal(a[key], b[key]) for a, b in zip(before, after, strict=True) for key in a)
    assert cache.memory_report().layers[0].baseline_bytes == 4 * 59 * 1 * 128 * 2  # batch 4, 59 tokens fed, 1 kv head


def test_group_size_must_divide_head_dim_in_model(models):
    cache = CompressedCache(policy="log", action="quantize", bits=2, group_size=48, value_axis="token")
    with pytest.raises(ValueError, match=r"group_size=48 does not divide the value head_dim=64"):
        models("llama")(_ids(1, 8), cache=cache, use_cache=True)
