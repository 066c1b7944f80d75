"""One-byte log-scale codes: how a codebook block stores its per-vector scales with ``norm_bits=8``.

A scale ``s > 0`` is first rounded to its *grid index* ``k = round(64 · log2 s)`` (1/64 octave). The
largest index of each batch row and head, ``T``, is the reference: the block keeps ``β = T − 255``
(int16, one per row and head) and one byte per vector:

- codes ``64 … 255`` (*fine*): ``k = β + c``, the 192 grid points below and at ``T`` (2.98 octaves);
- codes ``1 … 63`` (*coarse*): ``k`` rounded to a multiple of 4 (1/16 octave), the 63 multiples of 4
  below the fine ones (3.9 more octaves): ``k = A − 4 · (63 − c)``, ``A`` the largest multiple of 4
  below ``β + 64``;
- code ``0``: ``s = 0`` (a zero vector, or one more than about 6.9 octaves, a factor ~120, below the
  longest of its row and head: it comes back as zeros, off by its own norm, under 0.9 % of the
  longest vector's).

Relative error of a decoded scale (float32 rounding aside): at most ``2^(1/128) − 1`` (0.54 %) for
scales within 2.98 octaves of the largest (:data:`FINE_ERROR`), at most ``2^(2.5/64) − 1`` (2.75 %)
below (:data:`COARSE_ERROR`: half a fine step, then at most two). Measured scales of SmolLM2's keys and
values span 1.4 octaves (median) to 4.3 (largest) within one row and head of a stream, so nearly all
are fine.

Both rounding steps are applied to the grid index, never to ``s`` itself, so re-expressing codes
around a larger ``β`` (:func:`rebase`, when a longer vector arrives and blocks are concatenated) gives
exactly the codes that quantizing every vector at once would: a stream's blocks hold the same bytes
however its tokens were split. Decoding (:func:`decode_scales`) is a table entry times an exact power
of two, the same float32 bits on every device; kernels decode through it.
"""

from __future__ import annotations

import torch

#: grid points per octave
STEPS = 64
#: the largest code, which the largest scale of a batch row and head takes
TOP = 255
#: the lowest fine code: codes ``FINE_LOW … TOP`` are grid points ``β + c``
FINE_LOW = 64
#: grid points per coarse step (codes ``1 … FINE_LOW − 1``)
COARSE = 4
#: relative error bound of a fine code (scales within ``(TOP − FINE_LOW) / STEPS`` octaves of the largest)
FINE_ERROR = 2.0 ** (0.5 / STEPS) - 1.0
#: relative error bound of a coarse code (half a grid step, then at most ``COARSE / 2`` more)
COARSE_ERROR = 2.0 ** ((0.5 + COARSE / 2) / STEPS) - 1.0
#: grid indices of float32 scales: the smallest positive float32 (2^-149) gives the lowest; the highest
#: decodes below float32's maximum (``2^((k + 0.5) / STEPS) < 2^128``)
GRID_MIN, GRID_MAX = -149 * STEPS, 128 * STEPS - 1
#: the range of a block's ``scale_base`` ``β = T − TOP``; ``BASE_MIN`` marks a batch row and head with
#: no nonzero scale (every code 0), so that concatenation ignores it
BASE_MIN, BASE_MAX = GRID_MIN - TOP, GRID_MAX - TOP


#: device -> the table of :func:`octave_steps`, built at its first use there and held from then on: never an
#: inference tensor (a first call may come under ``torch.inference_mode``, and later calls under autograd), and
#: a plain dict, which ``torch.compile`` reads instead of tracing the table's construction
_OCTAVE_STEPS: dict[str, torch.Tensor] = {}


def octave_steps(device: str) -> torch.Tensor:
    """``2^(j / STEPS)`` for ``j < STEPS``, float32 on ``device`` (rounded once, from float64); the table a
    kernel decoding the codes itself must use (the ``cpu`` backend holds it from its construction)."""
    found = _OCTAVE_STEPS.get(device)
    if found is None:
        with torch.inference_mode(False):
            found = _OCTAVE_STEPS[device] = torch.tensor(
                [2.0 ** (j / STEPS) for j in range(STEPS)], dtype=torch.float32, device=device
            )
    return found


def grid_index(scales: torch.Tensor) -> torch.Tensor:
    """``round(STEPS · log2 s)`` of positive float32 ``scales``, int32 (zero scales: ``GRID_MIN − 1``)."""
    grid = torch.round(scales.double().log2() * STEPS)
    return torch.where(scales > 0, grid, GRID_MIN - 1).to(torch.int32)


def _coarse_anchor(base: torch.Tensor) -> torch.Tensor:
    """``A``: the largest multiple of ``COARSE`` below ``β + FINE_LOW`` (code ``FINE_LOW − 1``'s index)."""
    return torch.div(base + FINE_LOW - 1, COARSE, rounding_mode="floor") * COARSE


def _encode(index: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Codes (int32) of grid indices ``index`` around ``base`` (int32, broadcast); ``GRID_MIN − 1`` and
    indices beyond the coarse range give 0."""
    fine = index - base
    rounded = torch.div(index + COARSE // 2, COARSE, rounding_mode="floor") * COARSE
    coarse = FINE_LOW - 1 - torch.div(_coarse_anchor(base) - rounded, COARSE, rounding_mode="floor")
    code = torch.where(fine >= FINE_LOW, fine, torch.where(rounded - base >= FINE_LOW, rounded - base, coarse))
    return torch.where((index >= GRID_MIN) & (code >= 1), code, 0)


def _decode(codes: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Grid indices (int32) of nonzero ``codes`` around ``base`` (int32, broadcast)."""
    c = codes.to(torch.int32)
    return torch.where(c >= FINE_LOW, base + c, _coarse_anchor(base) - COARSE * (FINE_LOW - 1 - c))


def encode_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One-byte codes of float32 ``scales`` ``(B, H, n)`` (one host synchronisation, for the check).

    Returns
    -------
    codes : torch.Tensor
        ``(B, H, n)`` uint8 (see the module docstring).
    base : torch.Tensor
        ``β``, ``(B, H, 1)`` int16 in ``[BASE_MIN, BASE_MAX]`` (``BASE_MIN``: a row and head without a
        nonzero scale).

    Raises
    ------
    ValueError
        If a scale is NaN, infinite, negative or at least ``2^((GRID_MAX + 0.5) / STEPS)`` (just below
        float32's maximum: it would decode to infinity); nothing is encoded.
    """
    index = grid_index(scales)
    bad = ~torch.isfinite(scales) | (scales < 0) | (index > GRID_MAX)
    if bool(bad.any()):
        raise ValueError(
            f"one-byte scales hold finite scales in [0, 2^{(GRID_MAX + 0.5) / STEPS:.4f}); got {int(bad.sum())} "
            f"outside it (e.g. {scales[bad][0].item()!r})"
        )
    if index.shape[-1]:
        top = index.amax(dim=-1, keepdim=True).clamp_(GRID_MIN, GRID_MAX)
    else:
        top = index.new_full((*index.shape[:-1], 1), GRID_MIN)
    base = top - TOP
    return _encode(index, base).to(torch.uint8), base.to(torch.int16)


def decode_scales(codes: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The float32 scales ``(B, H, n)`` of ``codes`` ``(B, H, n)`` uint8 around ``base`` ``(B, H, 1)``
    int16 (:func:`encode_scales`): ``2^(k / STEPS)`` of their grid index ``k``, zero for code 0."""
    k = _decode(codes, base.to(torch.int32))
    octave = torch.div(k, STEPS, rounding_mode="floor")
    out = octave_steps(str(codes.device))[(k - octave * STEPS).long()] * torch.exp2(octave.to(torch.float32))
    return torch.where(codes == 0, 0.0, out)


def rebase(codes: torch.Tensor, base: torch.Tensor, new_base: torch.Tensor) -> torch.Tensor:
    """``codes`` around ``base`` re-expressed around ``new_base >= base`` (both ``(B, H, 1)`` int16): the
    codes quantizing their vectors around ``new_base`` gives (see the module docstring)."""
    old, new = base.to(torch.int32), new_base.to(torch.int32)
    index = torch.where(codes > 0, _decode(codes, old), GRID_MIN - 1)
    return _encode(index, new).to(torch.uint8)
