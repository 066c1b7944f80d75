"""The hand-off between ``CompressedLayer.update`` and attention (kvpolicy.handoff).

Whatever consumes a compressed layer's keys — kvpolicy's fused function, its score wrapper, the
model's own attention, a layer that reuses another layer's keys — the result equals the
materialised position-order reference, and ``attention_paths()`` says which path ran.
"""

from __future__ import annotations

import dataclasses
import gc
import warnings
import weakref

import pytest
import torch
from conftest import teacher_forced_logits, tiny_model

from kvpolicy import CompressedCache, handoff, registry
from kvpolicy.attention import disable_scores, enable_scores
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.errors import ConfigError
from kvpolicy.fused import disable_fused, enable_fused
from kvpolicy.handoff import HandedOff
from kvpolicy.hookspecs import hookimpl

KW = dict(policy="log", window=8, bits=2, group_size=16)
FOREIGN = "materialized ({}): the model's attention is not kvpolicy's fused function (kvpolicy.fused.enable_fused)"


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


def _tiny_gemma4(kv_shared: int = 2, layers: int = 4) -> torch.nn.Module:
    """A tiny Gemma 4 whose last ``kv_shared`` layers reuse the keys and values of an earlier layer."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    cfg = Gemma4TextConfig(
        vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, global_head_dim=64, num_kv_shared_layers=kv_shared,
        layer_types=["full_attention"] * layers, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, hidden_size_per_layer_input=16, vocab_size_per_layer_input=96,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    return model


def _steps(model, ids, prefill, cache, *, mask=None, switch_at=None, switch=None):
    """Teacher-forced logits, optionally calling ``switch(model)`` before step ``switch_at``."""
    outs = []
    with torch.inference_mode():
        for t in range(prefill, ids.shape[1] + 1):
            if switch_at is not None and t == switch_at:
                switch(model)
            lo = 0 if t == prefill else t - 1
            kw = {} if mask is None else {"attention_mask": mask(lo, t), "position_ids": torch.arange(lo, t)[None]}
            out = model(ids[:, lo:t], cache=cache, use_cache=True, **kw)
            outs.append(out.logits[:, -1].float())
    return torch.stack(outs, 1)


# ---------------------------------------------------------------------- a change of attention mid-run
@pytest.mark.parametrize("switch", ["disable_fused", "set_attn_implementation"])
def test_changing_attention_mid_run_stays_correct(switch):
    """The consumer after the switch is the model's own sdpa: it gets the history in position order."""
    model = tiny_model("llama")
    ids = _ids(1, 60)
    ref = _steps(model, ids, 40, CompressedCache(**KW, attention="materialized"))
    enable_fused(model)
    try:
        cache = CompressedCache(**KW)
        flip = disable_fused if switch == "disable_fused" else (lambda m: m.set_attn_implementation("sdpa"))
        got = _steps(model, ids, 40, cache, switch_at=50, switch=flip)
    finally:
        disable_fused(model)
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)
    assert set(cache.attention_paths().values()) == {FOREIGN.format(cache.backend.name)}


def test_fused_after_materialized_steps():
    """Enabling the fused function mid-run takes effect on the very next decode step."""
    model = tiny_model("llama")
    ids = _ids(1, 56)
    ref = _steps(model, ids, 40, CompressedCache(**KW, attention="materialized"))
    cache = CompressedCache(**KW)
    try:
        got = _steps(model, ids, 40, cache, switch_at=48, switch=enable_fused)
        assert set(cache.attention_paths().values()) == {f"fused ({cache.backend.name})"}
    finally:
        disable_fused(model)
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)


def test_fused_mode_refuses_a_foreign_consumer_before_computing():
    model = tiny_model("llama")
    ids = _ids(1, 44)
    cache = CompressedCache(**KW, attention="fused")
    with torch.inference_mode():
        model(ids[:, :40], cache=cache, use_cache=True)
        with pytest.raises(RuntimeError, match="enable_fused"):
            model(ids[:, 40:41], cache=cache, use_cache=True)


# ---------------------------------------------------------------------- shared-KV layers (Gemma 4)
@pytest.mark.parametrize("wrapper", ["fused", "scores", "none"])
def test_shared_kv_layers_see_the_whole_history(wrapper):
    """Gemma 4's last layers reuse the keys and values an earlier layer's update returned."""
    model = _tiny_gemma4()
    ids = _ids(1, 64)
    ref = _steps(model, ids, 40, CompressedCache(**KW, attention="materialized"))
    enable = {"fused": enable_fused, "scores": enable_scores, "none": lambda m: None}[wrapper]
    enable(model)
    try:
        cache = CompressedCache(**KW)
        got = _steps(model, ids, 40, cache)
    finally:
        disable_fused(model)
        disable_scores(model)
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)
    backend = cache.backend.name
    expected = f"fused ({backend})" if wrapper == "fused" else FOREIGN.format(backend)
    assert set(cache.attention_paths().values()) == {expected}
    assert len(cache.layers) == 2  # the reusing layers hold nothing of their own
    # and the quantized history really is attended by the reusing layers
    evicted = _steps(model, ids, 40, CompressedCache(policy="log", window=8, action="evict"))
    assert (got - evicted).abs().max() > 1e-3


# ---------------------------------------------------------------------- layout="agnostic" and masks
def _hole_mask(lo: int, t: int) -> torch.Tensor:
    """The 4-D mask of the forward over positions ``[lo, t)``: causal, and key 3 hidden from every query (a
    custom mask, the model's own business: a compressed cache reads padding from a 2-D mask only, and refuses
    a 2-D mask with a hole)."""
    query = torch.arange(lo, t)[:, None]
    key = torch.arange(t)[None, :]
    return ((key <= query) & (key != 3))[None, None]


@pytest.mark.parametrize("wrapper", ["none", "scores", "fused"])
@pytest.mark.parametrize("attention", ["auto", "materialized"])
def test_agnostic_layout_with_a_mask_hiding_a_past_token(wrapper, attention, monkeypatch):
    monkeypatch.setattr(handoff, "_warned", set())  # each warning is issued once per process
    model = tiny_model("llama")
    ids = _ids(1, 52)
    mask = _hole_mask
    ref = _steps(model, ids, 40, CompressedCache(**KW, attention="materialized"), mask=mask)
    {"fused": enable_fused, "scores": enable_scores, "none": lambda m: None}[wrapper](model)
    try:
        cache = CompressedCache(**KW, layout="agnostic", attention=attention)
        expected = "mask" if wrapper == "fused" and attention == "auto" else "agnostic"
        with pytest.warns(UserWarning, match=expected):
            got = _steps(model, ids, 40, cache, mask=mask)
    finally:
        disable_fused(model)
        disable_scores(model)
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)
    assert all("ordered view" in p or "mask" in p for p in cache.attention_paths().values())


def test_agnostic_layout_is_used_when_the_mask_allows_it():
    """Under a purely causal mask the score wrapper may use the agnostic view: same logits, no note."""
    model = tiny_model("llama")
    ids = _ids(1, 52)
    ref = _steps(model, ids, 40, CompressedCache(**KW, attention="materialized"))
    enable_scores(model)
    try:
        cache = CompressedCache(**KW, layout="agnostic", attention="materialized")
        got = _steps(model, ids, 40, cache)
    finally:
        disable_scores(model)
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)
    assert set(cache.attention_paths().values()) == {f"materialized ({cache.backend.name}): attention='materialized'"}


@pytest.mark.parametrize("wrapper", ["none", "scores"])
def test_agnostic_layout_on_sliding_window_layers_without_config(wrapper):
    """Mistral with a sliding window of 12 and no ``config=``: every layer is compressed, and the mask
    indexes keys by position, so the ordered view must be used."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=12, max_position_embeddings=4096, pad_token_id=0,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).eval()
    ids = _ids(1, 52)
    ref = _steps(model, ids, 40, CompressedCache(**KW, attention="materialized"))
    if wrapper == "scores":
        enable_scores(model)
    try:
        cache = CompressedCache(**KW, layout="agnostic", attention="materialized")
        got = _steps(model, ids, 40, cache)
    finally:
        disable_scores(model)
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)
    assert all("ordered view" in p for p in cache.attention_paths().values())


# ---------------------------------------------------------------------- backends that cannot fuse
class _NotFusable(TorchBackend):
    """The torch backend declaring no fused decode path, as a backend whose blocks cannot be cut to whole groups."""

    name = "not-fusable"
    capabilities = dataclasses.replace(TorchBackend.capabilities, fused=False)


class _Plugin:
    @hookimpl
    def kvpolicy_register_backends(self):
        return {_NotFusable.name: _NotFusable}


def test_a_backend_without_fused_attention_is_materialized_or_refused():
    plugin = _Plugin()
    registry.register(plugin, "not-fusable")
    try:
        with pytest.raises(ConfigError, match="attention='fused' cannot serve this composition: backend 'not-fusable'"):
            CompressedCache(**KW, backend="not-fusable", attention="fused")
        model = tiny_model("llama")
        ids = _ids(1, 48)
        ref = teacher_forced_logits(model, ids, 40, CompressedCache(**KW, backend="torch", attention="materialized"))
        enable_fused(model)
        try:
            cache = CompressedCache(**KW, backend="not-fusable")
            got = teacher_forced_logits(model, ids, 40, cache)
        finally:
            disable_fused(model)
    finally:
        registry.unregister(plugin)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    paths = cache.attention_paths().values()
    assert paths and all(p.startswith("materialized (not-fusable): backend 'not-fusable'") for p in paths)


# ---------------------------------------------------------------------- nothing outlives the cache
@pytest.mark.parametrize("policy", ["log", "h2o"])
def test_a_deleted_cache_is_freed(policy):
    model = tiny_model("llama")
    ids = _ids(1, 44)
    enable_fused(model)
    try:
        cache = CompressedCache(policy=policy, bits=2, group_size=16)
        teacher_forced_logits(model, ids, 40, cache)
        layer = weakref.ref(cache.layers[0])
        keys = weakref.ref(cache.layers[0].keys)
        del cache
        gc.collect()
        assert layer() is None and keys() is None
    finally:
        disable_fused(model)


def test_a_stale_hand_off_is_refused():
    """Keys returned by an older update cannot be used once the layer moved on."""
    cache = CompressedCache(**KW, layout="agnostic")
    g = torch.Generator().manual_seed(0)
    kv = lambda n: (torch.randn(1, 2, n, 64, generator=g), torch.randn(1, 2, n, 64, generator=g))  # noqa: E731
    cache.update(*kv(40), 0)
    old_k, _ = cache.update(*kv(1), 0)
    assert isinstance(old_k, HandedOff)
    assert old_k.shape == (1, 2, 41, 64)
    torch.testing.assert_close(old_k + 0, cache.layers[0].attention_view("ordered")[0])  # served in position order
    cache.update(*kv(1), 0)
    with pytest.raises(RuntimeError, match="after that layer changed"):
        old_k + 0


def test_scores_policy_with_a_foreign_attention_raises_at_once():
    """H2O's keys reaching an attention that reports no scores fail in that forward, not one later."""
    model = tiny_model("llama")
    ids = _ids(1, 30)
    cache = CompressedCache(policy="h2o", heavy=4, recent=4, bits=2, group_size=16)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="enable_scores"):
        model(ids, cache=cache, use_cache=True)


# ---------------------------------------------------------------------- review follow-ups
@pytest.mark.parametrize("layout", ["ordered", "agnostic"])
def test_gradients_reach_the_new_keys_and_values(layout):
    """A hand-off materialises below autograd, so a forward that records gradients gets plain tensors:
    the key/value projections receive the gradient DynamicCache gives them (none is silently cut)."""
    from transformers import DynamicCache

    model = tiny_model("llama")
    ids = _ids(1, 45)
    grads = {}
    for name, cache in (("dynamic", DynamicCache()), ("kvpolicy", CompressedCache(**KW, layout=layout))):
        with torch.no_grad():
            model(ids[:, :40], cache=cache, use_cache=True)
            for t in range(40, 44):
                model(ids[:, t : t + 1], cache=cache, use_cache=True)
        model.zero_grad()
        model(ids[:, 44:45], cache=cache, use_cache=True).logits.sum().backward()
        grads[name] = model.model.layers[1].self_attn.k_proj.weight.grad
        if name == "kvpolicy":
            assert set(cache.attention_paths().values()) == {
                f"materialized ({cache.backend.name}): autograd is recording (the fused path computes no gradients)"
            }
    assert grads["kvpolicy"] is not None and grads["kvpolicy"].norm() > 0
    # the same order of magnitude as an uncompressed cache (the history differs by quantization)
    ratio = float(grads["kvpolicy"].norm() / grads["dynamic"].norm())
    assert 0.3 < ratio < 3, ratio


def test_fused_mode_refuses_the_score_wrapper():
    """attention='fused' with only enable_scores: the wrapper is not the fused function."""
    model = tiny_model("llama")
    ids = _ids(1, 44)
    enable_scores(model)
    try:
        cache = CompressedCache(**KW, attention="fused")
        with torch.inference_mode():
            model(ids[:, :40], cache=cache, use_cache=True)
            with pytest.raises(RuntimeError, match="not its fused function"):
                model(ids[:, 40:41], cache=cache, use_cache=True)
    finally:
        disable_scores(model)


def test_attention_path_is_set_once_per_update():
    model = tiny_model("llama")
    ids = _ids(1, 60)
    cache = CompressedCache(**KW, layout="agnostic")
    paths = set()
    with torch.inference_mode():
        model(ids[:, :40], cache=cache, use_cache=True)
        for t in range(40, 60, 4):  # multi-token turns over a held history
            model(ids[:, t : t + 4], cache=cache, use_cache=True)
            paths |= set(cache.attention_paths().values())
    assert paths == {
        f"materialized ({cache.backend.name}): multi-token update; layout='agnostic' needs kvpolicy's attention "
        "wrapper (kvpolicy.fused.enable_fused or kvpolicy.attention.enable_scores) to check the mask; the ordered "
        "view was used"
    }


def test_a_hand_off_is_stale_once_deferred_demotions_ran():
    """Inspecting the cache applies the deferred demotions of a multi-token update; a hand-off of that
    update served afterwards would index the wrong segment, so it raises."""
    cache = CompressedCache(**KW, layout="agnostic")
    g = torch.Generator().manual_seed(0)
    cache.update(torch.randn(1, 2, 40, 64, generator=g), torch.randn(1, 2, 40, 64, generator=g), 0)
    cache.update(torch.randn(1, 2, 1, 64, generator=g), torch.randn(1, 2, 1, 64, generator=g), 0)
    keys, _ = cache.update(torch.randn(1, 2, 8, 64, generator=g), torch.randn(1, 2, 8, 64, generator=g), 0)
    assert isinstance(keys, HandedOff)
    cache.memory_report()
    with pytest.raises(RuntimeError, match="after that layer changed"):
        keys + 0


# ---------------------------------------------------------------------- the fast path without hidden knowledge
def test_a_model_loaded_with_the_fused_implementation(tmp_path):
    """``from kvpolicy import CompressedCache`` registers kvpolicy's attention implementations, so a model
    can be loaded with ``attn_implementation="kvpolicy_fused_sdpa"``; another model in the same process
    keeps its own implementation and logits."""
    from transformers import AutoModelForCausalLM, DynamicCache

    tiny_model("llama").save_pretrained(tmp_path)
    fast = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="kvpolicy_fused_sdpa").eval()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    ids = _ids(1, 52)
    ref = _steps(plain, ids, 40, CompressedCache(**KW, attention="materialized"))
    cache = CompressedCache(**KW)
    got = _steps(fast, ids, 40, cache)
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)
    assert set(cache.attention_paths().values()) == {f"fused ({cache.backend.name})"}
    assert plain.config._attn_implementation == "sdpa"
    dyn_plain = _steps(plain, ids, 40, DynamicCache())
    dyn_fast = _steps(fast, ids, 40, DynamicCache())
    torch.testing.assert_close(dyn_fast, dyn_plain, rtol=0, atol=1e-6)  # other caches are unaffected


def test_a_long_history_materialised_for_want_of_the_fused_function_warns_once(monkeypatch):
    monkeypatch.setattr(handoff, "_warned", set())
    monkeypatch.setattr(handoff, "LONG_HISTORY", 48)
    model = tiny_model("llama")
    ids = _ids(1, 60)
    with pytest.warns(UserWarning, match=r"enable_fused\(model\)") as record:
        _steps(model, ids, 50, CompressedCache(**KW))
    assert sum("rebuild the compressed history" in str(w.message) for w in record) == 1
    short = CompressedCache(**KW)
    monkeypatch.setattr(handoff, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _steps(model, ids[:, :45], 40, short)  # below the threshold: no warning
        enable_fused(model)
        try:
            _steps(model, ids, 50, CompressedCache(**KW))  # fused: nothing rebuilt, no warning
        finally:
            disable_fused(model)
