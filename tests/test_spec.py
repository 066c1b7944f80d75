"""The spec: every name becomes a part in one place, a spec survives JSON, and ``plan`` decides a layer's
backend and decode path (kvpolicy/spec.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy import CacheSpec, CompressedCache, registry
from kvpolicy.actions.quantize import Quantize
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.errors import CacheFileError, ConfigError
from kvpolicy.hookspecs import hookimpl
from kvpolicy.layer.composition import Plan, choose_backend, plan
from kvpolicy.policies import HeavyHitters, LogWindow
from kvpolicy.spec import VERSION

#: keyword sets of CompressedCache, one per kind of composition the spec must carry
COMPOSITIONS = [
    dict(),
    dict(policy="log", window=16, bits=2, group_size=32),
    dict(policy="log", window=8, key_bits=3, value_bits=2, scheme="codebook", key_centre=True, transform="hadamard"),
    dict(policy="recent", window=32, variant="flush", prompt="keep_tail", bits=4),
    dict(policy="log", sinks=4, bits=3, key_fit="minmax"),
    dict(policy="sink", sinks=2, window=16, action="evict"),
    dict(policy="h2o", heavy=8, recent=8, action="evict"),
    dict(action="none"),
    dict(bits=2, layer_bits={0: 4, 3: (4, 3)}, backend="torch", layout="agnostic", attention="materialized"),
    dict(action="tiered", tiers=[{"bits": 4, "scheme": "codebook"}, {"bits": 2, "scheme": "codebook"}],
         keep=[{"name": "log", "window": 32}], transform="hadamard"),
    dict(policy="log", window=8, key_bits=3, value_bits=2, scheme="codebook", key_centre=True, norm_bits=8,
         transform="hadamard"),
    dict(policy="log", key_bits=4, value_bits=2, value_scheme="codebook", norm_bits=8, transform="hadamard"),
    dict(action="tiered", tiers=[{"bits": 4, "scheme": "codebook", "norm_bits": 8},
                                 {"key_bits": 3, "value_bits": 2, "scheme": "codebook", "key_centre": True}],
         keep=[{"name": "log", "window": 32}], transform="hadamard"),
]  # fmt: skip


@pytest.mark.parametrize("kw", COMPOSITIONS)
def test_the_cache_is_built_from_the_spec_its_keywords_resolve_to(kw):
    spec = CacheSpec.resolve(**kw)
    cache = CompressedCache(**kw)
    assert cache.spec == spec
    assert (cache.policy, cache.transform, cache.layout, cache.attention) == (
        spec.policy, spec.transform, spec.layout, spec.attention,
    )  # fmt: skip
    assert repr(CompressedCache.from_spec(spec)) == repr(cache)


@pytest.mark.parametrize("kw", COMPOSITIONS)
def test_a_spec_survives_json(kw):
    spec = CacheSpec.resolve(**kw)
    data = json.loads(json.dumps(spec.to_dict()))
    assert data["type"] == "kvpolicy.CacheSpec" and data["version"] == VERSION
    back = CacheSpec.from_dict(data)
    assert back == spec and back.to_dict() == spec.to_dict()


@pytest.mark.parametrize("name", registry.names("presets"))
def test_every_preset_is_a_spec_that_survives_json(name):
    spec = CacheSpec.from_preset(name)
    assert CompressedCache.from_preset(name).spec == spec
    assert CacheSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_preset_overrides_go_to_the_preset_or_the_spec():
    spec = CacheSpec.from_preset("logquant", budget=192, layout="agnostic", backend="torch")
    assert spec.policy == LogWindow(64) and spec.layout == "agnostic" and isinstance(spec.backend, TorchBackend)


@settings(max_examples=40, deadline=None)
@given(
    window=st.integers(1, 512), bits=st.sampled_from([2, 3, 4, 8]), group=st.sampled_from([16, 32, 64, 128]),
    axis=st.sampled_from(["token", "channel"]), layout=st.sampled_from(["ordered", "agnostic"]),
    attention=st.sampled_from(["auto", "materialized"]),
    widths=st.dictionaries(st.integers(0, 30), st.tuples(st.sampled_from([2, 4]), st.sampled_from([2, 4])), max_size=3),
)  # fmt: skip
def test_property_to_dict_and_from_dict_are_inverse(window, bits, group, axis, layout, attention, widths):
    spec = CacheSpec.resolve(policy="log", window=window, bits=bits, group_size=group, key_axis=axis,
                             layout=layout, attention=attention, layer_bits=widths, backend="torch")  # fmt: skip
    assert CacheSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_equal_specs_give_equal_dicts_and_different_ones_differ():
    a, b = CacheSpec.resolve(window=16, bits=2), CacheSpec.resolve(policy=LogWindow(16), action=Quantize(bits=2))
    assert a == b and a.to_dict() == b.to_dict()
    assert CacheSpec.resolve(window=16, bits=3).to_dict() != a.to_dict()


def test_auto_is_recorded_as_auto_not_as_the_backend_it_chose():
    data = CacheSpec.resolve(bits=2).to_dict()
    assert data["backend"] is None and data["backend_auto"] is True


def test_a_composition_written_before_the_spec_had_a_type_still_reads():
    """Files saved before the spec recorded the backend ``auto`` chose beside ``backend_auto`` and had no
    type or version: the choice is made again."""
    data = CacheSpec.resolve(window=16, bits=2).to_dict()
    del data["type"], data["version"]
    data["backend"] = {"name": "cpu", "params": {}}
    assert CacheSpec.from_dict(data) == CacheSpec.resolve(window=16, bits=2)


@pytest.mark.parametrize(
    "edit, error, match",
    [
        (lambda d: d["policy"].update(name="no-such-policy"), CacheFileError,
         r"policy 'no-such-policy', which is not installed.*registered policies"),
        (lambda d: d.update(version=VERSION + 1), CacheFileError, rf"version {VERSION + 1}; this kvpolicy reads"),
        (lambda d: d.update(type="something.Else"), ValueError, r"type is 'something.Else'"),
        (lambda d: d.update(extra=1), ValueError, r"extra"),
        (lambda d: d.update(layout="sideways"), ValueError, r"layout"),
        (lambda d: d.update(layer_bits={"-1": [4, 4]}), ValueError, r"layer_bits index '-1' is not a layer index"),
        (lambda d: d.update(layer_bits={"0": [4]}), ValueError, r"layer_bits\['0'\] is not a \(key_bits, value_bits\)"),
        (lambda d: d["action"]["params"].update(bits="two"), ConfigError, r"bits"),
    ],
)  # fmt: skip
def test_from_dict_refuses_what_it_cannot_trust(edit, error, match):
    data = CacheSpec.resolve(window=16, bits=2).to_dict()
    edit(data)
    with pytest.raises(error, match=match):
        CacheSpec.from_dict(data, "cache.kvc")


@pytest.mark.parametrize("value", [12, "8", True, None])
def test_from_dict_refuses_a_codebook_norm_width_it_does_not_have(value):
    data = CacheSpec.resolve(scheme="codebook", norm_bits=8, transform="hadamard").to_dict()
    data["action"]["params"]["values"]["part"]["params"]["norm_bits"] = value
    with pytest.raises(ConfigError, match=rf"norm_bits must be one of \[16, 8\]; got norm_bits={value!r}"):
        CacheSpec.from_dict(json.loads(json.dumps(data)))


def test_parts_must_be_parts():
    with pytest.raises(ConfigError, match=r"CacheSpec: policy must be a Policy object; got policy='log'"):
        CacheSpec(policy="log", action=Quantize())
    with pytest.raises(ConfigError, match=r"from_spec takes a CacheSpec"):
        CompressedCache.from_spec({"policy": "log"})


def test_a_parameter_that_is_not_json_cannot_be_written():
    spec = CacheSpec.resolve(window=16, bits=2)
    odd = dataclasses.replace(spec, policy=dataclasses.replace(spec.policy))
    object.__setattr__(odd.policy, "window", torch.tensor(3))
    with pytest.raises(TypeError, match=r"policy 'log': parameter window=.* is not a JSON value"):
        odd.to_dict()


# ---------------------------------------------------------------------- plan
class _Scored(LogWindow):
    name = "scored"
    needs_scores = True


class _Unfused(TorchBackend):
    name = "unfused"
    capabilities = dataclasses.replace(TorchBackend.capabilities, fused=False)


def test_plan_says_why_decode_cannot_run_fused():
    torch_backend, q = TorchBackend(), Quantize(bits=2)
    assert plan(LogWindow(8), q, torch_backend, auto=False, attention="auto").fused_reason is None
    assert plan(LogWindow(8), q, torch_backend, auto=False, attention="materialized").fused_reason == (
        "attention='materialized'"
    )
    assert plan(HeavyHitters(4, 4), q, torch_backend, auto=False, attention="auto").fused_reason == (
        "policy 'h2o' selects per head"
    )
    assert plan(_Scored(8), q, torch_backend, auto=False, attention="auto").fused_reason == (
        "policy 'scored' needs attention scores over every key"
    )
    assert plan(LogWindow(8), q, _Unfused(), auto=False, attention="auto").fused_reason == (
        "backend 'unfused' cannot attend over its blocks without dequantizing them"
    )


class _CudaOnly(TorchBackend):
    name = "cuda-only"
    capabilities = dataclasses.replace(TorchBackend.capabilities, devices=("cuda",))


def test_plan_chooses_again_only_for_auto_and_only_where_the_backend_cannot_take_the_tensors():
    q = Quantize(bits=2)
    chosen = plan(LogWindow(8), q, _CudaOnly(), auto=True, attention="auto", device_type="cpu", dtype=torch.float32)
    assert chosen.backend.name == choose_backend([q], "cpu", torch.float32).name != "cuda-only"
    kept = plan(LogWindow(8), q, _CudaOnly(), auto=False, attention="auto", device_type="cpu", dtype=torch.float32)
    assert kept.backend.name == "cuda-only"
    before = plan(LogWindow(8), q, _CudaOnly(), auto=True, attention="auto")  # construction: no device yet
    assert before.backend.name == "cuda-only"


def test_plan_adapts_defaults_to_the_head_dim_and_says_so():
    got = plan(LogWindow(8), Quantize(bits=2), TorchBackend(), auto=False, attention="auto", key_dim=80, value_dim=80)
    assert isinstance(got, Plan) and got.action.values.group_size == 40
    assert got.notes == ("value_group_size=40 (the default 64 does not divide the value head_dim 80)",)


def test_choose_backend_gives_torch_when_one_layer_needs_it():
    assert choose_backend([Quantize(bits=2), Quantize(bits=8)], "cpu").name == "torch"
    assert choose_backend([Quantize(bits=2)], "mps").name == "torch"


class _SpecPresets:
    """A plugin whose preset returns a spec rather than keywords."""

    @staticmethod
    @hookimpl
    def kvpolicy_register_presets():
        def tight(window: int = 8):
            return CacheSpec.resolve(policy="log", window=window, bits=2, layout="agnostic")

        return {"tight-spec": tight}


def test_a_preset_may_return_a_spec():
    registry.register(_SpecPresets, "spec-presets")
    try:
        spec = CacheSpec.from_preset("tight-spec", window=4, attention="materialized")
        assert spec == CacheSpec.resolve(policy="log", window=4, bits=2, layout="agnostic", attention="materialized")
    finally:
        registry.unregister(_SpecPresets)
