"""The chunk codec: what it stores equals what kvpolicy's own store holds for the same tokens, its payload
size is exact for every layout, and each group of a layout is coded or kept verbatim as its plan says."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import chunk, key, resign, section_offsets
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpolicy_lmcache import ChunkCodec, PayloadError
from kvpolicy_lmcache.codec import CODED_DTYPES

from kvpolicy.actions.quantize import Quantize
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.errors import ConfigError, NonFiniteError
from kvpolicy.spec import CacheSpec
from kvpolicy.transforms import BindContext

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def round_trip(codec: ChunkCodec, groups: list[torch.Tensor], k=None) -> tuple[list[torch.Tensor], bytes]:
    k = key() if k is None else k
    size = codec.payload_size([g.shape for g in groups], [g.dtype for g in groups])
    buf = torch.empty(size, dtype=torch.uint8)
    assert codec.encode(groups, buf, k) == size
    out = [torch.empty_like(g) for g in groups]
    codec.decode(buf, out, k)
    return out, bytes(buf.numpy())


def kvpolicy_store(preset: str, x: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk ``x`` ``[2, layers, tokens, hidden]`` as kvpolicy's own store holds it: the preset's last
    tier behind its rotation, one layer at a time, every token demoted at once (the reference)."""
    spec = CacheSpec.from_preset(preset)
    tier = spec.action.tiers[-1]
    _, layers, tokens, hidden = x.shape
    out = torch.empty_like(x)
    for layer in range(layers):
        k, v = (x[r, layer].reshape(tokens, hidden // head_dim, head_dim).transpose(0, 1)[None] for r in (0, 1))
        store, basis = tier.new_store(TorchBackend(), layer), spec.transform.bind(BindContext.of(layer, k, v))
        positions = torch.arange(tokens)[None]
        basis.add(store, k, v, positions)
        for r, held in enumerate((basis.unmap_keys(store.keys(), positions), basis.unmap_values(store.values()))):
            out[r, layer] = held[0].transpose(0, 1).reshape(tokens, hidden)
    return out[0], out[1]


@pytest.mark.parametrize("preset", ["kvpolicy-3bit", "kvpolicy-3.5bit", "kvpolicy-4bit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_loaded_chunk_equals_what_kvpolicys_store_holds(preset, dtype):
    """float32 and float16 chunks, every token coded: the reference path quantizes the rotated tokens in
    float32 as kvpolicy's store does, so the loaded chunk is exactly the preset's last tier as a
    CompressedCache holds it (the compiled path is checked against this one in test_fast.py)."""
    x = chunk(3, 50, 2, 64, dtype)
    codec = ChunkCodec(preset=preset, head_dim=64, keep_first=0, keep_last=0, kernel="reference")
    (got,), _ = round_trip(codec, [x])
    keys, values = kvpolicy_store(preset, x, 64)
    assert torch.equal(got[0], keys) and torch.equal(got[1], values)


def test_bfloat16_chunks_are_quantized_from_float32_rotations():
    """kvpolicy's store rounds a bfloat16 token's rotation to bfloat16 before subtracting the key centre
    and quantizing; the codec keeps the rotation in float32, so its chunks are at least as close to the
    original (and equal in format and size)."""
    x = chunk(2, 64, 2, 64, torch.bfloat16)
    (got,), _ = round_trip(ChunkCodec(head_dim=64, kernel="reference"), [x])
    held = kvpolicy_store("kvpolicy-3bit", x, 64)
    for r in (0, 1):
        err = float((got[r].float() - x[r].float()).norm() / x[r].float().norm())
        ref = float((held[r].float() - x[r].float()).norm() / x[r].float().norm())
        assert err <= ref + 1e-3, (r, err, ref)


layouts = st.lists(
    st.tuples(
        st.sampled_from(["kv", "kv", "plane", "int"]),
        st.integers(1, 3),  # layers
        st.integers(0, 70),  # tokens
        st.integers(1, 3),  # heads
        st.sampled_from([8, 16, 64, 128]),  # head_dim
        st.sampled_from(DTYPES),
    ),
    min_size=1,
    max_size=3,
)


def build(layout) -> list[torch.Tensor]:
    out = []
    for i, (kind, layers, tokens, heads, dim, dtype) in enumerate(layout):
        if kind == "kv":
            out.append(chunk(layers, tokens, heads, dim, dtype, seed=i))
        elif kind == "plane":  # a single plane (MLA's latents): stored verbatim
            out.append(torch.randn(1, layers, tokens, heads * dim).to(dtype))
        else:  # an integer group (fp8 caches come as uint8): stored verbatim
            out.append(torch.randint(0, 256, (2, layers, tokens, heads * dim), dtype=torch.uint8))
    return out


@settings(max_examples=60, deadline=None)
@given(layout=layouts, extra=st.integers(0, 64))
def test_the_estimate_is_the_exact_size_and_nothing_beyond_it_is_written(layout, extra):
    """For any layout (several groups, any dtype, partial or empty chunks) the estimate is an upper bound
    that encode reaches exactly, and the bytes after it are left as they were."""
    groups = build(layout)
    codec = ChunkCodec()
    size = codec.payload_size([g.shape for g in groups], [g.dtype for g in groups])
    buf = torch.full((size + extra,), 0xA5, dtype=torch.uint8)
    assert codec.encode(groups, buf, key()) == size
    assert bool((buf[size:] == 0xA5).all())
    out = [torch.zeros_like(g) for g in groups]
    codec.decode(buf, out, key())  # a buffer longer than the payload (as LMCache allocates) is read to its end
    plan = codec.plan([g.shape for g in groups], [g.dtype for g in groups])
    for g, x, y in zip(plan, groups, out, strict=True):
        if g.mode == "raw":
            assert torch.equal(x, y)
        else:
            assert bool(torch.isfinite(y).all())
            err = (y.float() - x.float()).norm() / x.float().norm()
            assert err < 0.35, err  # 2-bit values dominate: about 0.27 of the norm on these chunks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 255, 256])
def test_partial_chunks_and_every_dtype_round_trip(dtype, tokens):
    x = chunk(2, tokens, 3, 64, dtype)
    (y,), _ = round_trip(ChunkCodec(), [x])
    assert y.dtype == dtype and y.shape == x.shape and bool(torch.isfinite(y).all())
    assert (y.float() - x.float()).norm() / x.float().norm() < 0.35


def test_a_hybrid_layout_codes_its_kv_groups_and_keeps_the_others_verbatim():
    """Groups of different shapes and dtypes in one chunk (a hybrid model's kernel groups): each K/V group
    is coded with its own head dim, the single plane and the integer group come back bit for bit."""
    groups = [
        chunk(2, 256, 4, 64, torch.bfloat16),
        chunk(1, 256, 1, 256, torch.float16, seed=2),
        torch.randn(1, 2, 256, 96).to(torch.bfloat16),
        torch.randint(0, 256, (2, 1, 256, 64), dtype=torch.uint8),
    ]
    codec = ChunkCodec()
    plan = codec.plan([g.shape for g in groups], [g.dtype for g in groups])
    assert [g.mode for g in plan] == ["coded", "coded", "raw", "raw"]
    assert [g.head_dim for g in plan[:2]] == [64, 64]
    assert "2, layers, tokens, hidden" in plan[2].why and "uint8" in plan[3].why
    out, _ = round_trip(codec, groups)
    assert torch.equal(out[2], groups[2]) and torch.equal(out[3], groups[3])
    for x, y in zip(groups[:2], out[:2], strict=True):
        assert (y.float() - x.float()).norm() / x.float().norm() < 0.35


def test_head_dim_from_the_config_or_inferred():
    x = chunk(1, 16, 2, 128)
    assert ChunkCodec(head_dim=128).plan([x.shape], [x.dtype])[0].head_dim == 128
    assert ChunkCodec().plan([x.shape], [x.dtype])[0].head_dim == 64  # never spans two heads of 64 or more
    odd = chunk(1, 16, 3, 40)  # 120 channels: 8-channel vectors, the largest served size dividing them
    assert ChunkCodec().plan([odd.shape], [odd.dtype])[0].head_dim == 8
    with pytest.raises(ConfigError, match="head_dim=128 does not divide the hidden size 192"):
        ChunkCodec(head_dim=128).plan([(2, 1, 16, 192)], [torch.bfloat16])
    with pytest.raises(ConfigError, match="head_dim=12 cannot be served"):
        ChunkCodec(head_dim=12)
    odd_dim = torch.randn(2, 1, 4, 12).to(torch.bfloat16)  # no served size divides 12: kept verbatim
    assert ChunkCodec().plan([odd_dim.shape], [odd_dim.dtype])[0].mode == "raw"


def test_vectors_of_whole_heads_hold_fewer_bits_than_halves():
    layout = ([(2, 32, 256, 1024)], [torch.bfloat16])
    whole = ChunkCodec(head_dim=128).payload_size(*layout)
    halves = ChunkCodec().payload_size(*layout)
    elements = 2 * 32 * 256 * 1024
    assert 8 * whole / elements < 8 * halves / elements < 3.5


@pytest.mark.parametrize(
    ("preset", "low", "high"),
    [("kvpolicy-3bit", 2.5, 2.7), ("kvpolicy-3.5bit", 3.0, 3.2), ("kvpolicy-4bit", 3.5, 3.7)],
)
def test_stored_bits_per_element_with_everything_counted(preset, low, high):
    """Codes (3 + 2, 3 + 3, 4 + 3 bits), one-byte scales over 128 channels, key centres and scale bases
    per layer and head, the header and the padding: all in the payload's size; the 5 tokens of 256 the
    presets keep verbatim add 5 / 256 of (16 - those bits)."""
    shape = (2, 32, 256, 1024)
    elements = 2 * 32 * 256 * 1024
    every = ChunkCodec(preset=preset, head_dim=128, keep_first=0, keep_last=0)
    coded = 8 * every.payload_size([shape], [torch.bfloat16])
    assert low < coded / elements < high, coded / elements
    default = 8 * ChunkCodec(preset=preset, head_dim=128).payload_size([shape], [torch.bfloat16]) / elements
    added = 5 / 256 * (16 - coded / elements)
    assert abs(default - (coded / elements + added)) < 0.002, (default, coded / elements, added)


@pytest.mark.parametrize("preset", ["kvpolicy-3bit", "kvpolicy-3.5bit", "kvpolicy-4bit"])
def test_the_presets_keep_their_sink_and_recent_window_verbatim(preset):
    """Position 0 and the log policy's window (W = 4) are what the presets hold at full precision whatever
    the context; the codec keeps each chunk's first token and last 4, and says so in its repr."""
    codec = ChunkCodec(preset=preset)
    assert codec.kept == (1, CacheSpec.from_preset(preset).policy.window) == (1, 4)
    assert "keep_first=1, keep_last=4" in repr(codec)
    assert ChunkCodec(keep_first=2, keep_last=0).kept == (2, 0)
    assert ChunkCodec(preset="logquant", keep_first=None).kept == (1, 42)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [0, 1, 3, 5, 6, 37, 256])
@pytest.mark.parametrize(("first", "last"), [(1, 4), (0, 8), (4, 0), (3, 3)])
@pytest.mark.parametrize("kernel", ["auto", "reference"])
def test_kept_tokens_round_trip_exactly_and_the_rest_as_a_chunk_of_their_own(dtype, tokens, first, last, kernel):
    """The first and last tokens come back bit for bit; the tokens between them come back exactly as a chunk
    of those tokens alone stored with nothing kept (their keys centred on their own mean). A chunk shorter
    than first + last keeps its first ``first`` tokens and as many last ones as remain: all of it."""
    x = chunk(2, tokens, 2, 64, dtype)
    x[:, :, :first] *= 40  # a sink-like outlier, which a coded token could not hold exactly
    kept = ChunkCodec(head_dim=64, keep_first=first, keep_last=last, kernel=kernel)
    (y,), _ = round_trip(kept, [x])
    f = min(first, tokens)
    lst = min(last, tokens - f)
    assert torch.equal(y[:, :, :f], x[:, :, :f]) and torch.equal(y[:, :, tokens - lst :], x[:, :, tokens - lst :])
    middle = x[:, :, f : tokens - lst]
    if middle.shape[2]:
        (alone,), _ = round_trip(ChunkCodec(head_dim=64, keep_first=0, keep_last=0, kernel=kernel), [middle.clone()])
        assert torch.equal(y[:, :, f : tokens - lst], alone)
    plan = kept.plan([x.shape], [x.dtype])[0]
    assert (plan.first, plan.last, plan.coded_tokens) == (f, lst, tokens - f - lst)


def test_kept_tokens_are_counted_in_the_size_and_the_header():
    """A payload keeping tokens holds them in the chunk's dtype (16 bits each in bfloat16) beside the
    blocks of the others; its header says how many, so a reader keeping others refuses it."""
    from kvpolicy_lmcache import payload

    shape, dtype = (2, 4, 256, 128), torch.bfloat16
    kept, coded = ChunkCodec(head_dim=64, keep_first=1, keep_last=4), ChunkCodec(head_dim=64, keep_first=0, keep_last=0)
    plan = kept.plan([shape], [dtype])[0]
    smaller = coded.plan([(2, 4, 251, 128)], [dtype])[0]  # the 251 coded tokens as a chunk of their own
    verbatim = payload.pad(2 * 4 * 5 * 128 * 2)
    assert plan.nbytes == verbatim + smaller.nbytes
    assert kept.payload_size([shape], [dtype]) == payload.body_offset(len(kept.header((plan,), None))) + plan.nbytes
    assert '"verbatim_tokens":[1,4]' in kept.header((plan,), key()).decode()
    assert "verbatim_tokens" not in coded.header(coded.plan([shape], [dtype]), key()).decode()
    x = chunk(4, 256, 2, 64)
    _, data = round_trip(kept, [x])
    with pytest.raises(PayloadError, match="written by codec"):
        ChunkCodec(head_dim=64, keep_first=1, keep_last=8).decode(
            torch.frombuffer(bytearray(data), dtype=torch.uint8), [torch.empty_like(x)], key()
        )


def test_overrides_change_what_is_stored_and_the_header():
    x = chunk(1, 32, 2, 64)
    base = ChunkCodec()
    assert ChunkCodec(seed=7).parts.transform.seed == 7
    assert ChunkCodec(norm_bits=16).parts.values.norm_bits == 16
    wide = ChunkCodec(key_bits=4, value_bits=4)
    assert (wide.parts.keys.bits, wide.parts.values.bits) == (4, 4)
    sizes = {c.payload_size([x.shape], [x.dtype]) for c in (base, wide, ChunkCodec(norm_bits=16))}
    assert len(sizes) == 3
    _, a = round_trip(base, [x])
    _, b = round_trip(ChunkCodec(seed=7), [x])
    assert a != b and len(a) == len(b)  # another rotation: other codes, same size


def test_encoding_is_deterministic():
    x = chunk(2, 100, 2, 64)
    assert round_trip(ChunkCodec(), [x])[1] == round_trip(ChunkCodec(), [x])[1]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"preset": "kvpolicy-4.5bit"}, "groups of 64 tokens along each channel"),
        ({"preset": "h2o"}, "has action 'evict'"),
        ({"preset": "kvpolicy-3bti"}, "unknown preset 'kvpolicy-3bti'.*did you mean 'kvpolicy-3bit'"),
        ({"preset": "kivi", "seed": 1}, "preset 'kivi' takes no parameter 'seed'"),
        ({"seed": -1}, "seed must be an integer in"),
        ({"seed": True}, "seed must be an integer; got seed=True"),
        ({"norm_bits": 4}, "norm_bits must be one of"),
        ({"key_bits": 5}, "bits must be one of"),
        ({"head_dim": 0}, "head_dim must be >= 1"),
        ({"kernel": "cuda"}, "kernel must be one of"),
        ({"keep_first": -1}, r"keep_first must be in \[0, 4096\]; got keep_first=-1"),
        ({"keep_last": 5000}, r"keep_last must be in \[0, 4096\]; got keep_last=5000"),
        ({"keep_last": True}, "keep_last must be an integer; got keep_last=True"),
        ({"keep_first": "1"}, "keep_first must be an integer"),
    ],
)
def test_bad_configurations_are_refused_naming_the_parameter(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ChunkCodec(**kwargs)


def test_the_adapter_config_names_every_key():
    assert ChunkCodec.from_config({"preset": "kvpolicy-4bit", "seed": 3, "max_workers": 2}) == ChunkCodec(
        preset="kvpolicy-4bit", seed=3
    )
    assert ChunkCodec.from_config({"keep_first": 0, "keep_last": 16}).kept == (0, 16)
    with pytest.raises(ConfigError, match=r"unknown serde key 'sead'.*did you mean 'seed'"):
        ChunkCodec.from_config({"sead": 3})


@pytest.mark.parametrize("token", [0, 3, 7])  # a kept first token, a coded one, a kept last one
def test_non_finite_chunks_are_refused_when_stored(token):
    x = chunk(1, 8, 1, 64)
    x[1, 0, token, 5] = float("nan")
    buf = torch.empty(ChunkCodec().payload_size([x.shape], [x.dtype]), dtype=torch.uint8)
    with pytest.raises(NonFiniteError):
        ChunkCodec().encode([x], buf, key())


def test_a_refused_payload_leaves_the_destination_untouched():
    """Blocks are read and checked before anything is written: a payload whose second group fails the
    format's checks leaves the first group's destination as it was."""
    groups = [chunk(1, 16, 1, 64), chunk(1, 16, 1, 64, seed=3)]
    codec = ChunkCodec()
    _, data = round_trip(codec, groups)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    offset, _ = section_offsets(codec, groups, key())[(1, "values", "scale_base")]
    buf[offset : offset + 2].copy_(torch.tensor([0x00, 0x80], dtype=torch.uint8))  # int16 -32768: out of range
    resign(buf)
    out = [torch.full_like(g, 7.0) for g in groups]
    with pytest.raises(PayloadError, match=r"the values of group 1:.*scale_base"):
        codec.decode(buf, out, key())
    assert all(bool((o == 7.0).all()) for o in out)


def test_the_codec_is_frozen_and_its_repr_names_the_formats():
    codec = ChunkCodec(seed=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        codec.seed = 4  # type: ignore[misc]
    assert "Codebook(bits=3" in repr(codec) and "Hadamard(seed=3)" in repr(codec)
    assert set(CODED_DTYPES) == set(DTYPES)
    assert isinstance(CacheSpec.from_preset("kvpolicy-3bit").action.tiers[-1], Quantize)
