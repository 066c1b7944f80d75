"""Tests of the ``quantize`` action: validation, staging, non-finite checks and byte accounting."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvpolicy.actions.quantize import Quantize, QuantizedStore, QuantizedStream
from kvpolicy.backends._optional import refuse_fitted_ranges
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.errors import ConfigError, MetadataOverflowError, NonFiniteError
from kvpolicy.formats import MinMax

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
    assert (q.keys.bits, q.values.bits, q.keys.axis, q.values.axis, q.check_finite) == (2, 2, "channel", "token", True)
    assert q.keys == MinMax(2, 128, "channel", "mse") and q.values == MinMax(2, 64, "token", "minmax")
    # group sizes by axis: 128 tokens per key channel, 64 channels per value token; keys fitted; all defaults
    assert (q.keys.group_size, q.values.group_size) == (128, 64)
    assert (q.keys.fit, q.values.fit) == ("mse", "minmax")
    assert q.defaulted == ("keys.fit", "keys.group_size", "values.group_size")
    assert Quantize(key_axis="token").keys.group_size == 64 and Quantize(value_axis="channel").values.group_size == 128
    q.check_backend(BACKEND)
    assert isinstance(q.new_store(BACKEND, 0), QuantizedStore)


def test_quantize_bits_5_rejected_by_backend():
    q = Quantize(bits=5)  # the action allows 1..8; the torch backend packs 2, 3, 4 and 8 bits
    with pytest.raises(ConfigError) as ei:
        q.check_backend(BACKEND)
    assert "bits=5" in str(ei.value) and "[2, 3, 4, 8]" in str(ei.value)


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
    stream = QuantizedStream(BACKEND, MinMax(2, 8, "channel"))
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
    bits=st.sampled_from([2, 3, 4, 8]),
    g=st.sampled_from([4, 8, 16]),
    key_axis=st.sampled_from(["token", "channel"]),
    value_axis=st.sampled_from(["token", "channel"]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    chunks=st.lists(st.integers(1, 10), min_size=0, max_size=6),
    seed=st.integers(0, 2**31 - 1),
)
def test_store_nbytes_equals_bytes_held(bits, g, key_axis, value_axis, dtype, chunks, seed):
    assume(bits != 3 or g % 8 == 0)  # 3-bit groups hold whole runs of eight codes
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


# --------------------------------------------------------------------------------------------------
# metadata range (meta_dtype) and the metadata check
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["float64", "half", "", 16, torch.float32])
def test_meta_dtype_validation(bad):
    with pytest.raises(ConfigError) as ei:
        Quantize(meta_dtype=bad)
    msg = str(ei.value)
    assert f"meta_dtype={bad!r}" in msg and "'auto'" in msg and "'float32'" in msg


def test_meta_dtype_none_is_the_default():
    """Every shortcut keyword's None means "not given": the default, "auto"."""
    assert Quantize(meta_dtype=None) == Quantize() and Quantize().keys.meta_dtype == "auto"


def test_meta_dtype_in_repr_only_when_set():
    """The repr names a cache in results: meta_dtype appears only when set, a fit only when the keywords
    shown would build another one (keys are fitted by default, so min-max keys say so)."""
    assert repr(Quantize(group_size=64, fit="minmax")) == (
        "Quantize(bits=2, group_size=64, key_axis='channel', value_axis='token', check_finite=True, key_fit='minmax')"
    )
    assert repr(Quantize(meta_dtype="float32")).endswith("check_finite=True, meta_dtype='float32', key_fit='mse')")
    assert Quantize(meta_dtype="float32") != Quantize()


class _AutoOnlyBackend(TorchBackend):
    """A backend that declares no ``meta_dtype`` choice: the formats it is handed keep ``"auto"``."""

    name = "auto-only"
    capabilities = dataclasses.replace(TorchBackend.capabilities, meta_dtypes=("auto",))

    def check_format(self, fmt, role=""):
        # nor a fit: min-max only, so caches on it pass key_fit="minmax" (the keys' default is "mse")
        super().check_format(fmt, role)
        refuse_fitted_ranges(self.name, fmt, role)

    def quantize(self, x, fmt, centre=None):
        assert fmt.meta_dtype == "auto" and fmt.fit == "minmax" and centre is None
        return super().quantize(x, fmt, centre=centre)


def test_meta_dtype_checked_against_the_backend():
    old = _AutoOnlyBackend()
    Quantize(key_fit="minmax").check_backend(old)
    with pytest.raises(ConfigError) as ei:  # the default fits keys, which this backend cannot
        Quantize().check_backend(old)
    assert str(ei.value) == (
        "backend 'auto-only' does not fit min-max ranges with key_fit='mse'; it "
        "supports fit in ['minmax'] (fit='mse': backends 'torch', 'cpu' and 'triton'). Pass key_fit='minmax' to use "
        "backend 'auto-only'"
    )
    store = Quantize(bits=4, group_size=8, key_fit="minmax").new_store(old, 0)  # "auto" is never passed on
    store.add(*_kv(n=8), torch.arange(8)[None])
    assert len(store) == 8
    with pytest.raises(ConfigError) as ei:
        Quantize(meta_dtype="float32", key_fit="minmax").check_backend(old)
    assert "'auto-only'" in str(ei.value) and "meta_dtype='float32'" in str(ei.value) and "['auto']" in str(ei.value)
    for ok in ("auto", "float16", "bfloat16", "float32"):
        Quantize(meta_dtype=ok).check_backend(BACKEND)


def _large_kv(magnitude, n=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 2, n, 16, generator=gen) * magnitude for _ in range(2))


@pytest.mark.parametrize("magnitude", [1e5, 1e6])
@pytest.mark.parametrize("which", ["keys", "values"])
@pytest.mark.parametrize("check_finite", [True, False])
def test_store_refuses_metadata_overflow(magnitude, which, check_finite):
    """float32 keys (per channel) or values (per token) beyond float16's range: a clear error naming the
    layer, the magnitude, the dtype and the remedy, whatever check_finite says; nothing is stored."""
    store = Quantize(bits=2, group_size=8, check_finite=check_finite).new_store(BACKEND, 3)
    k, v = _kv(n=8)
    big = next(_large_kv(magnitude, n=8))
    if which == "keys":
        k = big
    else:
        v = big
    with pytest.raises(MetadataOverflowError) as ei:
        store.add(k, v, torch.arange(8)[None])
    msg = str(ei.value)
    assert msg.startswith(f"{which} of layer 3: backend 'torch'")
    assert "float16 metadata" in msg and f"{float(big.abs().max()):.4g}" in msg and "meta_dtype='float32'" in msg
    assert isinstance(ei.value, NonFiniteError)
    assert len(store) == 0 and store.k.q is None and store.k.staging is None and store.v.q is None


@pytest.mark.parametrize("magnitude", [1e5, 1e6])
@pytest.mark.parametrize("meta_dtype", ["float32", "bfloat16"])
def test_store_keeps_large_values_with_wide_metadata(magnitude, meta_dtype):
    store = Quantize(bits=4, group_size=8, meta_dtype=meta_dtype).new_store(BACKEND, 0)
    k, v = _large_kv(magnitude, n=20)
    store.add(k, v, torch.arange(20)[None])
    assert store.k.q.scales.dtype == store.v.q.zeros.dtype == getattr(torch, meta_dtype)
    for stored, x, step in ((store.keys(), k, store.k.q.scales), (store.values(), v, store.v.q.scales)):
        assert torch.isfinite(stored).all()
        # within half of the largest stored step (plus float32 rounding)
        assert (stored - x).abs().max() <= float(step.float().max()) * (0.5 + 1e-5)
    # bytes held: the metadata at its real width (keys: 2 groups of 8 tokens x 16 channels; values: 20 tokens)
    size = torch.finfo(getattr(torch, meta_dtype)).bits // 8
    groups = 2 * (2 * 16) + 2 * 20 * 2
    assert store.nbytes()["scales"] == store.nbytes()["zeros"] == size * groups


class _BrokenMetaBackend(TorchBackend):
    """A plugin-like backend whose metadata overflows without it noticing (no check of its own)."""

    name = "broken-meta"

    def quantize(self, x, fmt, centre=None):
        q = super().quantize(x, fmt, centre=centre)
        q.scales[..., 0] = float("inf")
        return q


@pytest.mark.parametrize("which", ["keys", "values"])
def test_check_finite_covers_the_metadata_of_any_backend(which):
    """check_finite=True checks what the backend stored, not only its input: finite input that comes
    back with non-finite metadata raises, naming the layer and the backend; nothing is stored."""
    store = Quantize(bits=4, group_size=8, fit="minmax").new_store(_BrokenMetaBackend(), 5)
    k, v = _kv(n=8)
    if which == "values":  # keys are fine: only the values' metadata is broken
        store.k.backend = BACKEND
    with pytest.raises(MetadataOverflowError) as ei:
        store.add(k, v, torch.arange(8)[None])
    msg = str(ei.value)
    assert msg.startswith(f"{which} of layer 5: backend 'broken-meta'") and "non-finite scales" in msg
    assert len(store) == 0 and store.k.q is None and store.k.staging is None and store.v.q is None
    # switched off, the store takes the backend's word for it
    unchecked = Quantize(bits=4, group_size=8, check_finite=False, fit="minmax").new_store(_BrokenMetaBackend(), 5)
    unchecked.add(k, v, torch.arange(8)[None])
    assert len(unchecked) == 8


def test_check_finite_catches_float32_range_overflow_of_same_range_metadata():
    """bfloat16 input with bfloat16 metadata: only (max - min) beyond float32's range overflows, which the
    backend does not check (no cost on the common path); check_finite does."""
    store = Quantize(bits=2, group_size=8).new_store(BACKEND, 1)
    k, v = _kv(n=8, dtype=torch.bfloat16)
    v[0, 0, 3, :8] = torch.tensor([3e38, -3e38] * 4, dtype=torch.bfloat16)
    assert torch.isfinite(v).all()
    with pytest.raises(MetadataOverflowError, match=r"^values of layer 1: backend 'torch'.*bfloat16 metadata"):
        store.add(k, v, torch.arange(8)[None])


def test_cache_routes_meta_dtype_to_the_action():
    from kvpolicy import CompressedCache

    cache = CompressedCache(policy="log", action="quantize", bits=2, meta_dtype="float32")
    assert cache.action.keys.meta_dtype == cache.action.values.meta_dtype == "float32"
    with pytest.raises(ConfigError, match=r"meta_dtype='bfloat16'"):
        CompressedCache(
            policy="log", action="quantize", bits=2, meta_dtype="bfloat16", key_fit="minmax", backend=_AutoOnlyBackend()
        )


def test_cache_with_large_float32_keys_and_values():
    """End to end through CompressedCache: keys ~1e5 and values ~1e6 (float32) raise a clear error with
    the default metadata; meta_dtype='float32' holds them, and memory_report counts 4-byte metadata."""
    from kvpolicy import CompressedCache

    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 80, 64, generator=gen) * 1e5, torch.randn(1, 2, 80, 64, generator=gen) * 1e6

    def run(**kw):
        cache = CompressedCache(policy="log", window=4, action="quantize", bits=4, group_size=16, **kw)
        cache.update(k, v, 0)
        keys, values = cache.update(k[:, :, :1], v[:, :, :1], 0)  # demotes (quantizes) most of the prompt
        return cache, keys, values

    with pytest.raises(MetadataOverflowError, match=r"^keys of layer 0: backend 'torch'.*meta_dtype='float32'"):
        run(backend="torch")
    with pytest.raises(MetadataOverflowError, match=r"^keys of layer 0: backend 'cpu'.*meta_dtype='float32'"):
        run()  # the default on CPU (backend="auto")
    segments = {}
    for meta in ("float32", "bfloat16"):
        cache, keys, values = run(meta_dtype=meta)
        assert keys.shape == values.shape == (1, 2, 81, 64)
        assert torch.isfinite(keys).all() and torch.isfinite(values).all()
        seen_k, seen_v = torch.cat([k, k[:, :, :1]], dim=2), torch.cat([v, v[:, :, :1]], dim=2)
        # within half a step; no group's step exceeds the whole tensor's range / (2**4 - 1)
        for got, seen in ((keys, seen_k), (values, seen_v)):
            half_step = float(seen.max() - seen.min()) / 15 / 2
            assert float((got - seen).abs().max()) <= half_step * (1 + 1e-3)
        segments[meta] = cache.memory_report().segments
    assert segments["float32"]["scales"] == 2 * segments["bfloat16"]["scales"] > 0
    assert segments["float32"]["zeros"] == 2 * segments["bfloat16"]["zeros"] > 0
    assert segments["float32"]["codes"] == segments["bfloat16"]["codes"]


# ---------------------------------------------------------------------- key and value group sizes
@pytest.mark.parametrize(
    ("kwargs", "key", "value"),
    [
        ({}, 128, 64),
        ({"group_size": 32}, 32, 32),
        ({"key_group_size": 64}, 64, 64),
        ({"value_group_size": 32}, 128, 32),
        ({"group_size": 16, "key_group_size": 16}, 16, 16),
        ({"key_axis": "token", "key_group_size": 32}, 32, 64),
        ({"value_axis": "channel", "key_group_size": 64}, 64, 128),
    ],
)
def test_group_sizes_resolve_per_kind(kwargs, key, value):
    q = Quantize(**kwargs)
    assert (q.keys.group_size, q.values.group_size) == (key, value)
    store = q.new_store(BACKEND, 0)
    assert (store.k.group_size, store.v.group_size) == (key, value)


def test_group_size_shorthand_contradicting_a_kind_is_refused():
    with pytest.raises(ConfigError) as ei:
        Quantize(group_size=64, key_group_size=128)
    msg = str(ei.value)
    assert "group_size=64" in msg and "key_group_size=128" in msg


@pytest.mark.parametrize("param", ["key_group_size", "value_group_size"])
@pytest.mark.parametrize("bad", [0, -8, 2.0, "64", True])
def test_kind_group_size_validated(param, bad):
    with pytest.raises(ConfigError) as ei:
        Quantize(**{param: bad})
    assert f"{param}={bad!r}" in str(ei.value)


def test_both_per_channel_need_dividing_group_sizes():
    Quantize(value_axis="channel", key_group_size=128, value_group_size=64)  # 64 divides 128
    with pytest.raises(ConfigError) as ei:
        Quantize(value_axis="channel", key_group_size=96, value_group_size=64)
    assert "key_group_size=96" in str(ei.value) and "value_group_size=64" in str(ei.value)


def test_equal_when_quantizing_alike_and_repr_names_the_sizes_in_effect():
    # the default: keys per channel in groups of 128 tokens with fitted ranges, values per token in
    # groups of 64 channels, min-max
    assert Quantize() == Quantize(key_group_size=128) == Quantize(key_group_size=128, value_group_size=64)
    assert Quantize() == Quantize(key_fit="mse", value_fit="minmax")
    assert hash(Quantize()) == hash(Quantize(key_group_size=128, value_group_size=64, key_fit="mse"))
    assert Quantize() != Quantize(group_size=64) and Quantize() != Quantize(key_fit="minmax")
    assert (Quantize().keys.group_size, Quantize().values.group_size) == (128, 64)
    assert (Quantize().keys.fit, Quantize().values.fit) == ("mse", "minmax")
    assert repr(Quantize()) == (
        "Quantize(bits=2, key_group_size=128, value_group_size=64, key_axis='channel', value_axis='token', "
        "check_finite=True, key_fit='mse')"
    )
    # min-max keys name their fit (the default is another), however the action was spelled
    assert (
        repr(Quantize(group_size=64, fit="minmax"))
        == repr(Quantize(key_group_size=64, key_fit="minmax"))
        == (
            "Quantize(bits=2, group_size=64, key_axis='channel', value_axis='token', check_finite=True, "
            "key_fit='minmax')"
        )
    )
    assert repr(Quantize(key_group_size=128, key_fit="minmax")) == (
        "Quantize(bits=2, key_group_size=128, value_group_size=64, key_axis='channel', value_axis='token', "
        "check_finite=True, key_fit='minmax')"
    )
    # equal sizes print as the shorthand, whichever way they were given
    assert repr(Quantize(key_group_size=64)) == repr(Quantize(group_size=64))


def test_value_group_that_does_not_divide_head_dim_names_the_parameter():
    with pytest.raises(ConfigError) as ei:
        Quantize(value_group_size=48).check_head_dim(64, role="value")
    assert "value_group_size=48" in str(ei.value) and "[4, 8, 16, 32, 64]" in str(ei.value)
    Quantize(key_group_size=48).check_head_dim(64)  # per-channel keys: any size serves any head_dim
    with pytest.raises(ConfigError, match="value_group_size \\(default\\)=64"):
        Quantize().check_head_dim(80, multiple=4, role="value")


def test_backend_refusal_names_the_kind_group_size():
    q = Quantize(key_group_size=6)  # the torch backend packs groups in multiples of 4
    with pytest.raises(ConfigError) as ei:
        q.check_backend(BACKEND)
    assert "group_size=6" in str(ei.value)


# ---------------------------------------------------------------------- key and value bits
@pytest.mark.parametrize(
    ("kwargs", "key", "value"),
    [
        ({}, 2, 2),
        ({"bits": 4}, 4, 4),
        ({"key_bits": 4}, 4, 2),
        ({"value_bits": 8}, 2, 8),
        ({"bits": 4, "key_bits": 4}, 4, 4),
    ],
)
def test_bits_resolve_per_kind(kwargs, key, value):
    q = Quantize(**kwargs)
    assert (q.keys.bits, q.values.bits) == (key, value)
    store = q.new_store(BACKEND, 0)
    assert (store.k.bits, store.v.bits) == (key, value)


def test_bits_shorthand_contradicting_a_kind_is_refused():
    with pytest.raises(ConfigError) as ei:
        Quantize(bits=2, key_bits=4)
    assert "bits=2" in str(ei.value) and "key_bits=4" in str(ei.value)


@pytest.mark.parametrize("param", ["key_bits", "value_bits"])
@pytest.mark.parametrize(("bad", "needle"), [(0, "=0"), (9, "between 1 and 8"), (2.0, "=2.0"), ("4", "='4'")])
def test_kind_bits_validated(param, bad, needle):
    with pytest.raises(ConfigError) as ei:
        Quantize(**{param: bad})
    assert param in str(ei.value) and needle in str(ei.value)


def test_mixed_bits_repr_and_equality():
    assert repr(Quantize()) == repr(Quantize(bits=2)) == repr(Quantize(key_bits=2, value_bits=2))
    assert repr(Quantize(key_bits=4)).startswith("Quantize(key_bits=4, value_bits=2, key_group_size=128,")
    assert Quantize(key_bits=4) == Quantize(key_bits=4, value_bits=2) != Quantize(bits=4)


def test_a_pair_the_backend_lacks_is_refused_with_the_pairs_it_has():
    limited = dataclasses.replace(TorchBackend.capabilities, bit_pairs=((2, 2), (4, 2), (4, 4)))

    class Limited(TorchBackend):
        name = "limited"
        capabilities = limited

    Quantize(key_bits=4, value_bits=2).check_backend(Limited())
    with pytest.raises(ConfigError) as ei:
        Quantize(key_bits=2, value_bits=4).check_backend(Limited())
    msg = str(ei.value)
    assert "key_bits=2, value_bits=4" in msg and "[(2, 2), (4, 2), (4, 4)]" in msg
    with pytest.raises(ConfigError, match=r"does not support bits=5; it supports bits in \[2, 3, 4, 8\]"):
        Quantize(key_bits=5, value_bits=5).check_backend(BACKEND)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"fit": "minmax"},
        {"key_fit": "minmax"},
        {"key_fit": "minmax", "value_fit": "mse"},
        {"key_fit": "mse", "value_fit": "minmax"},
        {"fit": "mse"},
        {"key_axis": "token", "group_size": 64, "fit": "minmax"},
        {"key_bits": 4, "value_bits": 2, "key_group_size": 32, "key_fit": "minmax", "meta_dtype": "float32"},
        {"key_scheme": "minmax", "value_scheme": "codebook", "key_fit": "minmax"},
        {"key_scheme": "codebook", "value_scheme": "minmax", "value_fit": "mse"},
        {},
    ],
)
def test_the_repr_builds_the_same_action(kwargs):
    """``eval(repr(action)) == action`` for every fit of each role: a repr copied from a results page
    builds the cache that was measured, min-max keys included (the keys' default fit is ``"mse"``)."""
    from kvpolicy import Codebook, MinMax  # noqa: F401 - names a repr may use

    action = Quantize(**kwargs)
    assert eval(repr(action)) == action, repr(action)
