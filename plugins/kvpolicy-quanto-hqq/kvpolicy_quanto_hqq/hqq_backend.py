"""The ``hqq`` backend: HQQ's half-quadratic quantizer (``hqq.core.quantize.Quantizer``).

HQQ starts from min-max asymmetric parameters and then runs its proximal optimiser, which moves
each group's zero-point to reduce an ``l_p`` (``p = 0.7``) reconstruction error; codes are
``clamp(round(x / s + z), 0, 2**bits - 1)`` on the final grid and dequantization is
``(code - z) * s``. The grid therefore need not cover the group's extremes: elements outside it
are clamped, so HQQ's error is bounded by the distance to its own grid (see docs/explanation/backends.md),
not by the min-max ``s / 2``. Groups whose range is at most ``1e-4`` get ``s = 1``, and ``1 / s``
is clamped to ``2e4``.

Each group is handed to HQQ as a column of a ``(G, n_groups)`` matrix with HQQ ``axis=0``, so
HQQ packs along the group members: the packed codes are ``(G * bits / 8, n_groups)`` ``uint8``
(3 bits: ``(ceil(G / 10), n_groups)`` ``int32``, ten codes per word), and columns can be
concatenated along tokens and indexed by batch without unpacking. Scale and zero are stored in
float32, one each per group (zero in code units, ``z = -min / s``; ``meta_dtype`` ``"auto"`` or
``"float32"``, the same thing). Bits per element: ``bits + 64 / G`` (3 bits:
``32 * ceil(G / 10) / G + 64 / G``). HQQ computes in the input dtype; the float32 metadata is checked
after every quantize (:class:`~kvpolicy.errors.MetadataOverflowError` rather than NaN / Inf; cheap
next to HQQ's optimiser).

Column order: ``axis="token"``: ``(b, h, t, j)`` for the group of channels ``j*G:(j+1)*G`` of
token ``t``; ``axis="channel"``: ``(b, h, i, d)`` for the group of tokens ``i*G:(i+1)*G`` of
channel ``d``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from kvpolicy.backends._optional import installed, missing, refuse_fitted_ranges, require
from kvpolicy.backends.base import AXES, Backend, Capabilities, QTensor, Usability, check_metadata
from kvpolicy.errors import ConfigError
from kvpolicy.formats.base import Format
from kvpolicy.formats.packed import MinMax
from kvpolicy_quanto_hqq import INSTALL


@dataclass
class HQQTensor(QTensor):
    """HQQ-packed codes with per-group scale and zero-point.

    Attributes
    ----------
    codes : torch.Tensor
        ``(rows, n_groups)``: ``uint8`` with ``rows = G * bits / 8`` (``int32`` with
        ``rows = ceil(G / 10)`` for 3 bits).
    scales, zeros : torch.Tensor
        ``(1, n_groups)`` in the input dtype; ``x_hat = (code - zero) * scale``.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int
    axis: str
    packing: str
    shape: tuple[int, int, int, int]
    dtype: torch.dtype

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scales": self.scales, "zeros": self.zeros}

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> HQQTensor:
        b = self.shape[0]
        codes, scales, zeros = (_by_batch(t, b, fn) for t in (self.codes, self.scales, self.zeros))
        new_b = codes.shape[1] * b // self.codes.shape[1] if self.codes.shape[1] else b
        return replace(self, codes=codes, scales=scales, zeros=zeros, shape=(new_b, *self.shape[1:]))

    @classmethod
    def cat(cls, blocks: list[QTensor]) -> HQQTensor:  # type: ignore[override]
        """Blocks along the token axis: the columns of each (batch, head) row, joined."""
        if len(blocks) == 1:
            return blocks[0]  # type: ignore[return-value]
        first: HQQTensor = blocks[0]  # type: ignore[assignment]
        b, h = first.shape[:2]

        def cat(name: str) -> torch.Tensor:
            parts = [getattr(blk, name) for blk in blocks]
            rows = parts[0].shape[0]
            return torch.cat([p.reshape(rows, b, h, -1) for p in parts], dim=3).reshape(rows, -1)

        shape = (b, h, sum(blk.shape[2] for blk in blocks), first.shape[3])
        return replace(first, codes=cat("codes"), scales=cat("scales"), zeros=cat("zeros"), shape=shape)


def _by_batch(t: torch.Tensor, batch: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Apply a batch-axis operation to ``(rows, n_groups)`` whose columns are batch-major."""
    rows = t.shape[0]
    per_row = t.reshape(rows, batch, -1).transpose(0, 1)  # (batch, rows, groups per batch row)
    return fn(per_row).transpose(0, 1).reshape(rows, -1)


def _columns(x: torch.Tensor, group_size: int, axis: str) -> torch.Tensor:
    """``(B, H, T, D)`` -> ``(G, n_groups)``: one group per column, in the documented order."""
    b, h, t, d = x.shape
    if axis == "token":
        return x.reshape(-1, group_size).t().contiguous()
    return x.reshape(b, h, t // group_size, group_size, d).permute(3, 0, 1, 2, 4).reshape(group_size, -1).contiguous()


def _uncolumns(w: torch.Tensor, axis: str, shape: tuple[int, int, int, int]) -> torch.Tensor:
    b, h, t, d = shape
    g = w.shape[0]
    if axis == "token":
        return w.t().reshape(shape)
    return w.reshape(g, b, h, t // g, d).permute(1, 2, 3, 0, 4).reshape(shape)


_REMEDY = (
    "HQQ's optimiser runs in the input dtype; run the model in float32, or use backend='torch' with "
    "meta_dtype='float32'."
)


class HQQBackend(Backend):
    """HQQ group-wise quantization with its zero-point optimiser (this plugin:
    ``pip install ./plugins/kvpolicy-quanto-hqq``).

    Bits 1, 2, 3, 4 and 8 (HQQ's bit-packed widths; its 5- and 6-bit modes store a byte per code and
    are not offered). Groups are packed along their members, so ``group_size`` must be a multiple of 8
    (1-bit packing puts 8 codes in a byte).
    """

    name = "hqq"
    capabilities = Capabilities(
        bits=(1, 2, 3, 4, 8),
        axes=AXES,
        group_size_multiple=8,
        devices=("cpu", "cuda"),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        meta_dtypes=("auto", "float32"),
        fused=False,  # its blocks cannot be narrowed to whole groups (QTensor.narrow)
    )

    @classmethod
    def usability(cls) -> Usability:
        """Usable with the hqq package installed (imports nothing)."""
        return Usability(True) if installed("hqq") else missing("hqq", INSTALL)

    def __init__(self) -> None:
        self._quantizer = require("hqq.core.quantize", self.name, INSTALL).Quantizer

    def check_format(self, fmt: Format, role: str = "") -> None:
        """:meth:`Backend.check_format`, and no fitted ranges (the library chooses each group's range)."""
        super().check_format(fmt, role)
        refuse_fitted_ranges(self.name, fmt, role)

    def _quantize(self, x: torch.Tensor, fmt: MinMax, centre: torch.Tensor | None = None) -> HQQTensor:
        """:meth:`Backend.quantize` of a :class:`~kvpolicy.formats.MinMax` format; the metadata is float32
        whatever ``meta_dtype`` (``"auto"`` or ``"float32"``).

        Raises
        ------
        ConfigError
            If the format asks for what HQQ does not do (another ``meta_dtype``, fitted ranges, a centre).
        MetadataOverflowError
            If finite ``x`` gives a non-finite scale or zero-point.
        """
        bits, group_size, axis = fmt.bits, fmt.group_size, fmt.axis
        if centre is not None:
            raise ConfigError(f"backend 'hqq' keeps min-max groups, which take no centre; got {fmt}")
        self.check_format(fmt)
        w = _columns(x, group_size, axis)
        codes, meta = self._quantizer.quantize(
            w, nbits=bits, channel_wise=True, group_size=group_size, optimize=True, axis=0,
            bitpack=True, compute_dtype=x.dtype, device=x.device,
        )  # fmt: skip
        scales, zeros = meta["scale"].float(), meta["zero"].float()
        check_metadata(self.name, x, {"scales": scales, "zeros": zeros}, _REMEDY)
        return HQQTensor(
            codes, scales, zeros, bits, group_size, axis, meta["packing"], tuple(x.shape), x.dtype,  # type: ignore[arg-type]
        )  # fmt: skip

    def _meta(self, q: HQQTensor) -> dict:
        return {
            "nbits": q.bits, "group_size": q.group_size, "shape": torch.Size((q.group_size, q.codes.shape[1])),
            "scale": q.scales, "zero": q.zeros, "axis": 0, "packing": q.packing, "view_as_float": False,
            "compute_dtype": q.dtype,
        }  # fmt: skip

    def _dequantize(self, q: HQQTensor) -> torch.Tensor:
        w = self._quantizer.dequantize(q.codes, self._meta(q))  # float32: the metadata is float32
        return _uncolumns(w, q.axis, q.shape).to(q.dtype)

    quantizers: ClassVar[dict[type, Callable[..., QTensor]]] = {MinMax: _quantize}
    dequantizers: ClassVar[dict[type, Callable[..., torch.Tensor]]] = {HQQTensor: _dequantize}
