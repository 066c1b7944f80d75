"""Separate key and value code widths (``key_bits``/``value_bits``) in every backend and on the fused path."""

from __future__ import annotations

import pytest
import torch
from conftest import fused_and_materialized

from kvpolicy import CompressedCache, Quantize, registry

PAIRS = [(4, 2), (2, 4)]


def _backend(name: str):
    return registry.get("backends", name)()


def _step(x: torch.Tensor, bits: int, g: int, axis: str) -> torch.Tensor:
    """Per-element min-max step of ``x`` (``(b, h, t, d)``) in groups of ``g`` along ``axis``."""
    b, h, t, d = x.shape
    if axis == "token":
        xg = x.double().reshape(b, h, t, d // g, g)
        s = (xg.amax(-1) - xg.amin(-1)) / (2**bits - 1)
        return s.repeat_interleave(g, dim=3)
    xg = x.double().reshape(b, h, t // g, g, d)
    s = (xg.amax(3) - xg.amin(3)) / (2**bits - 1)
    return s.repeat_interleave(g, dim=2)


@pytest.mark.parametrize("name", ["torch", "cpu"])
@pytest.mark.parametrize(("key_bits", "value_bits"), PAIRS)
def test_every_backend_stores_each_kind_at_its_width(name, key_bits, value_bits, cpu_kernel):
    """Keys and values come back within their own width's step, and agree with the ``torch`` reference within
    one step (the core's backends; a plugin's backends are checked in its own tests). Min-max ranges here
    (``fit="minmax"``): fitted ranges give up the half-step bound (tests/test_fit.py)."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 64, 32, generator=g), torch.randn(1, 2, 64, 32, generator=g)
    action = Quantize(key_bits=key_bits, value_bits=value_bits, group_size=16, fit="minmax")
    be = _backend(name)
    action.check_backend(be)
    store = action.new_store(be, 0)
    store.add(k, v, torch.arange(64, dtype=torch.int32)[None])
    assert (store.k.q.bits, store.v.q.bits) == (key_bits, value_bits)
    ref = action.new_store(_backend("torch"), 0)
    ref.add(k, v, torch.arange(64, dtype=torch.int32)[None])
    for kind, x, bits, axis, got, want in (
        ("keys", k, key_bits, "channel", store.keys(), ref.keys()),
        ("values", v, value_bits, "token", store.values(), ref.values()),
    ):
        s = _step(x, bits, 16, axis)
        err = (got.double() - x.double()).abs()
        assert (err <= s / 2 + 1e-3 * s + 1e-6).all(), f"{name} {kind}: beyond half a {bits}-bit step"
        assert ((got.double() - want.double()).abs() <= s + 1e-3 * s + 1e-6).all(), f"{name} {kind} vs torch"
    # the wider kind's absolute error is the smaller one (both inputs are standard normal)
    abs_err = {
        kind: float((x - y).abs().mean()) for kind, x, y in (("keys", k, store.keys()), ("values", v, store.values()))
    }
    wide, narrow = ("keys", "values") if key_bits > value_bits else ("values", "keys")
    assert abs_err[wide] < 0.5 * abs_err[narrow]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize(("key_bits", "value_bits"), [*PAIRS, (3, 2), (2, 3), (3, 4)])
def test_fused_equals_materialized_with_mixed_bits(backend, key_bits, value_bits, cpu_kernel):
    got, ref, cache = fused_and_materialized(key_bits=key_bits, value_bits=value_bits, backend=backend)
    assert set(cache.attention_paths().values()) == {f"fused ({backend})"}
    layer = cache.layers[0]
    assert (layer.engine.held.store.k.q.bits, layer.engine.held.store.v.q.bits) == (key_bits, value_bits)
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)


def test_more_key_bits_cost_the_bytes_of_the_key_codes_only():
    g = torch.Generator().manual_seed(0)
    reports = {}
    for pair in ((2, 2), (4, 2)):
        cache = CompressedCache(policy="log", window=8, key_bits=pair[0], value_bits=pair[1], group_size=16)
        k, v = torch.randn(1, 2, 200, 32, generator=g), torch.randn(1, 2, 200, 32, generator=g)
        cache.update(k, v, 0)
        reports[pair] = cache.memory_report().segments
    extra = reports[(4, 2)]["codes"] - reports[(2, 2)]["codes"]
    quantized_keys = cache.layers[0].engine.held.store.k.num_quantized
    assert extra == quantized_keys * 2 * 32 * 2 // 8  # 2 more bits per quantized key element
    assert {s: reports[(4, 2)][s] for s in reports[(4, 2)] if s != "codes"} == {
        s: reports[(2, 2)][s] for s in reports[(2, 2)] if s != "codes"
    }


def test_cache_keywords_route_to_the_action_and_refuse_contradictions():
    cache = CompressedCache(policy="log", key_bits=4, value_bits=2)
    assert (cache.action.keys.bits, cache.action.values.bits) == (4, 2)
    assert "key_bits=4, value_bits=2" in repr(cache)
    with pytest.raises(Exception, match="contradicts key_bits=4"):
        CompressedCache(policy="log", bits=2, key_bits=4)


def test_three_bit_keys_run_fused_on_the_default_backend():
    """``backend="auto"`` picks the ``cpu`` kernel for 3-bit keys too; fused equals materialised."""
    chosen = CompressedCache(key_bits=3, value_bits=2, group_size=16).backend.name
    assert chosen in ("cpu", "torch")  # torch only where the kernel cannot build (warned)
    got, ref, cache = fused_and_materialized(key_bits=3, value_bits=2)
    assert set(cache.attention_paths().values()) == {f"fused ({chosen})"}
    codes = cache.layers[0].engine.held.store.k.q.codes
    assert codes.shape[-1] == 16 * 3 // 8  # eight codes per three bytes
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)
