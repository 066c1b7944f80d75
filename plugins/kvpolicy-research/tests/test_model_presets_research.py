"""The research plugin's model presets: Gemma-3's query-hadamard preset is registered for Gemma-3's configs,
``for_model(model, "auto")`` builds it there (and says so), the default elsewhere or without the plugin, and
the file decodes a tiny Gemma-3 exactly as the composition it stands for."""

from __future__ import annotations

import pytest
import torch
from kvpolicy_research import model_presets_plugin, transforms_plugin
from research_cases import ids, teacher_forced_logits, tiny_model
from research_parts import research_parts  # noqa: F401 - fixture, and the plugin's parts registered

from kvpolicy import CompressedCache, model_presets, registry
from kvpolicy.attention import disable_scores, enable_scores
from kvpolicy.tiny import tiny_gemma3

NAME = "gemma3-3bit-qh"


@pytest.fixture(autouse=True, scope="module")
def model_presets_registered(research_parts):  # noqa: F811 - the fixture imported above
    """The plugin's transforms and model presets, registered by hand where the plugin is not installed."""
    if "query-hadamard" not in registry.names("transforms"):
        registry.register(transforms_plugin, "research-transforms")
    if NAME not in registry.names("model_presets"):
        registry.register(model_presets_plugin, "research-model-presets")
    yield


def test_the_gemma3_preset_is_registered_with_its_file_and_evidence():
    ((_, entry, source),) = [e for e in registry.entries("model_presets") if e[0] == NAME]
    assert source.distribution in ("kvpolicy-research", "research-model-presets")
    assert set(entry.model_types) == {"gemma3", "gemma3_text"}
    assert entry.path().name == "gemma3-3bit-qh.toml" and entry.path().parent.name == "model_presets"
    assert "Gemma-3-270M" in entry.evidence and "0.0176" in entry.evidence and "0.0686" in entry.evidence


def test_it_suits_gemma3_and_not_llama():
    assert [s.name for s in model_presets.suggest(tiny_gemma3())] == [NAME]
    assert model_presets.suggest(tiny_model("llama")) == []


def test_the_file_is_kvpolicy_3bit_with_query_weighted_keys():
    """The preset holds kvpolicy-3bit's bits: its composition with the transform swapped, nothing else."""
    model = tiny_gemma3()
    reference = CompressedCache.for_model(model, "kvpolicy-3bit", transform="query-hadamard")
    assert CompressedCache.for_model(model, NAME).spec == reference.spec


def test_auto_builds_it_on_gemma3_and_says_why():
    cache = CompressedCache.for_model(tiny_gemma3(), "auto")
    assert cache.preset.kind == "model preset" and cache.preset.name == NAME
    assert "transform=QueryWeighted(" in repr(cache)
    assert f"preset='{NAME}, the model preset of " in repr(cache) and "0.0176" in repr(cache)


def test_auto_is_the_default_on_llama():
    model = tiny_model("llama")
    cache = CompressedCache.for_model(model, "auto")
    assert cache.spec == CompressedCache.for_model(model).spec
    assert "no model preset is registered for model_type 'llama'" in repr(cache)


def test_without_the_plugins_model_presets_auto_is_the_default(monkeypatch):
    """Where no distribution registers a model preset (the plugin not installed), auto is the default."""
    monkeypatch.setenv(registry.ALLOW_ENV, "research-transforms,research-formats")
    registry.reset()
    try:
        if NAME in registry.names("model_presets"):  # pragma: no cover - only an entry point loads it
            pytest.fail("the allow-list should keep the plugin's model presets out")
        model = tiny_gemma3()
        cache = CompressedCache.for_model(model, "auto")
        assert cache.spec == CompressedCache.for_model(model).spec
        assert "transform=QueryWeighted(" not in repr(cache)
        assert "no model preset is registered for model_type 'gemma3_text'" in repr(cache)
    finally:
        monkeypatch.delenv(registry.ALLOW_ENV)
        registry.reset()
        if "query-hadamard" not in registry.names("transforms"):
            registry.register(transforms_plugin, "research-transforms")
        if NAME not in registry.names("model_presets"):
            registry.register(model_presets_plugin, "research-model-presets")


def test_the_preset_file_decodes_a_tiny_gemma3_as_its_composition():
    """Teacher-forced over a prompt long enough to fill both tiers: the auto cache's logits equal those of
    kvpolicy-3bit with query-weighted keys, bit for bit, and stay close to the uncompressed model's."""
    model = tiny_gemma3()
    tokens = ids(length=90, batch=1)
    enable_scores(model)
    try:
        auto = teacher_forced_logits(model, tokens, 70, CompressedCache.for_model(model, "auto"))
        same = CompressedCache.for_model(model, "kvpolicy-3bit", transform="query-hadamard")
        reference = teacher_forced_logits(model, tokens, 70, same)
        exact = teacher_forced_logits(model, tokens, 70, CompressedCache.for_model(model, action="none"))
    finally:
        disable_scores(model)
    assert torch.isfinite(auto).all()
    assert torch.equal(auto, reference)
    assert not torch.equal(auto, exact)  # the cache did compress
    assert (auto.softmax(-1) - exact.softmax(-1)).abs().max() < 0.2
