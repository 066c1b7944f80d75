"""``backend="auto"`` (the default): the fast backend where it serves, ``torch`` otherwise, never a crash."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import teacher_forced_logits, tiny_model

from kvpolicy import CompressedCache
from kvpolicy.errors import ConfigError
from kvpolicy.fused import disable_fused, enable_fused
from kvpolicy.kernels import cpu_attention
from kvpolicy.layer import composition as auto

KW = dict(policy="log", window=8, bits=2, group_size=16)


def test_default_is_the_cpu_kernel_on_cpu(cpu_kernel):
    cache = CompressedCache(**KW)
    assert cache.backend.name == "cpu"
    assert "backend='cpu'" in repr(cache)


@pytest.mark.parametrize(
    "kw", [dict(bits=8), dict(key_axis="token"), dict(value_axis="channel"), dict(action="none"), dict(action="evict")]
)
def test_compositions_the_kernel_does_not_serve_get_torch_silently(kw, cpu_kernel):
    kw = {**KW, **kw}
    if kw.get("action") in ("none", "evict"):
        kw = {k: v for k, v in kw.items() if k not in ("bits", "group_size")}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache = CompressedCache(**kw)
    assert cache.backend.name == "torch"


def test_no_compiler_falls_back_to_torch_with_one_warning(monkeypatch):
    """A machine without a C++ compiler (simulated): one warning naming why, then torch every time."""
    monkeypatch.setattr(auto, "_failed", {})

    def no_compiler():
        raise ConfigError("backend 'cpu' compiles a C++ kernel and found no C++ compiler ('c++' is not on PATH)")

    monkeypatch.setattr(cpu_attention, "load", no_compiler)
    with pytest.warns(UserWarning, match=r"backend='auto': the 'cpu' backend is not available \(.*no C\+\+ compiler"):
        first = CompressedCache(**KW)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = CompressedCache(**KW)
    assert first.backend.name == second.backend.name == "torch"
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (1, 48), generator=torch.Generator().manual_seed(0))
    ref = teacher_forced_logits(model, ids, 40, CompressedCache(**KW, backend="torch"))
    torch.testing.assert_close(teacher_forced_logits(model, ids, 40, second), ref, rtol=0, atol=0)


def test_a_layer_whose_dtype_the_kernel_does_not_take_gets_torch(cpu_kernel):
    cache = CompressedCache(**KW)
    assert cache.backend.name == "cpu"
    g = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(1, 2, 40, 64, generator=g, dtype=torch.float64) for _ in range(2))
    cache.update(keys, values, 0)
    assert cache.layers[0].engine.backend.name == "torch"
    assert cache.layers[0].attention_view("ordered")[0].dtype == torch.float64


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_equals_materialized_with_the_default_backend(family, cpu_kernel):
    model = tiny_model(family)
    ids = torch.randint(3, 96, (2, 75), generator=torch.Generator().manual_seed(1))
    ref = teacher_forced_logits(model, ids, 38, CompressedCache(**KW, attention="materialized"))
    enable_fused(model)
    try:
        cache = CompressedCache(**KW)
        got = teacher_forced_logits(model, ids, 38, cache)
    finally:
        disable_fused(model)
    assert cache.backend.name == "cpu"
    assert set(cache.attention_paths().values()) == {"fused (cpu)"}
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_of_a_cache_on_the_cpu_backend_continue_alike(how, cpu_kernel):
    import copy
    import pickle

    model = tiny_model("llama")
    ids = torch.randint(3, 96, (2, 60), generator=torch.Generator().manual_seed(2))
    enable_fused(model)
    try:
        cache = CompressedCache(**KW)
        teacher_forced_logits(model, ids[:, :50], 40, cache)
        twin = copy.deepcopy(cache) if how == "deepcopy" else pickle.loads(pickle.dumps(cache))
        assert twin.layers[0].engine.backend.name == "cpu"
        with torch.inference_mode():
            a = model(ids[:, 50:51], cache=cache, use_cache=True).logits
            b = model(ids[:, 50:51], cache=twin, use_cache=True).logits
    finally:
        disable_fused(model)
    assert set(twin.attention_paths().values()) == {"fused (cpu)"}
    torch.testing.assert_close(b, a, rtol=0, atol=0)
