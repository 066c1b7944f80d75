"""The parts of transformers' ``Cache`` API a ``DynamicCache`` user may reach for: iteration, and ``crop`` after
single-token steps. Each is served where the composition allows it exactly, and refused by name elsewhere."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache

from kvpolicy import CompressedCache

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _filled(model, cache, prompt: int = 40, steps: int = 10, seed: int = 0):
    ids = torch.randint(3, 96, (2, prompt + steps + 4), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model(ids[:, :prompt], cache=cache, use_cache=True)
        for t in range(prompt, prompt + steps):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
    return ids


# ---------------------------------------------------------------------- iteration
def test_iterating_gives_what_dynamic_cache_gives_with_action_none(model):
    ours, theirs = CompressedCache(action="none"), DynamicCache()
    ids = _filled(model, ours)
    _filled(model, theirs)
    got, want = list(ours), list(theirs)
    assert len(got) == len(want) == 2
    for (k, v, w), (k2, v2, w2) in zip(got, want, strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2) and w is None and w2 is None
    rebuilt = DynamicCache(iter(ours))  # the ddp_cache_data form: a DynamicCache of the same history
    with torch.no_grad():
        a = model(ids[:, 50:51], cache=rebuilt, use_cache=True).logits
        b = model(ids[:, 50:51], cache=theirs, use_cache=True).logits
    assert torch.equal(a, b)


def test_iterating_a_quantized_cache_gives_the_history_attention_reads(model):
    cache = CompressedCache(policy="log", window=4, bits=4, group_size=16)
    ids = _filled(model, cache)
    for i, (keys, values, window) in enumerate(cache):
        view = cache.layers[i].attention_view("ordered")
        assert window is None and keys.shape[-2] == cache.get_seq_length() == 50
        assert torch.equal(keys, view[0]) and torch.equal(values, view[1])
    rebuilt = DynamicCache(iter(cache))
    with torch.no_grad():  # the rebuilt cache attends over the same keys and values: the same next logits
        a = model(ids[:, 50:51], cache=rebuilt, use_cache=True).logits
        b = model(ids[:, 50:51], cache=copy.deepcopy(cache), use_cache=True).logits
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_iterating_an_evicting_cache_is_refused_by_name(model):
    cache = CompressedCache(policy="recent", window=8, action="evict")
    _filled(model, cache)
    with pytest.raises(ValueError, match=r"layer 0 holds \d+ of its 50 tokens \(action 'evict' evicted the others\)"):
        list(cache)


def test_iterating_a_fresh_cache_and_a_hybrid_one():
    from kvpolicy.tiny import tiny_gemma3

    model = tiny_gemma3()
    cache = CompressedCache.for_model(model, window=4, bits=4, group_size=16)
    assert all(k is None and v is None for k, v, _ in cache)  # nothing held yet
    ids = torch.randint(3, 96, (1, 20))
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    items = list(cache)
    assert [w is not None for _, _, w in items] == [True] * 5 + [False]  # sliding layers carry their window
    assert all(k.shape[-2] <= 20 for k, _, _ in items)


# ---------------------------------------------------------------------- crop after single-token steps
KINDS = {
    "log-quantize": dict(policy="log", window=4, bits=4, group_size=16),
    "log-evict": dict(policy="log", window=4, action="evict"),
    "kvpolicy-3bit": "kvpolicy-3bit",
    "sinks-over-log": dict(policy="log", window=4, sinks=2, bits=4, group_size=16),
}


def _cache(spec) -> CompressedCache:
    return CompressedCache.from_preset(spec) if isinstance(spec, str) else CompressedCache(**spec)


@pytest.mark.parametrize("name", list(KINDS))
def test_crop_of_single_steps_that_demoted_nothing_is_exact_and_others_are_refused(model, name):
    """After each decode step, crop(-1) is served exactly when the step demoted nothing (the cache then equals
    a copy taken before the step: the same next logits, positions and bytes), refused by name otherwise, and
    ``is_croppable`` says which beforehand."""
    ids = torch.randint(3, 96, (2, 80), generator=torch.Generator().manual_seed(1))
    served = refused = 0
    cache = _cache(KINDS[name])
    with torch.no_grad():
        model(ids[:, :20], cache=cache, use_cache=True)
        for t in range(20, 60):
            before = copy.deepcopy(cache)
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
            croppable = cache.is_croppable
            trial = copy.deepcopy(cache)
            try:
                trial.crop(-1)
            except ValueError as exc:
                assert not croppable and "single-token step(s) that demoted nothing" in str(exc)
                refused += 1
                continue
            assert croppable
            served += 1
            nxt = ids[:, t + 1 : t + 2]
            a = model(nxt, cache=trial, use_cache=True).logits
            b = model(nxt, cache=before, use_cache=True).logits
            assert torch.equal(a, b), t
            for key, value in trial.positions(0).items():
                assert torch.equal(value, before.positions(0)[key])
            assert trial.memory_report().total_bytes == before.memory_report().total_bytes
    assert served > 0 and refused > 0


def test_crop_of_several_single_steps(model):
    ids = torch.randint(3, 96, (1, 80), generator=torch.Generator().manual_seed(2))
    cache = CompressedCache(policy="log", window=32, bits=4, group_size=16)  # 96 tokens before any demotion
    with torch.no_grad():
        model(ids[:, :20], cache=cache, use_cache=True)
        before = copy.deepcopy(cache)
        for t in range(20, 25):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
        cache.crop(-5)
        assert cache.get_seq_length() == 20
        a = model(ids[:, 20:21], cache=cache, use_cache=True).logits
        b = model(ids[:, 20:21], cache=before, use_cache=True).logits
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"or the 1 latest single-token step\(s\)"):
        cache.crop(-2)


FLUSH = dict(policy="recent", window=6, variant="flush", bits=4, group_size=16)


@pytest.mark.parametrize("spec", [FLUSH, dict(policy="h2o", heavy=4, recent=4, action="evict")])
def test_crop_after_a_single_step_of_a_policy_whose_state_is_more_than_its_length_is_refused(model, spec):
    from kvpolicy.attention import disable_scores, enable_scores

    enable_scores(model)
    try:
        cache = CompressedCache(**spec)
        _filled(model, cache, prompt=20, steps=1)
        assert not cache.is_croppable
        with pytest.raises(ValueError, match="crop"):
            cache.crop(-1)
    finally:
        disable_scores(model)
