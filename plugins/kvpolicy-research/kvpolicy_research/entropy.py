"""Entropy coding of a saved cache's tensors (``cache.save(path, codec="entropy")``, :class:`EntropyCodec`).

A generic, format-blind scheme: a tensor is viewed as bytes and split into byte planes (one per
byte of its dtype: a ``float16`` tensor's low bytes, then its high bytes; an ``int64`` tensor's
eight planes). Each plane is read as a little-endian bit stream cut into ``width``-bit symbols
(``width`` 8 for every dtype wider than a byte; for one-byte tensors, the width among
:data:`WIDTHS` whose empirical entropy is smallest, or a wider one within :data:`WIDTH_TOLERANCE`
of it: packed 3-bit codes, which straddle bytes, are then coded code by code) and coded with an
order-0 categorical model by an ANS coder of the
`constriction <https://bamler-lab.github.io/constriction/>`_ library. The model's frequency table,
quantized to sum to ``2**PRECISION``, is stored with the plane; a plane that would not shrink is
stored raw.

A coded tensor is stored as one ``uint8`` payload, its planes one after another:

.. code-block:: text

    raw plane:    0x00 | the plane's n bytes
    coded plane:  0x01 | lo (u8) | k - 1 (u8) | words (u32) | k frequencies (u16) | words x u32

    (little-endian; symbols lo .. lo + k - 1 of the plane's alphabet of 2**width symbols)

:func:`decode` trusts nothing in a payload: a declared size that the payload could not encode
(more than :data:`MAX_EXPANSION` times its length) is refused before anything is allocated, every
frequency table must sum to ``2**PRECISION`` over an alphabet that fits the width, and the coded
words must be consumed exactly; the decoder runs a fixed number of steps (the declared symbol
count, in chunks of bounded memory).
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
import torch

from kvpolicy.errors import CacheFileError
from kvpolicy.persist import Codec

#: the symbol widths (bits) a one-byte tensor's planes may be cut into
WIDTHS = (8, 4, 3, 2, 1)
#: a wider symbol is chosen when its estimated size is within this fraction of the smallest
WIDTH_TOLERANCE = 0.005
#: the frequencies of a plane's model sum to 2**PRECISION (each stored as a u16)
PRECISION = 15
#: a coded tensor declares at most this many bytes per byte of payload (the writer stores a
#: tensor that would compress further raw), so decoding a file allocates at most this times its size
MAX_EXPANSION = 64
#: symbols decoded per step (a multiple of 8, so a chunk is whole bytes at every width)
CHUNK = 1 << 20
#: bytes of a one-byte tensor whose symbols choose its width (a multiple of 3)
SAMPLE = 3 << 15
#: what to install when constriction is missing
INSTALL = "pip install constriction==0.4.1 (a dependency of kvpolicy-research)"

_RAW, _CODED = 0, 1
_PLANE_HEAD = struct.Struct("<BBI")  # lo, k - 1, words


def require() -> Any:
    """The constriction module; an ImportError naming what to install when it is missing."""
    try:
        import constriction
    except ImportError:
        raise ImportError(f"entropy-coded cache files need the constriction package: {INSTALL}") from None
    return constriction


def available() -> bool:
    """Whether constriction can be imported (entropy coding and decoding work)."""
    try:
        require()
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------------------- coding
def encode(t: torch.Tensor) -> tuple[int, torch.Tensor] | None:
    """``t``'s symbol width and coded payload (1-D ``uint8``), or ``None`` when the payload would not
    be smaller than ``t``'s bytes, or ``t`` would expand more than :data:`MAX_EXPANSION` times from it.

    Parameters
    ----------
    t : torch.Tensor
        Any shape and dtype; contiguous or not.
    """
    constriction = require()
    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    size = t.element_size()
    if raw.size == 0:
        return None
    planes = [np.ascontiguousarray(raw.reshape(-1, size)[:, p]) for p in range(size)]
    width = _best_width(planes[0][:SAMPLE]) if size == 1 else 8
    payload = b"".join(_encode_plane(plane, width, constriction) for plane in planes)
    if len(payload) >= raw.size or raw.size > MAX_EXPANSION * len(payload):
        return None
    return width, torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def _symbols(plane: np.ndarray, width: int) -> np.ndarray:
    """The plane's little-endian bit stream cut into ``width``-bit symbols (zero bits pad the last), int32."""
    if width == 8:
        return plane.astype(np.int32)
    mask = (1 << width) - 1
    if 8 % width == 0:
        shifts = np.arange(0, 8, width, dtype=np.int32)
        return ((plane.astype(np.int32)[:, None] >> shifts) & mask).reshape(-1)
    if width == 3 and plane.size % 3 == 0:  # eight symbols to three bytes
        b = plane.reshape(-1, 3).astype(np.int32)
        word = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        return ((word[:, None] >> np.arange(0, 24, 3, dtype=np.int32)) & mask).reshape(-1)
    bits = np.unpackbits(plane, bitorder="little")
    bits = np.concatenate([bits, np.zeros(-bits.size % width, np.uint8)])
    return np.packbits(bits.reshape(-1, width), axis=1, bitorder="little")[:, 0].astype(np.int32)


def _bytes(symbols: np.ndarray, width: int) -> np.ndarray:
    """Inverse of :func:`_symbols` for ``8 * m`` symbols (int32, each below ``2**width``): ``width * m`` bytes."""
    if width == 8:
        return symbols.astype(np.uint8)
    if 8 % width == 0:
        shifts = np.arange(0, 8, width, dtype=np.int32)
        return (symbols.reshape(-1, 8 // width) << shifts).sum(axis=1).astype(np.uint8)
    if width == 3:
        word = (symbols.reshape(-1, 8) << np.arange(0, 24, 3, dtype=np.int32)).sum(axis=1)
        return ((word[:, None] >> np.array([0, 8, 16], dtype=np.int32)) & 0xFF).astype(np.uint8).reshape(-1)
    bits = np.unpackbits(symbols.astype(np.uint8)[:, None], axis=1, bitorder="little")[:, :width]
    return np.packbits(bits.reshape(-1), bitorder="little")


def _entropy_bytes(counts: np.ndarray) -> float:
    """The empirical entropy of symbols with these counts, in bytes, plus their table."""
    used = counts[counts > 0]
    n = used.sum()
    bits = float(-(used * np.log2(used / n)).sum())
    span = np.flatnonzero(counts)
    return bits / 8 + 2 * (span[-1] - span[0] + 1) + 1 + _PLANE_HEAD.size


def _best_width(plane: np.ndarray) -> int:
    """The widest of :data:`WIDTHS` whose symbols' empirical entropy (plus table) is within
    :data:`WIDTH_TOLERANCE` of the smallest: fewer, wider symbols code and decode faster."""
    costs = {w: _entropy_bytes(np.bincount(_symbols(plane, w), minlength=1 << w)) for w in WIDTHS}
    best = min(costs.values())
    return max(w for w in WIDTHS if costs[w] <= best * (1 + WIDTH_TOLERANCE))


def quantized(counts: np.ndarray) -> np.ndarray:
    """Frequencies summing to ``2**PRECISION``, at least 1 for every symbol that occurs.

    Parameters
    ----------
    counts : np.ndarray
        ``(k,)`` non-negative symbol counts, not all zero, ``k <= 2**PRECISION``.
    """
    total = 1 << PRECISION
    freq = np.rint(counts * (total / counts.sum())).astype(np.int64)
    freq[(counts > 0) & (freq == 0)] = 1
    excess = int(freq.sum()) - total  # at most k: taken from the largest (each step takes >= 1)
    while excess > 0:
        i = int(np.argmax(freq))
        take = min(excess, int(freq[i]) - 1)
        freq[i] -= take
        excess -= take
    freq[np.argmax(freq)] -= excess
    return freq


def _model(freq: np.ndarray, constriction: Any) -> Any:
    return constriction.stream.model.Categorical(freq.astype(np.float64), perfect=False)


def _encode_plane(plane: np.ndarray, width: int, constriction: Any) -> bytes:
    symbols = _symbols(plane, width)
    counts = np.bincount(symbols, minlength=1 << width)
    span = np.flatnonzero(counts)
    lo, hi = int(span[0]), int(span[-1])
    if lo == hi:  # one symbol: a second, never used, since constriction's models need two
        lo, hi = (lo, hi + 1) if hi + 1 < 1 << width else (lo - 1, hi)
    freq = quantized(counts[lo : hi + 1])
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse((symbols - lo).astype(np.int32), _model(freq, constriction))
    words = coder.get_compressed().astype("<u4")
    coded = _PLANE_HEAD.pack(lo, hi - lo, words.size) + freq.astype("<u2").tobytes() + words.tobytes()
    if 1 + len(coded) >= 1 + plane.size:
        return bytes([_RAW]) + plane.tobytes()
    return bytes([_CODED]) + coded


# ---------------------------------------------------------------------------------------- decoding
def decode(payload: torch.Tensor, dtype: torch.dtype, shape: list[int], width: Any, what: str) -> torch.Tensor:
    """The tensor :func:`encode` coded, after checking that ``payload`` can describe it.

    Parameters
    ----------
    payload : torch.Tensor
        The stored tensor (untrusted): must be 1-D ``uint8``.
    dtype, shape : torch.dtype, list of int
        What the file declares the decoded tensor to be (``shape``: checked non-negative integers).
    width : Any
        The declared symbol width (untrusted).
    what : str
        Names the file and tensor in error messages.

    Raises
    ------
    CacheFileError
        A width the dtype cannot have, a payload that is not 1-D ``uint8``, a declared size over
        :data:`MAX_EXPANSION` times the payload, a bad frequency table, or coded words that do not
        decode to exactly the declared bytes.
    ImportError
        constriction is not installed (the message says what to install).
    """
    size = torch.empty(0, dtype=dtype).element_size()
    widths = WIDTHS if size == 1 else (8,)
    if type(width) is not int or width not in widths:
        raise CacheFileError(f"{what}: coded width {width!r:.40} is not one of {widths}")
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise CacheFileError(f"{what}: a coded tensor's payload must be 1-D uint8")
    n = math.prod(shape)
    if n == 0 or n * size > MAX_EXPANSION * payload.numel():
        raise CacheFileError(
            f"{what}: declares {n * size} bytes from a payload of {payload.numel()} bytes (a coded tensor holds "
            f"between 1 and {MAX_EXPANSION} bytes per payload byte)"
        )
    constriction = require()
    data = payload.numpy().tobytes()
    out = np.empty((n, size), np.uint8)
    at = 0
    for p in range(size):
        out[:, p], at = _decode_plane(data, at, n, width, constriction, f"{what}, byte plane {p}")
    if at != len(data):
        raise CacheFileError(f"{what}: {len(data) - at} bytes follow its last plane (corrupted)")
    return torch.from_numpy(out.reshape(-1)).view(dtype).reshape(shape)


def _decode_plane(data: bytes, at: int, n: int, width: int, constriction: Any, what: str) -> tuple[np.ndarray, int]:
    """One plane of ``n`` bytes read from ``data[at:]``, and where the next plane starts."""
    if at >= len(data) or data[at] not in (_RAW, _CODED):
        raise CacheFileError(f"{what}: missing, or of an unknown mode (truncated or corrupted)")
    mode, at = data[at], at + 1
    if mode == _RAW:
        if at + n > len(data):
            raise CacheFileError(f"{what}: a raw plane of {n} bytes runs past the payload (truncated)")
        return np.frombuffer(data, np.uint8, n, at), at + n
    if at + _PLANE_HEAD.size > len(data):
        raise CacheFileError(f"{what}: its table runs past the payload (truncated)")
    lo, k, words = _PLANE_HEAD.unpack_from(data, at)
    k += 1
    at += _PLANE_HEAD.size
    if k < 2 or lo + k > 1 << width:
        raise CacheFileError(f"{what}: symbols {lo}..{lo + k - 1} are not two or more {width}-bit symbols")
    if at + 2 * k + 4 * words > len(data):
        raise CacheFileError(f"{what}: its frequencies and {words} coded words run past the payload (truncated)")
    freq = np.frombuffer(data, "<u2", k, at).astype(np.int64)
    at += 2 * k
    if freq.sum() != 1 << PRECISION:
        raise CacheFileError(f"{what}: its frequencies sum to {freq.sum()}, not {1 << PRECISION} (corrupted)")
    compressed = np.frombuffer(data, "<u4", words, at).astype(np.uint32)
    at += 4 * words
    try:
        coder = constriction.stream.stack.AnsCoder(compressed)
    except ValueError as exc:  # e.g. a last word of zero, which no encoder writes
        raise CacheFileError(f"{what}: its coded words are invalid ({exc})") from None
    model = _model(freq, constriction)
    symbols = -(-8 * n // width)
    out = np.empty(-(-symbols // 8) * width, np.uint8)
    for start in range(0, symbols, CHUNK):
        amount = min(CHUNK, symbols - start)
        chunk = coder.decode(model, amount) + lo
        if amount % 8:
            chunk = np.concatenate([chunk, np.zeros(-amount % 8, np.int32)])
        piece = _bytes(chunk, width)
        out[start // 8 * width : start // 8 * width + piece.size] = piece
    if not coder.is_empty():
        raise CacheFileError(f"{what}: its coded words hold more than the declared {n} bytes (corrupted)")
    return out[:n], at


class EntropyCodec(Codec):
    """The ``"entropy"`` file codec: :func:`encode` and :func:`decode` behind the :class:`~kvpolicy.persist.Codec`
    seam (each coded tensor's parameter: its symbol ``width``). It also reads the coded files of format
    version 2 that kvpolicy wrote before files named their codec (it wrote them)."""

    name = "entropy"
    unnamed_versions = (2,)

    def require(self) -> None:
        require()

    def encode(self, t: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor] | None:
        coded = encode(t)
        return None if coded is None else ({"width": coded[0]}, coded[1])

    def decode(
        self, payload: torch.Tensor, dtype: torch.dtype, shape: list[int], params: dict[str, Any], what: str
    ) -> torch.Tensor:
        if set(params) != {"width"}:
            raise CacheFileError(f"{what}: its coding is not a mapping of dtype, shape, width; got {sorted(params)}")
        return decode(payload, dtype, shape, params["width"], what)
