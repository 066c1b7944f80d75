"""Metrics of the ablation runner on tiny random models: each one moves when the cache is damaged."""

from __future__ import annotations

import math

import pytest
import torch
from lab_fixtures import one_thread  # noqa: F401  (pytest fixtures)
from transformers import DynamicCache

from kvpolicy import CompressedCache
from kvpolicy.tiny import TinySpec, tiny_model
from kvpolicy_lab.eval import measure
from kvpolicy_lab.eval.caches import CacheSpec, baseline_bytes, held_bytes
from kvpolicy_lab.eval.equal_bytes import equalize, measure_bytes, twin
from kvpolicy_lab.eval.probes import AttentionErrorProbe, attention_modules
from kvpolicy_lab.eval.tasks import LanguageModeling

pytestmark = pytest.mark.usefixtures("one_thread")


class GarbledCache(DynamicCache):
    """Returns the values of every past token multiplied by -1 (keys intact): a cache damaged on purpose."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if key_states.shape[-2] == 1:
            values = torch.cat([-values[:, :, :-1], values[:, :, -1:]], dim=2)
        return keys, values


@pytest.fixture(scope="module")
def setup():
    model, tok = tiny_model(TinySpec("llama", layers=2))
    samples = LanguageModeling(samples_per_context=1, tokens=12).samples(tok, 96, seed=0)
    refs = [measure.reference(model, s) for s in samples]
    return model, tok, samples, refs


def _metrics(setup, make, replay=True):
    model, _, samples, refs = setup
    return {m.name: m for m in measure.teacher_forced(model, samples, refs, make, replay=replay)}


def test_uncompressed_is_exact(setup):
    model = setup[0]
    m = _metrics(setup, lambda: DynamicCache(config=model.config))
    assert m["delta_nll"].value == pytest.approx(0.0, abs=1e-6)
    assert m["kl"].value == pytest.approx(0.0, abs=1e-6)
    assert m["top1"].value == 1.0
    assert m["attn_error"].value == pytest.approx(0.0, abs=1e-6)
    assert len(m["attn_error"].extra["per_layer"]) == 2
    # float32 model: 2x the bytes of a 16-bit cache of the same tokens (96 + 12 - the last, a target only)
    assert m["bytes_held"].value == 2 * baseline_bytes(model.config, 107)
    assert m["ratio"].value == pytest.approx(0.5)
    # bits per element: 32 as held, 16 with the full-precision tensors counted at 16 bits
    assert m["bits_per_element"].value == pytest.approx(32.0)
    assert m["bits_per_element_16"].value == pytest.approx(16.0)


def test_damaged_cache_moves_every_metric(setup):
    ok = _metrics(setup, lambda: CompressedCache(policy="log", window=8, action="quantize", bits=8))
    bad = _metrics(setup, GarbledCache)
    assert bad["attn_error"].value > 0.5 > 20 * ok["attn_error"].value
    assert bad["kl"].value > 100 * max(ok["kl"].value, 1e-6)
    assert abs(bad["delta_nll"].value) > abs(ok["delta_nll"].value)
    assert bad["top1"].value < ok["top1"].value


def test_two_bits_worse_than_eight(setup):
    two = _metrics(setup, lambda: CompressedCache(policy="log", window=8, action="quantize", bits=2))
    eight = _metrics(setup, lambda: CompressedCache(policy="log", window=8, action="quantize", bits=8))
    assert two["attn_error"].value > 5 * eight["attn_error"].value
    assert two["kl"].value > eight["kl"].value
    assert two["bytes_held"].value < eight["bytes_held"].value


def test_probe_isolates_the_layer(setup):
    """Damage only layer 1: layer 0's error stays zero (the probe compares on the same input)."""
    model = setup[0]

    class LayerOneGarbled(GarbledCache):
        def update(self, k, v, layer_idx, *a, **kw):
            if layer_idx == 0:
                return DynamicCache.update(self, k, v, layer_idx, *a, **kw)
            return super().update(k, v, layer_idx, *a, **kw)

    m = _metrics(setup, LayerOneGarbled)
    per = m["attn_error"].extra["per_layer"]
    assert per[0] == pytest.approx(0.0, abs=1e-6) and per[1] > 0.3
    assert [mod.layer_idx for mod in attention_modules(model)] == [0, 1]


def test_replayed_prefill_equals_running_it(setup):
    make = lambda: CompressedCache(policy="log", window=8, action="quantize", bits=2)  # noqa: E731
    a = _metrics(setup, make, replay=True)
    b = _metrics(setup, make, replay=False)
    for name in ("delta_nll", "kl", "attn_error", "bytes_held"):
        assert a[name].value == pytest.approx(b[name].value, rel=1e-4, abs=1e-6), name


def test_held_bytes_of_every_cache_kind(setup):
    model = setup[0]
    ids = torch.randint(3, 96, (1, 80))
    caches = {
        "dynamic": DynamicCache(config=model.config),
        "log": CompressedCache(policy="log", window=8, action="quantize", bits=2),
        "hqq": CacheSpec(
            "hf-quantized", {"backend": "hqq", "nbits": 2, "residual_length": 16, "q_group_size": 32}
        ).build(model),
    }
    got = {}
    with torch.inference_mode():
        for name, cache in caches.items():
            model(ids, cache=cache, use_cache=True)
            for t in range(3):
                model(ids[:, t : t + 1], cache=cache, use_cache=True)
            got[name] = held_bytes(cache)
    dyn = sum(layer.keys.numel() * 4 + layer.values.numel() * 4 for layer in caches["dynamic"].layers)
    assert got["dynamic"] == dyn == 2 * baseline_bytes(model.config, 83)
    assert got["log"] == caches["log"].memory_report().total_bytes
    assert 0 < got["hqq"] < got["dynamic"] / 4  # 2-bit codes + metadata of 83 tokens, residual under 16


def test_probe_needs_a_cache_keyword(setup):
    model = setup[0]
    with AttentionErrorProbe(model) as probe, pytest.raises(RuntimeError, match="cache"):
        probe._hook(attention_modules(model)[0], (torch.zeros(1, 1, 128),), {}, (torch.zeros(1, 1, 128),))


def test_equal_bytes_finds_the_largest_window_within_the_anchor(setup):
    model = setup[0]
    anchor = CacheSpec("compressed", {"policy": "log", "window": 8, "action": "quantize", "bits": 2})
    sliding = CacheSpec("compressed", {"policy": "recent", "window": 4, "action": "evict"})
    specs, report = equalize(model, anchor, [anchor, sliding], 64, 4)
    (s,) = report
    assert specs[0] is anchor and specs[1].args["window"] == s.value
    assert s.bytes <= s.target
    small = twin(model)
    assert measure_bytes(small, sliding.with_args(window=s.value + 1), 64, 4) > s.target
    assert not math.isnan(s.bytes)


def test_task_accuracy_moves_when_the_cache_is_damaged(setup):
    """Answers are the uncompressed model's own greedy continuations: exact with DynamicCache, lost when damaged."""
    from kvpolicy_lab.eval.tasks import Sample, Task

    model, tok, _, _ = setup

    class Echo(Task):
        name = "echo"

        def score(self, sample, text):
            return {"accuracy": float(text == sample.answer)}

    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(4):
        ids = torch.randint(3, 96, (60,), generator=g).tolist()
        probe = Sample("echo", str(i), "generate", ids, len(ids), None, 8)
        answer = measure.generate(model, tok, probe, DynamicCache(config=model.config)).text
        samples.append(Sample("echo", str(i), "generate", ids, len(ids), answer, 8))
    refs = [measure.reference(model, s) for s in samples]
    task = Echo()
    exact, _ = measure.task_scores(model, tok, task, samples, refs, lambda: DynamicCache(config=model.config))
    broken, records = measure.task_scores(model, tok, task, samples, refs, GarbledCache)
    assert exact[0].name == "accuracy" and exact[0].value == 1.0
    assert broken[0].value < 1.0
    assert len(records) == 4 and {"generated", "answer", "scores"} <= set(records[0])


def test_speed_reports_positive_times(setup):
    model, _, samples, _ = setup
    m = {x.name: x for x in measure.speed(model, samples[0].ids[:64], lambda: DynamicCache(config=model.config), 3)}
    assert m["prefill_ms"].value > 0 and m["decode_ms"].value > 0 and m["decode_ms"].n == 3
    assert m["bytes_held"].value == 2 * baseline_bytes(model.config, 64 + 3)


def test_prefill_projects_only_the_last_position():
    """Prefills pass ``logits_to_keep=1`` to models that take it (the logits at the last position are
    the ones used; the full projection costs a (prompt, vocab) tensor) and nothing to others."""
    from kvpolicy.tiny import random_model
    from kvpolicy_lab.eval.metrics import last_only

    model = random_model("llama")
    assert last_only(model) == {"logits_to_keep": 1}
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids).logits[:, -1]
        last = model(ids, **last_only(model)).logits
    assert last.shape == (1, 1, 96)
    torch.testing.assert_close(last[:, 0], full, rtol=1e-5, atol=1e-5)

    class Plain(torch.nn.Module):
        def forward(self, input_ids):
            return input_ids

    assert last_only(Plain()) == {}


def test_measurements_run_without_autograd():
    """teacher_forced_logits and greedy_generate record no graph (their outputs require no grad,
    and a compressed cache's decode steps are not pushed off the fused path by autograd)."""
    from kvpolicy import CompressedCache
    from kvpolicy.tiny import random_model
    from kvpolicy_lab.eval.metrics import greedy_generate, teacher_forced_logits

    model = random_model("llama")
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    cache = CompressedCache(policy="log", window=4, bits=2, group_size=16)
    out = teacher_forced_logits(model, ids, 30, cache)
    assert not out.requires_grad
    assert all("autograd" not in str(p) for p in cache.attention_paths().values())
    gen = greedy_generate(model, ids[:, :30], CompressedCache(policy="log", window=4, bits=2, group_size=16), 3)
    assert len(gen.tokens) == 3


def test_worst_text_names_the_damaged_sample():
    """``kl_worst`` is the largest per-text mean KL: damage one text of three and it is that text's."""
    model, tok = tiny_model(TinySpec("llama", layers=2))
    samples = LanguageModeling(samples_per_context=3, tokens=12).samples(tok, 96, seed=0)
    refs = [measure.reference(model, s) for s in samples]
    made = []

    def make():  # one cache per sample (batch=1): the second one is damaged
        made.append(None)
        return GarbledCache() if len(made) == 2 else DynamicCache(config=model.config)

    m = {x.name: x for x in measure.teacher_forced(model, samples, refs, make, attention_error=False)}
    per_text = m["kl_worst"].extra["per_text"]
    assert list(per_text) == [s.sample_id for s in samples]
    assert per_text[samples[0].sample_id] == pytest.approx(0.0, abs=1e-6)
    assert per_text[samples[2].sample_id] == pytest.approx(0.0, abs=1e-6)
    assert m["kl_worst"].value == per_text[samples[1].sample_id] > 0.01
    # the mean over tokens of equal-length texts is the mean of the texts' means
    assert m["kl"].value == pytest.approx(m["kl_worst"].value / 3, rel=1e-5)
    assert m["kl_worst"].n == 3


def test_the_tail_pools_every_token_of_every_text():
    """``kl_p99`` and ``kl_p999`` are numpy's linear percentiles of the per-token KLs of all texts together,
    computed here from each text's logits through the cache and the reference's, outside the runner."""
    import numpy as np

    from kvpolicy_lab.eval.metrics import next_token_kl, teacher_forced_logits

    model, tok = tiny_model(TinySpec("llama", layers=2))
    samples = LanguageModeling(samples_per_context=3, tokens=40).samples(tok, 96, seed=0)
    refs = [measure.reference(model, s) for s in samples]
    m = {x.name: x for x in measure.teacher_forced(model, samples, refs, GarbledCache, attention_error=False)}
    per_text = []
    for s, ref in zip(samples, refs, strict=True):
        ids = torch.tensor([s.ids])
        got = teacher_forced_logits(model, ids, s.prefill, GarbledCache())[0]
        per_text.append(next_token_kl(ref.logits, got).double().numpy())
    pooled = np.concatenate(per_text)
    assert m["kl"].value == pytest.approx(pooled.mean(), rel=1e-5)
    for name, q in (("kl_p99", 99), ("kl_p999", 99.9)):
        assert m[name].n == len(pooled) == 3 * 40
        assert m[name].value == pytest.approx(np.percentile(pooled, q, method="linear"), rel=1e-5)
        assert m[name].extra["max"] == pytest.approx(pooled.max(), rel=1e-5)
        assert list(m[name].extra["per_text"].values()) == pytest.approx(
            [np.percentile(k, q) for k in per_text], rel=1e-5
        )
    assert m["kl"].value < m["kl_p99"].value <= m["kl_p999"].value <= m["kl_p999"].extra["max"]
