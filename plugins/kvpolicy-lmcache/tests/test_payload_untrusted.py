"""A stored payload is untrusted input: storage can truncate or damage it, another version or codec can
have written it, it can belong to another layout or key, and anyone with write access can craft one.

Every payload below is refused with a :class:`PayloadError` naming the chunk key, and the destination is
left exactly as it was (nothing decoded into it). The reader never allocates from what a payload says:
it compares the payload's prefix and header with the ones it would write for the destination's layout
and key, then checks the checksum, and only then reads sections of the sizes its own plan gives.
"""

from __future__ import annotations

import struct

import pytest
import torch
from conftest import chunk, key, resign, section_offsets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvpolicy_lmcache import ChunkCodec, PayloadError, payload

CODEC = ChunkCodec()
GROUPS = [chunk(2, 40, 2, 64), torch.randint(0, 256, (1, 2, 40, 16), dtype=torch.uint8)]
KEY = key(9)
NAME = payload.describe_key(KEY)


def encoded(codec: ChunkCodec = CODEC, groups=GROUPS, k=KEY) -> bytearray:
    buf = torch.empty(codec.payload_size([g.shape for g in groups], [g.dtype for g in groups]), dtype=torch.uint8)
    codec.encode(groups, buf, k)
    return bytearray(buf.numpy().tobytes())


PAYLOAD = encoded()


def refused(data: bytes | bytearray, codec: ChunkCodec = CODEC, groups=GROUPS, k=KEY, match: str = "") -> PayloadError:
    """Decode ``data``: assert it is refused naming the key (and ``match``), the destinations untouched."""
    out = [torch.full_like(g, 3) for g in groups]
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    with pytest.raises(PayloadError, match=match) as info:
        codec.decode(buf, out, k)
    assert payload.describe_key(k) in str(info.value) and "nothing was decoded" in str(info.value)
    assert all(bool((o == 3).all()) for o in out), "a refused payload wrote into the destination"
    return info.value


def test_the_valid_payload_decodes():
    out = [torch.zeros_like(g) for g in GROUPS]
    CODEC.decode(torch.frombuffer(bytearray(PAYLOAD), dtype=torch.uint8), out, KEY)
    assert torch.equal(out[1], GROUPS[1]) and bool(torch.isfinite(out[0]).all())


@pytest.mark.parametrize("version", [0, 2, 0xFFFF])
@pytest.mark.parametrize("signed", [False, True])
def test_another_version_is_refused(version, signed):
    data = bytearray(PAYLOAD)
    struct.pack_into("<H", data, 4, version)
    if signed:
        buf = torch.frombuffer(data, dtype=torch.uint8)
        resign(buf)
    refused(data, match=f"payload format version {version}; this reader reads version {payload.VERSION} only")


def test_another_magic_or_reserved_field_is_refused():
    refused(b"XXXX" + PAYLOAD[4:], match="not written by this codec")
    data = bytearray(PAYLOAD)
    struct.pack_into("<H", data, 6, 1)
    refused(data, match="reserved prefix field is 1")


def cuts() -> list[int]:
    total = len(PAYLOAD)
    body = payload.body_offset(len(CODEC.header(CODEC.plan([g.shape for g in GROUPS], [g.dtype for g in GROUPS]), KEY)))
    return sorted({0, 1, 23, 24, 25, body - 1, body, body + 1, total // 2, total - 8, total - 1})


@pytest.mark.parametrize("cut", cuts())
def test_a_truncated_payload_is_refused(cut):
    refused(PAYLOAD[:cut], match="truncated")


@pytest.mark.parametrize("cut", cuts()[4:])
def test_a_payload_cut_short_in_a_buffer_of_stale_bytes_is_refused(cut):
    """LMCache reads a stored object into a buffer sized for the layout: a shorter object leaves the rest
    of the buffer as it was (here: stale bytes of another payload)."""
    stale = encoded(groups=[chunk(2, 40, 2, 64, seed=5), 255 - GROUPS[1]])
    refused(PAYLOAD[:cut] + stale[cut:])


@pytest.mark.parametrize(
    ("groups", "why"),
    [
        ([chunk(2, 39, 2, 64), GROUPS[1]], "tokens"),  # a partial chunk of another length
        ([chunk(3, 40, 2, 64), GROUPS[1]], "layers"),
        ([chunk(2, 40, 2, 64, torch.float16), GROUPS[1]], "dtype"),
        ([GROUPS[0]], "fewer groups"),
        ([GROUPS[0], GROUPS[1], GROUPS[1]], "more groups"),
        ([GROUPS[0], torch.randint(0, 256, (2, 2, 40, 8), dtype=torch.uint8)], "a raw group of another shape"),
    ],
)
def test_a_payload_of_another_layout_is_refused(groups, why):
    refused(PAYLOAD, groups=groups, match="of layout")


def test_a_payload_of_another_layout_with_the_same_size_is_refused():
    """Same size, another layout: bfloat16 keys and values read as float16 ones, a raw group of 2 × 16
    channels as one of 32 (the header, not the size, decides)."""
    for other in ([chunk(2, 40, 2, 64, torch.float16), GROUPS[1]], [GROUPS[0], GROUPS[1].reshape(2, 2, 20, 16)]):
        assert CODEC.payload_size([g.shape for g in other], [g.dtype for g in other]) == len(PAYLOAD)
        refused(PAYLOAD, groups=other, match="of layout")


@pytest.mark.parametrize(
    "codec", [ChunkCodec(preset="kvpolicy-4bit"), ChunkCodec(seed=1), ChunkCodec(norm_bits=16), ChunkCodec(head_dim=32)]
)
def test_a_payload_of_another_codec_is_refused(codec):
    refused(PAYLOAD, codec=codec, match="written by codec")


@pytest.mark.parametrize(
    "k", [key(10), key(9, model="other"), key(9, rank=1), key(9, group=1)], ids=["hash", "model", "rank", "group"]
)
def test_a_payload_stored_for_another_key_is_refused(k):
    refused(PAYLOAD, k=k, match="stored for another chunk key")


def test_an_edited_header_is_refused_even_when_re_signed():
    head = CODEC.header(CODEC.plan([g.shape for g in GROUPS], [g.dtype for g in GROUPS]), KEY)
    start = payload.PREFIX.size
    for old, new in ((b'"bits":3', b'"bits":4'), (b'"seed":0', b'"seed":1'), (b'"mode":"raw"', b'"mode":"xyz"')):
        assert head.count(old) >= 1
        data = bytearray(PAYLOAD)
        at = start + head.index(old)
        data[at : at + len(old)] = new
        resign(torch.frombuffer(data, dtype=torch.uint8))
        refused(data)
    data = bytearray(PAYLOAD)
    data[start : start + 4] = b"}}}}"  # not JSON
    refused(data, match="not valid JSON")


def test_garbage_is_refused():
    g = torch.Generator().manual_seed(0)
    for n in (0, 5, 24, 1000, len(PAYLOAD)):
        refused(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).numpy().tobytes())
    refused(bytes(len(PAYLOAD)), match="not written by this codec")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    edits=st.lists(st.tuples(st.integers(0, len(PAYLOAD) - 1), st.integers(1, 255)), min_size=1, max_size=8),
)
def test_any_damaged_byte_is_refused(edits):
    """Bytes xor-ed anywhere (prefix, header, padding, codes, scales, centres, raw groups): refused."""
    data = bytearray(PAYLOAD)
    for at, mask in edits:
        data[at] ^= mask
    if data == PAYLOAD:  # two edits of one byte that cancel
        return
    refused(data)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cut=st.integers(1, 200), at=st.integers(0, len(PAYLOAD) - 1), insert=st.booleans())
def test_removed_or_inserted_bytes_are_refused(cut, at, insert):
    data = bytearray(PAYLOAD)
    if insert:
        data[at:at] = bytes(cut)
        data = data[: len(PAYLOAD)]  # a buffer of the layout's size: the tail falls off
    else:
        del data[at : at + cut]
        data += bytes(cut)  # the buffer's tail: zeros
    if data == PAYLOAD:
        return
    refused(data)


SECTIONS = section_offsets(CODEC, GROUPS, KEY)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    section=st.sampled_from(sorted(SECTIONS)),
    data=st.data(),
)
def test_re_signed_edits_of_metadata_are_refused_or_decode_finite(section, data):
    """A writer who knows the format can edit sections and re-sign the payload. kvpolicy's block checks
    refuse what no chunk gives (a scale base out of range, NaN or Inf centres); any other edit is a
    payload someone could have stored, and decodes to finite values of the destination's layout."""
    offset, n = SECTIONS[section]
    raw = bytearray(PAYLOAD)
    at = data.draw(st.integers(offset, offset + n - 1))
    width = min(data.draw(st.integers(1, 4)), offset + n - at)
    raw[at : at + width] = data.draw(st.binary(min_size=width, max_size=width))
    buf = torch.frombuffer(raw, dtype=torch.uint8)
    resign(buf)
    out = [torch.full_like(g, 3) for g in GROUPS]
    try:
        CODEC.decode(buf, out, KEY)
    except PayloadError as exc:
        assert NAME in str(exc)
        assert all(bool((o == 3).all()) for o in out)
        return
    assert bool(torch.isfinite(out[0].float()).all())


def test_non_finite_centres_are_refused_even_when_re_signed():
    offset, _ = SECTIONS[(0, "keys", "centre")]
    for bits in (0x7FC0, 0x7F80):  # bfloat16 NaN, +Inf
        data = bytearray(PAYLOAD)
        struct.pack_into("<H", data, offset + 2 * 5, bits)
        resign(torch.frombuffer(data, dtype=torch.uint8))
        refused(data, match="the keys of group 0: its centre hold NaN or Inf")


def test_scales_beyond_the_destinations_range_are_refused_even_when_re_signed():
    """A scale base kvpolicy's checks allow (up to float32's range) but that no chunk of this dtype gives:
    the decoded values would be infinite, so the payload is refused before anything is written."""
    from kvpolicy.formats.scale_codes import BASE_MAX

    offset, _ = SECTIONS[(0, "values", "scale_base")]
    data = bytearray(PAYLOAD)
    struct.pack_into("<h", data, offset, BASE_MAX)
    resign(torch.frombuffer(data, dtype=torch.uint8))
    refused(data, match="the values of group 0 decode to NaN or Inf")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_kept_tokens_are_refused_even_when_re_signed(value):
    """The tokens a payload keeps verbatim are checked as decoded values are: NaN or Inf is refused."""
    buf = torch.frombuffer(encoded(), dtype=torch.uint8)
    offset, _ = section_offsets(CODEC, GROUPS, KEY)[(0, "verbatim", "tokens")]
    buf[offset + 6 : offset + 8].copy_(torch.tensor([value], dtype=torch.bfloat16).view(torch.uint8))
    resign(buf)
    refused(bytes(buf.numpy()), match="the tokens group 0 keeps verbatim hold NaN or Inf")
