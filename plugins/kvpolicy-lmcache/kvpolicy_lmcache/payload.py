"""The bytes of a stored chunk: a fixed prefix, a JSON header, then the sections of every group.

Layout (little-endian)::

    offset  size  field
    0       4     magic b"KVPC"
    4       2     format version (VERSION)
    6       2     reserved, 0
    8       4     header length H (bytes of JSON after the prefix)
    12      8     total length N of the payload
    20      4     CRC-32 of bytes [24, N)
    24      H     header: JSON (sorted keys, no spaces) of the codec, the chunk's layout and its key
    24 + H  ...   zero padding to a multiple of 8, then each group's sections, each padded to 8 bytes

The header and the lengths depend only on the codec, the layout and the key, never on the values: every
chunk of a layout has the same size, which :meth:`~kvpolicy_lmcache.codec.ChunkCodec.payload_size`
computes exactly (adapters such as ``fs`` read back exactly the size estimated for a layout).

A reader compares the prefix and the header with the ones it would write itself for the destination's
layout and key, so a payload of another version, codec, layout or key is refused before any section is
read; the checksum then refuses a truncated or damaged one.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from typing import Any

MAGIC = b"KVPC"
#: the payload format this module writes and reads
VERSION = 1
PREFIX = struct.Struct("<4sHHIQI")
#: the largest header a reader parses (a header is a few hundred bytes; a larger one is refused unread)
MAX_HEADER = 1 << 16
ALIGN = 8


class PayloadError(ValueError):
    """A payload that cannot fill the destination chunk; the message names the chunk key and what differs.

    Attributes
    ----------
    key : str
        The chunk key, as :func:`describe_key` writes it.
    """

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"kvpolicy codec: chunk {key}: refused the stored payload: {why}; nothing was decoded")
        self.key = key


def describe_key(key: Any) -> str:
    """A chunk key as messages name it: ``model@rank@group@hash`` (hash in hex; any object: its ``repr``)."""
    try:
        salt = f"@salt={key.cache_salt}" if getattr(key, "cache_salt", "") else ""
        return f"{key.model_name}@{key.kv_rank}@{key.object_group_id}@{key.chunk_hash.hex()}{salt}"
    except AttributeError:
        return repr(key)


def key_digest(key: Any) -> str:
    """A 128-bit digest (hex) of every field that identifies a chunk: its hash, model, rank, group, salt."""
    h = hashlib.blake2b(digest_size=16)
    fields = (key.chunk_hash, key.model_name, key.kv_rank, key.object_group_id, getattr(key, "cache_salt", ""))
    for field in fields:
        data = field if isinstance(field, bytes) else str(field).encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def pad(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def header_bytes(header: dict[str, Any]) -> bytes:
    """The JSON of ``header`` as it is stored."""
    return json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def body_offset(header_len: int) -> int:
    """Where the first section starts after a header of ``header_len`` bytes."""
    return pad(PREFIX.size + header_len)


def prefix(header_len: int, total: int, crc: int) -> bytes:
    """The fixed prefix of a payload."""
    return PREFIX.pack(MAGIC, VERSION, 0, header_len, total, crc)


def crc(view: memoryview) -> int:
    """CRC-32 of ``view`` (the bytes after the prefix)."""
    return zlib.crc32(view) & 0xFFFFFFFF


def check(buf: memoryview, expected: bytes, total: int, key: str) -> None:
    """Refuse ``buf`` unless it starts with a payload of this version whose header is ``expected`` and whose
    ``total`` bytes pass the checksum.

    Parameters
    ----------
    buf : memoryview
        The bytes read back (a buffer at least as long as the payload; anything after it is ignored).
    expected : bytes
        The header this reader writes for the destination's layout and key.
    total : int
        The payload's size for that layout.
    key : str
        The chunk key, for the message.

    Raises
    ------
    PayloadError
        Naming what differs: not a payload of this codec, another version, a header of another codec,
        layout or key, a truncated buffer, or a checksum that does not match.
    """
    if len(buf) < PREFIX.size:
        raise PayloadError(key, f"it holds {len(buf)} bytes, fewer than the {PREFIX.size}-byte prefix (truncated)")
    magic, version, reserved, header_len, stored_total, stored_crc = PREFIX.unpack_from(buf)
    if magic != MAGIC:
        raise PayloadError(key, f"it starts with {bytes(magic)!r}, not {MAGIC!r}: not written by this codec")
    if version != VERSION:
        raise PayloadError(key, f"it is of payload format version {version}; this reader reads version {VERSION} only")
    if reserved != 0:
        raise PayloadError(key, f"its reserved prefix field is {reserved}, not 0")
    if header_len > MAX_HEADER or PREFIX.size + header_len > len(buf):
        raise PayloadError(
            key, f"its header claims {header_len} bytes; {len(buf) - PREFIX.size} follow the prefix (truncated?)"
        )
    got = bytes(buf[PREFIX.size : PREFIX.size + header_len])
    if got != expected:
        raise PayloadError(key, differences(got, expected))
    if stored_total != total:
        raise PayloadError(key, f"it claims {stored_total} bytes; this layout's payload has {total}")
    if len(buf) < total:
        raise PayloadError(key, f"it holds {len(buf)} of its {total} bytes (truncated)")
    if crc(buf[PREFIX.size : total]) != stored_crc:
        raise PayloadError(key, "its checksum does not match its bytes (truncated or damaged in storage)")


def differences(got: bytes, expected: bytes) -> str:
    """What a stored header says that differs from the one expected, in words."""
    try:
        stored = json.loads(got)
    except ValueError:
        return "its header is not valid JSON (damaged in storage)"
    want = json.loads(expected)
    if not isinstance(stored, dict):
        return "its header is not a JSON object (damaged in storage)"
    parts = []
    if stored.get("key") != want["key"]:
        parts.append("it was stored for another chunk key")
    if stored.get("codec") != want["codec"]:
        parts.append(
            f"it was written by codec {_short(stored.get('codec'))}; this adapter's is {_short(want['codec'])}"
        )
    if stored.get("groups") != want["groups"]:
        parts.append(
            f"it holds a chunk of layout {_short(stored.get('groups'))}; the destination's is {_short(want['groups'])}"
        )
    return "; ".join(parts) or "its header differs from the one this codec writes (damaged in storage)"


def _short(value: object, limit: int = 400) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return text if len(text) <= limit else text[:limit] + "..."
