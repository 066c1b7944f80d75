"""Tests of the ``quantize`` action: validation, staging, non-finite checks and byte accounting."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy.actions.quantize import Quantize, QuantizedStore, QuantizedStream
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.errors import ConfigError, NonFiniteError

BACKEND = TorchBackend()


# --------------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"bits": 0}, "bits=0"),
        ({"bits": 9}, "bits=9"),
        ({"bits": "2"}, "bits='2'"),
        ({"bits": True}, "bits=True"),
        ({"bits": 2.0}, "bits=2.0"),
        ({"group_size": 0}, "group_size=0"),
        ({"group_size": -4}, "group_size=-4"),
        ({"key_axis": "row"}, "key_axis='row'"),
        ({"value_axis": "tokens"}, "value_axis='tokens'"),
        ({"check_finite": "yes"}, "check_finite='yes'"),
        ({"check_finite": 1}, "check_finite=1"),
    ],
)
def test_quantize_validation(kwargs, needle):
    with pytest.raises(ConfigError) as ei:
        Quantize(**kwargs)
    assert needle in str(ei.value)


def test_quantize_axis_message_lists_allowed():
    with pytest.raises(ConfigError) as ei:
        Quantize(key_axis="row")
    assert "'token'" in str(ei.value) and "'channel'" in str(ei.value)


def test_quantize_defaults_valid():
    q = Quantize()
    assert (q.bits, q.group_size, q.key_axis, q.value_axis, q.check_finite) == (2, 64, "channel", "token", True)
    q.check_backend(BACKEND)
    assert isinstance(q.new_store(BACKEND, 0), QuantizedStore)


def test_quantize_bits_3_rejected_by_backend():
    q = Quantize(bits=3)  # the action allows 1..8; the torch backend does not pack 3 bits
    with pytest.raises(ConfigError) as ei:
        q.check_backend(BACKEND)
    assert "bits=3" in str(ei.value) and "[2, 4, 8]" in str(ei.value)


def test_check_head_dim_names_group_size_and_divisors():
    with pytest.raises(ConfigError) as ei:
        Quantize(group_size=48).check_head_dim(64)
    msg = str(ei.value)
    assert "group_size=48" in msg and "head_dim=64" in msg
    listed = [int(v) for v in re.search(r"\[([0-9, ]+)\]", msg).group(1).split(",")]
    assert listed, msg
    assert all(64 % g == 0 for g in listed)
    assert {8, 16, 32, 64} <= set(listed)
    assert 48 not in listed


@pytest.mark.parametrize(("key_axis", "value_axis"), [("token", "channel"), ("channel", "token"), ("token", "token")])
def test_check_head_dim_any_token_axis_needs_divisor(key_axis, value_axis):
    with pytest.raises(ConfigError):
        Quantize(group_size=48, key_axis=key_axis, value_axis=value_axis).check_head_dim(64)


def test_check_head_dim_channel_axes_ignore_head_dim():
    # G runs along tokens for both: head_dim need not be a multiple of it
    Quantize(group_size=48, key_axis="channel", value_axis="channel").check_head_dim(64)
    Quantize(group_size=32).check_head_dim(64)


# --------------------------------------------------------------------------------------------------
# non-finite inputs
# --------------------------------------------------------------------------------------------------


def _kv(n=4, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, n, 16, generator=gen).to(dtype), torch.randn(1, 2, n, 16, generator=gen).to(dtype)


@pytest.mark.parametrize("which", ["keys", "values"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_rejects_non_finite(which, bad, dtype):
    store = Quantize(bits=4, group_size=8).new_store(BACKEND, 3)
    k, v = _kv(dtype=dtype)
    (k if which == "keys" else v)[0, 1, 2, 5] = bad
    with pytest.raises(NonFiniteError) as ei:
        store.add(k, v, torch.arange(4)[None])
    msg = str(ei.value)
    assert "NaN" in msg and "Inf" in msg and "check_finite=False" in msg
    assert which in msg
    # nothing was stored
    assert len(store) == 0 and store.k.q is None and store.k.staging is None and store.v.q is None


@pytest.mark.parametrize("which", ["keys", "values"])
def test_store_check_finite_off(which):
    store = Quantize(bits=4, group_size=8, check_finite=False).new_store(BACKEND, 0)
    k, v = _kv(n=8)
    (k if which == "keys" else v)[0, 0, 1, 1] = float("nan")
    store.add(k, v, torch.arange(8)[None])
    assert len(store) == 8


# --------------------------------------------------------------------------------------------------
# staging along the channel axis
# --------------------------------------------------------------------------------------------------


def _staging_rows(stream):
    return 0 if stream.staging is None else stream.staging.shape[2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_channel_stream_staging(dtype):
    gen = torch.Generator().manual_seed(7)
    stream = QuantizedStream(BACKEND, 2, 8, "channel")
    chunks = [(torch.randn(2, 3, n, 16, generator=gen) * (i + 1)).to(dtype) for i, n in enumerate((5, 3, 11))]

    stream.append(chunks[0])
    assert stream.num_quantized == 0 and stream.q is None and _staging_rows(stream) == 5
    stream.append(chunks[1])
    assert stream.num_quantized == 8 and _staging_rows(stream) == 0
    stream.append(chunks[2])
    assert stream.num_quantized == 16 and _staging_rows(stream) == 3

    x = torch.cat(chunks, dim=2)
    out = stream.read()
    assert out.shape == x.shape and out.dtype == dtype
    # staged tokens: bit-identical
    assert torch.equal(out[:, :, 16:], x[:, :, 16:])
    # quantized tokens: within s/2 (+ output-dtype rounding) of the original, s of their group:
    # group (b, h, i, d) covers tokens i*8 .. i*8+7 of channel d
    s = stream.q.scales.double().repeat_interleave(8, dim=2)
    fi = torch.finfo(dtype)
    xd = x[:, :, :16].double()
    err = (out[:, :, :16].double() - xd).abs()
    assert (err <= s / 2 + fi.eps * (xd.abs() + s) + 1e-6 * (xd.abs() + s)).all()


@settings(max_examples=50, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 12), min_size=1, max_size=8),
    g=st.sampled_from([4, 8, 16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_store_counts_and_order(chunks, g, seed):
    """Keys per channel (staged), values per token: counts, staged positions, and read order."""
    gen = torch.Generator().manual_seed(seed)
    store = Quantize(bits=8, group_size=g, key_axis="channel", value_axis="token").new_store(BACKEND, 0)
    ks, vs, pos = [], [], []
    start = 0
    for n in chunks:
        k, v = torch.randn(1, 2, n, 16, generator=gen), torch.randn(1, 2, n, 16, generator=gen)
        p = torch.randperm(1000, generator=gen)[:n][None]  # (1, n): one row, a shared policy
        store.add(k, v, p)
        ks.append(k)
        vs.append(v)
        pos.append(p)
        start += n
    total = start
    assert len(store) == total
    assert torch.equal(store.positions, torch.cat(pos, dim=1))
    assert store.k.num_quantized == total - total % g
    assert store.v.num_quantized == total
    assert torch.equal(store.staged_key_positions(), torch.cat(pos, dim=1)[:, total - total % g :])
    assert store.staged_value_positions().numel() == 0
    K, V = torch.cat(ks, 2), torch.cat(vs, 2)
    # 8 bits: coarse order check -- every token comes back near its original
    assert (store.keys() - K).abs().max() < 0.1
    assert (store.values() - V).abs().max() < 0.1
    assert torch.equal(store.keys()[:, :, store.k.num_quantized :], K[:, :, store.k.num_quantized :])


# --------------------------------------------------------------------------------------------------
# byte accounting, checked by walking the object graph
# --------------------------------------------------------------------------------------------------


def _held_tensors(obj, seen=None):
    """Every tensor reachable from ``obj`` through instance attributes / containers (by identity)."""
    if seen is None:
        seen = {}
    if isinstance(obj, torch.Tensor):
        seen.setdefault(id(obj), obj)
        return seen
    if id(obj) in seen:
        return seen
    seen[id(obj)] = None
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = list(vars(obj).values())
    else:
        items = []
    for item in items:
        _held_tensors(item, seen)
    return seen


def _walked_bytes(store):
    tensors = [t for t in _held_tensors(store).values() if isinstance(t, torch.Tensor)]
    return sum(t.element_size() * t.numel() for t in tensors), tensors


@settings(max_examples=50, deadline=None)
@given(
    bits=st.sampled_from([2, 4, 8]),
    g=st.sampled_from([4, 8, 16]),
    key_axis=st.sampled_from(["token", "channel"]),
    value_axis=st.sampled_from(["token", "channel"]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    chunks=st.lists(st.integers(1, 10), min_size=0, max_size=6),
    seed=st.integers(0, 2**31 - 1),
)
def test_store_nbytes_equals_bytes_held(bits, g, key_axis, value_axis, dtype, chunks, seed):
    gen = torch.Generator().manual_seed(seed)
    store = Quantize(bits=bits, group_size=g, key_axis=key_axis, value_axis=value_axis).new_store(BACKEND, 0)
    start = 0
    for n in chunks:
        k, v = (torch.randn(2, 2, n, 16, generator=gen).to(dtype) for _ in range(2))
        store.add(k, v, torch.arange(start, start + n)[None])
        start += n
    walked, tensors = _walked_bytes(store)
    reported = store.nbytes()
    assert sum(reported.values()) == walked
    # the walk really found the containers' tensors
    for stream in (store.k, store.v):
        if stream.q is not None:
            assert any(t is stream.q.codes for t in tensors)
        if stream.staging is not None:
            assert any(t is stream.staging for t in tensors)
    # per role: staging counted at full precision, positions as int64
    staged = sum(s.staging.numel() * s.staging.element_size() for s in (store.k, store.v) if s.staging is not None)
    assert reported["staging"] == staged
    assert reported["positions"] == 8 * start


def test_check_head_dim_suggests_only_sizes_the_backend_packs():
    with pytest.raises(ConfigError) as ei:
        Quantize(group_size=64).check_head_dim(96, multiple=4)
    assert "[4, 8, 12, 16, 24, 32, 48, 96]" in str(ei.value)
