"""kvpolicy.decode_mode: one switch for a model's attention implementation, restored on exit."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from kvpolicy import CompressedCache, decode_mode
from kvpolicy.attention import HOOK_ATTR
from kvpolicy.errors import ConfigError
from kvpolicy.fused import disable_fused, enable_fused
from kvpolicy.modes import MODES, attention_implementation

pytestmark = pytest.mark.usefixtures("one_thread")

WANT = {"fused": "kvpolicy_fused_{}", "scores": "kvpolicy_{}", "materialized": "{}"}


@pytest.fixture(scope="module")
def models():
    return {attn: tiny_model("llama", attn) for attn in ("sdpa", "eager")}


@pytest.fixture
def model(models):
    """The sdpa model, back as it was built after each test (however the test left it)."""
    m = models["sdpa"]
    yield m
    disable_fused(m)
    m.set_attn_implementation("sdpa")
    handle = getattr(m, HOOK_ATTR, None)
    if handle is not None:
        handle.remove()
        setattr(m, HOOK_ATTR, None)


def _state(model) -> tuple[str, bool, int]:
    """What decode_mode must restore: the implementation, whether kvpolicy's hook is installed, how many
    forward hooks the model has."""
    hooked = getattr(model, HOOK_ATTR, None) is not None
    return model.config._attn_implementation, hooked, len(model._forward_hooks)


def _ids(length: int) -> torch.Tensor:
    return torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(0))


def _decode(model, cache, prefill: int = 24, steps: int = 3) -> CompressedCache:
    ids = _ids(prefill + steps)
    with torch.inference_mode():
        model(ids[:, :prefill], cache=cache, use_cache=True)
        for t in range(prefill, prefill + steps):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("mode", MODES)
def test_each_mode_switches_and_restores(models, attn, mode):
    model = models[attn]
    before = _state(model)
    assert before == (attn, False, 0)
    with decode_mode(model, mode):
        assert model.config._attn_implementation == WANT[mode].format(attn)
        assert (getattr(model, HOOK_ATTR, None) is not None) == (mode != "materialized")
    assert _state(model) == before


@pytest.mark.parametrize("mode", MODES)
def test_restored_after_an_exception(model, mode):
    before = _state(model)
    with pytest.raises(KeyError, match="inside"), decode_mode(model, mode):
        assert model.config._attn_implementation == WANT[mode].format("sdpa")
        raise KeyError("inside")
    assert _state(model) == before


def test_materialized_is_the_models_own_implementation_and_the_hook_comes_back(model):
    """From a fused model: 'materialized' strips kvpolicy's prefix and hook; on exit both are back."""
    enable_fused(model)
    before = _state(model)
    assert before == ("kvpolicy_fused_sdpa", True, 1)
    with decode_mode(model, "materialized"):
        assert _state(model) == ("sdpa", False, 0)
    assert _state(model) == before
    with decode_mode(model, "scores"):
        assert _state(model)[:2] == ("kvpolicy_sdpa", True)
    assert _state(model) == before


def test_nested_modes_restore_what_the_outer_one_set(model):
    with decode_mode(model, "scores"):
        outer = _state(model)
        with decode_mode(model, "fused"):
            assert model.config._attn_implementation == "kvpolicy_fused_sdpa"
            with decode_mode(model, "materialized"):
                assert _state(model) == ("sdpa", False, 0)
            assert model.config._attn_implementation == "kvpolicy_fused_sdpa"
        assert _state(model) == outer == ("kvpolicy_sdpa", True, 1)
        with pytest.raises(RuntimeError), decode_mode(model, "materialized"):
            raise RuntimeError
        assert _state(model) == outer
    assert _state(model) == ("sdpa", False, 0)


def test_fused_mode_runs_kvpolicys_fused_function_and_materialized_does_not(model):
    kw = dict(policy="log", window=4, bits=4, group_size=16, backend="torch")
    with decode_mode(model, "fused"):
        fused = _decode(model, CompressedCache(**kw))
    assert set(fused.attention_paths().values()) == {"fused (torch)"}
    with decode_mode(model, "materialized"):
        plain = _decode(model, CompressedCache(**kw))
    paths = set(plain.attention_paths().values())
    assert paths and all(p.startswith("materialized") for p in paths)
    with decode_mode(model, "scores"):
        scored = _decode(model, CompressedCache(**kw))
    paths = set(scored.attention_paths().values())
    assert paths and all(p.startswith("materialized") for p in paths)


@pytest.mark.parametrize("mode", ["scores", "fused"])
def test_scores_reach_a_score_based_policy_in_scores_and_fused_modes_only(model, mode):
    kw = dict(policy="h2o", heavy=3, recent=2, action="evict")
    with decode_mode(model, mode):
        cache = _decode(model, CompressedCache(**kw))
    full = cache.positions(0)["full"]  # H2O is per head: (batch, kv_heads, heavy + recent)
    assert cache.get_seq_length() == 27 and full.shape[-1] == 5
    with decode_mode(model, "materialized"), pytest.raises(RuntimeError, match="enable_scores"):
        _decode(model, CompressedCache(**kw))


@pytest.mark.parametrize("bad", ["fast", "Fused", None, 1])
def test_a_bad_mode_is_refused_naming_the_allowed_ones(model, bad):
    before = _state(model)
    with (
        pytest.raises(
            ConfigError,
            match=rf"decode_mode: mode must be one of \['fused', 'materialized', 'scores'\]; got mode={bad!r}",
        ),
        decode_mode(model, bad),
    ):
        pytest.fail("the block must not run")
    assert _state(model) == before


@pytest.mark.parametrize("mode", ["fused", "scores"])
def test_an_implementation_kvpolicy_does_not_wrap_is_refused_and_left_alone(model, mode):
    model.config._attn_implementation = "flash_attention_2"  # as loaded, never run here
    with pytest.raises(ConfigError, match="flash_attention_2"), decode_mode(model, mode):
        pytest.fail("the block must not run")
    assert _state(model) == ("flash_attention_2", False, 0)
    with decode_mode(model, "materialized"):  # the model's own implementation: nothing to strip
        assert model.config._attn_implementation == "flash_attention_2"
    model.config._attn_implementation = "sdpa"


def test_attention_implementation_is_the_general_set_and_restore(model):
    enable_fused(model)
    before = _state(model)
    with attention_implementation(model, "eager"):
        assert model.config._attn_implementation == "eager"
        assert getattr(model, HOOK_ATTR, None) is not None  # only the implementation changes
    assert _state(model) == before
    with attention_implementation(model):  # the block switches, and is restored all the same
        disable_fused(model)
        assert _state(model) == ("sdpa", False, 0)
    assert _state(model) == before
    disable_fused(model)
    with attention_implementation(model):
        enable_fused(model)  # a hook the block installed is removed
    assert _state(model) == ("sdpa", False, 0)
