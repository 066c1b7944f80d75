"""The compiled path (numba) against the reference path (kvpolicy's quantizer and the transform's matrix):
the same payload format, the same codes up to coordinates within rounding of a cell boundary, and the same
reconstruction up to the last bit of the chunk's dtype; payloads of either path decode with the other."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import chunk, key
from hypothesis import example, given, settings
from hypothesis import strategies as st
from kvpolicy_lmcache import ChunkCodec, fast, kvparts

from kvpolicy.transforms import Hadamard
from kvpolicy.transforms.base import Transform


def encode(codec: ChunkCodec, x: torch.Tensor) -> torch.Tensor:
    buf = torch.empty(codec.payload_size([x.shape], [x.dtype]), dtype=torch.uint8)
    codec.encode([x], buf, key())
    return buf


def decode(codec: ChunkCodec, buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(like)
    codec.decode(buf, [out], key())
    return out


def ulp(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


@settings(max_examples=25, deadline=None)
@example(preset="kvpolicy-3bit", dtype=torch.float32, tokens=1, head_dim=128, norm_bits=8, seed=456_083_239_906_294)
@given(
    preset=st.sampled_from(["kvpolicy-3bit", "kvpolicy-3.5bit", "kvpolicy-4bit"]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    tokens=st.integers(1, 80),
    head_dim=st.sampled_from([8, 16, 64, 80, 96, 128, 256]),
    norm_bits=st.sampled_from([8, 16]),
    seed=st.integers(0, 2**64 - 1),
)
def test_the_compiled_path_writes_and_reads_what_the_reference_does(preset, dtype, tokens, head_dim, norm_bits, seed):
    x = chunk(2, tokens, 2, head_dim, dtype, seed=seed % 1000)
    compiled = ChunkCodec(preset=preset, head_dim=head_dim, norm_bits=norm_bits, seed=seed)
    reference = ChunkCodec(preset=preset, head_dim=head_dim, norm_bits=norm_bits, seed=seed, kernel="reference")
    assert compiled.plan([x.shape], [x.dtype])[0].rotation is not None
    a, b = encode(compiled, x), encode(reference, x)
    assert a.numel() == b.numel()
    assert float((a != b).float().mean()) < 0.01  # bytes of codes near a boundary, and their scales
    for buf in (a, b):  # either payload decodes with either path, to the last bit of the dtype
        y1, y2 = decode(compiled, buf, x), decode(reference, buf, x)
        # rounding to the chunk's dtype (a few of its ulps), plus float32 arithmetic: a Walsh-Hadamard transform
        # and a matrix product of one vector differ by up to about log2(head_dim) float32 ulps of its norm
        scale = float(y2.float().abs().max())
        norm = float(y2.float().norm(dim=-1).max())
        bound = 4 * ulp(dtype) * scale + 2 * head_dim.bit_length() * ulp(torch.float32) * norm
        assert float((y1.float() - y2.float()).abs().max()) <= bound
    err = [float((decode(c, buf, x).float() - x.float()).norm() / x.float().norm()) for c, buf in
           ((compiled, a), (reference, b))]  # fmt: skip
    assert abs(err[0] - err[1]) < 1e-3, err


def test_the_rotation_is_read_from_the_matrix():
    rot = fast.rotation(Hadamard(seed=5), 96)  # blocks of 32
    assert rot is not None and rot.block == 32 and set(rot.signs.tolist()) <= {-1.0, 1.0}


@dataclass(frozen=True)
class Shuffled(Transform):
    """An orthogonal transform whose matrix is not a block Hadamard one (a permutation)."""

    name = "shuffled"

    def matrix(self, head_dim: int, device: str = "cpu") -> torch.Tensor:
        return torch.eye(head_dim)[torch.randperm(head_dim, generator=torch.Generator().manual_seed(0))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() @ self.matrix(x.shape[-1])).to(x.dtype)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        return (y.float() @ self.matrix(y.shape[-1]).T).to(y.dtype)


def test_other_matrices_and_formats_take_the_reference_path():
    assert fast.rotation(Shuffled(), 64) is None
    assert fast.rotation(Hadamard(0), 64) is not None
    from kvpolicy.formats import Codebook, MinMax

    parts = ChunkCodec(preset="kvpolicy-3bit").parts
    assert fast.serves(parts.keys, parts.values)
    assert not fast.serves(MinMax(bits=2, group_size=32, axis="token"), parts.values)  # another format
    assert not fast.serves(parts.keys, Codebook(bits=2, centre=True))  # centred values

    class Derived(Codebook):  # a plugin's format built on the codebook: its own codes, never assumed
        pass

    assert not fast.serves(Derived(bits=3), parts.values)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_non_finite_chunks_are_refused_by_the_compiled_path(dtype):
    from kvpolicy.errors import NonFiniteError

    x = chunk(1, 8, 1, 64, dtype)
    x[0, 0, 2, 7] = float("inf")
    with pytest.raises(NonFiniteError):
        encode(ChunkCodec(), x)


@pytest.mark.parametrize("preset", ["kvpolicy-3bit", "kvpolicy-4bit"])
@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 200])
def test_bfloat16_is_read_and_written_by_the_kernel_as_torch_converts_it(preset, tokens):
    """The kernel reads bfloat16 chunks as they are and rounds its output to bfloat16 itself: the same
    tensors as from the chunk converted to float32 by torch first, and the same bits as torch's rounding
    of the float32 reconstruction (partial tiles of tokens included)."""
    codec = ChunkCodec(preset=preset, head_dim=128)
    rot = codec.plan([(2, 1, 8, 256)], [torch.bfloat16])[0].rotation
    x = chunk(2, tokens, 2, 128, torch.bfloat16)
    for role, fmt in enumerate((codec.parts.keys, codec.parts.values)):
        fmt = kvparts.for_dtype(fmt, torch.bfloat16)
        v = x[role].reshape(2, tokens, 2, 128)
        direct, via_float32 = fast.encode(fmt, rot, v, torch.bfloat16), fast.encode(fmt, rot, v.float(), torch.bfloat16)
        assert direct.keys() == via_float32.keys()
        assert all(torch.equal(direct[k], via_float32[k]) for k in direct)
        tmpl = kvparts.template(fmt, (2, 2, tokens, 128))
        block = kvparts.block(fmt, tmpl, direct)
        rounded, wide = fast.decode(block, rot, torch.bfloat16), fast.decode(block, rot, torch.float32)
        assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, wide.to(torch.bfloat16))


def test_a_reconstruction_beyond_bfloat16s_range_is_reported():
    """A centre that takes the reconstruction past bfloat16's largest finite value makes the kernel report
    it (the codec then refuses the payload) instead of writing Inf."""
    codec = ChunkCodec(head_dim=64)
    rot = codec.plan([(2, 1, 8, 64)], [torch.bfloat16])[0].rotation
    fmt = kvparts.for_dtype(codec.parts.keys, torch.bfloat16)
    tmpl = kvparts.template(fmt, (2, 1, 4, 64))
    tensors = fast.encode(fmt, rot, chunk(2, 4, 1, 64, torch.bfloat16)[0].reshape(2, 4, 1, 64), torch.bfloat16)
    assert fast.decode(kvparts.block(fmt, tmpl, tensors), rot, torch.bfloat16) is not None
    for big in (3.0e38, 1.0e37):  # the transform's sums of 64 such channels pass float32's range
        centre = torch.full_like(tensors["centre"], big)
        assert fast.decode(kvparts.block(fmt, tmpl, {**tensors, "centre": centre}), rot, torch.bfloat16) is None
