"""The ``quanto`` backend: optimum-quanto's group-wise affine ``qint2`` / ``qint4`` weight tensors.

Each block is quantized the way transformers' ``QuantoQuantizedLayer`` quantizes a whole cache:
``MaxOptimizer`` (per group ``scale = (max - min) / (2**bits - 1)`` and ``shift = -min``, both in the
input dtype, rounded to nearest) then ``quantize_weight`` (``code = round((x + shift) / scale)``,
clamped to ``[0, 2**bits - 1]``); dequantization is ``scale * code - shift``. Grouping uses
quanto's own axes on the ``(batch, kv_heads, tokens, head_dim)`` block: ``axis="token"`` is quanto
axis ``0`` (``group_size`` consecutive channels of one token), ``axis="channel"`` is quanto axis
``-1`` (``group_size`` consecutive tokens of one channel).

Storage per group: codes packed ``8 // bits`` per ``uint8`` (quanto packs along the first axis
of its grouped view, padding it to a multiple of ``8 // bits``), one scale and one shift in the
input dtype (2 bytes each for 16-bit inputs, 4 for float32). Bits per element for 16-bit inputs:
``bits + 32 / G``. The metadata dtype follows the input (``meta_dtype="auto"`` only). For float16
inputs the scale, shift and top grid point (``scale * (2**bits - 1) - shift``, as quanto dequantizes)
are checked after quantizing: a group spanning more than 65504, or whose top grid point rounds past
65504, raises :class:`~kvpolicy.errors.MetadataOverflowError` instead of storing or returning ``inf``.

quanto's packing interleaves groups, so blocks cannot be concatenated byte-wise: :meth:`cat` and
``map_batch`` unpack the stored codes, rearrange them and pack them again (codes, scales and
shifts are copied, never recomputed: nothing is quantized twice).

On CPU quanto unpacks with a C++ extension it compiles on first use (about 40 s, once per
environment; it needs ``ninja`` on ``PATH`` and a C++ compiler). :meth:`QuantoBackend.check_tensor`
loads it, so a cache pays that cost when it first sees a CPU tensor, not inside a decode step.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvpolicy.backends._optional import installed, missing, ninja, refuse_fitted_ranges, require
from kvpolicy.backends.base import AXES, Backend, Capabilities, QTensor, Usability, check_metadata
from kvpolicy.errors import ConfigError
from kvpolicy.formats.base import Format
from kvpolicy.formats.packed import MinMax
from kvpolicy_quanto_hqq import INSTALL

#: quanto grouping axis for each kvpolicy axis
QUANTO_AXIS = {"token": 0, "channel": -1}
_FP16_REMEDY = (
    "quanto computes a group's scale (max - min) / (2**bits - 1) and its grid (scale * code - shift) in the "
    "input dtype, so float16 groups spanning about 65504, or reaching near +-65504, overflow; use "
    "backend='torch' (it computes in float32 and holds every float16 group), or run the model in bfloat16 or "
    "float32."
)


@dataclass
class QuantoTensor(QTensor):
    """One quanto ``WeightQBitsTensor`` holding a ``(batch, kv_heads, tokens, head_dim)`` block.

    Attributes
    ----------
    qt : optimum.quanto.WeightQBitsTensor
        Grouped view ``(B*H*T*D/G, G)`` for ``axis="token"``, ``(G, B*H*T*D/G)`` for
        ``axis="channel"``; holds ``_data`` (packed ``uint8`` codes), ``_scale`` and ``_shift``.
    """

    qt: Any
    bits: int
    group_size: int
    axis: str
    shape: tuple[int, int, int, int]
    dtype: torch.dtype

    def tensors(self) -> dict[str, torch.Tensor]:
        # _data is quanto's PackedTensor (a wrapper subclass); its ._data is the real uint8 storage
        return {"codes": self.qt._data._data, "scales": self.qt._scale, "zeros": self.qt._shift}

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantoTensor:
        codes, scale, shift = (fn(t) for t in _batch_major(self))
        return _rebuild(self, codes, scale, shift)

    def dequantize(self) -> torch.Tensor:
        """quanto's own ``scale * code - shift``, in the input dtype."""
        return self.qt.dequantize().reshape(self.shape)

    @classmethod
    def cat(cls, blocks: list[QTensor]) -> QuantoTensor:  # type: ignore[override]
        """Blocks along the token axis: codes unpacked, joined and packed again (nothing requantized)."""
        if len(blocks) == 1:
            return blocks[0]  # type: ignore[return-value]
        parts = [_batch_major(b) for b in blocks]  # type: ignore[arg-type]
        codes, scale, shift = (torch.cat([p[i] for p in parts], dim=2) for i in range(3))
        return _rebuild(blocks[0], codes, scale, shift)  # type: ignore[arg-type]


def _batch_major(q: QuantoTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpacked codes, scales and shifts with batch on dim 0 and tokens on dim 2.

    ``axis="token"``: codes ``(B, H, T, D/G, G)``, scale/shift ``(B, H, T, D/G, 1)``.
    ``axis="channel"``: codes ``(B, H, T/G, G, D)``, scale/shift ``(B, H, T/G, 1, D)``.
    """
    b, h, t, d = q.shape
    g = q.group_size
    codes = q.qt._data.unpack()
    scale, shift = q.qt._scale, q.qt._shift
    if q.axis == "token":
        view = (b, h, t, d // g, -1)
        return codes.reshape(view), scale.reshape(view), shift.reshape(view)
    # quanto axis -1: column index = d * (B*H*T/G) + flat(b, h, t // G)
    view = (-1, d, b, h, t // g)
    return tuple(x.reshape(view).permute(2, 3, 4, 0, 1) for x in (codes, scale, shift))  # type: ignore[return-value]


def _rebuild(like: QuantoTensor, codes: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> QuantoTensor:
    """Inverse of :func:`_batch_major` (codes are packed again; nothing is requantized)."""
    from optimum.quanto import qint2, qint4
    from optimum.quanto.tensor.weights.qbits import WeightQBitsTensor

    b, h, t = codes.shape[0], codes.shape[1], codes.shape[2] * (like.group_size if like.axis == "channel" else 1)
    shape = (b, h, t, like.shape[3])
    if like.axis == "token":
        codes, scale, shift = codes.reshape(-1, like.group_size), scale.reshape(-1, 1), shift.reshape(-1, 1)
    else:
        codes, scale, shift = (x.permute(3, 4, 0, 1, 2).reshape(x.shape[3], -1) for x in (codes, scale, shift))
    stride = torch.empty(shape, device="meta").stride()
    qtype = qint2 if like.bits == 2 else qint4
    qt = WeightQBitsTensor(
        qtype, QUANTO_AXIS[like.axis], like.group_size, shape, stride,
        codes.contiguous(), scale.contiguous(), shift.contiguous(),
    )  # fmt: skip
    return QuantoTensor(qt, like.bits, like.group_size, like.axis, shape, like.dtype)


class QuantoBackend(Backend):
    """optimum-quanto ``qint2`` / ``qint4`` group-wise affine quantization (this plugin:
    ``pip install ./plugins/kvpolicy-quanto-hqq``).

    quanto's 8-bit weights are symmetric per-axis without groups (``WeightQBytesTensor``), not the
    asymmetric group-wise scheme of the other widths, so only 2 and 4 bits are offered.
    """

    name = "quanto"
    capabilities = Capabilities(
        bits=(2, 4),
        axes=AXES,
        group_size_multiple=1,
        devices=("cpu", "cuda", "mps"),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        fused=False,  # its blocks cannot be narrowed to whole groups (QTensor.narrow)
    )

    @classmethod
    def usability(cls) -> Usability:
        """Usable with optimum-quanto installed; on CPU tensors only where ``ninja`` can build quanto's extension.
        Imports nothing."""
        if not installed("optimum.quanto"):
            return missing("optimum-quanto", INSTALL)
        if not ninja():
            return Usability(True, "CUDA/MPS tensors only: CPU tensors need ninja (pip install ninja)")
        return Usability(True)

    def __init__(self) -> None:
        quanto = require("optimum.quanto", self.name, INSTALL)
        self._optimizer = quanto.MaxOptimizer()
        self._qtypes = {2: quanto.qint2, 4: quanto.qint4}
        self._quantize_weight = quanto.quantize_weight
        self._group = quanto.tensor.grouped.group
        self._cpu_ready = False

    def check_format(self, fmt: Format, role: str = "") -> None:
        """:meth:`Backend.check_format`, and no fitted ranges (the library chooses each group's range)."""
        super().check_format(fmt, role)
        refuse_fitted_ranges(self.name, fmt, role)

    def check_tensor(self, x: torch.Tensor) -> None:
        super().check_tensor(x)
        if x.device.type == "cpu":
            self.load_cpu_extension()

    def load_cpu_extension(self) -> None:
        """Build (first time in this environment, ~40 s) and load quanto's CPU unpacking extension.

        Raises
        ------
        ConfigError
            If ``ninja`` is not on ``PATH`` (torch needs it to build and load C++ extensions).
        """
        if self._cpu_ready:
            return
        if shutil.which("ninja") is None:
            raise ConfigError(
                "backend 'quanto' compiles a C++ extension for CPU tensors and needs the ninja build tool on PATH; "
                "install it with: pip install ninja (this plugin's dependencies include it) and activate the "
                "environment so its bin/ directory is on PATH"
            )
        from optimum.quanto.library.extensions import get_extension

        get_extension("quanto_cpp").lib  # noqa: B018 - the property builds and loads the extension
        self._cpu_ready = True

    def _quantize(self, x: torch.Tensor, fmt: MinMax, centre: torch.Tensor | None = None) -> QuantoTensor:
        """:meth:`Backend.quantize` of a :class:`~kvpolicy.formats.MinMax` format with quanto's optimiser.

        Raises
        ------
        ConfigError
            If the format asks for what quanto does not do (a ``meta_dtype``, fitted ranges, a centre).
        MetadataOverflowError
            If float16 groups overflow quanto's float16 arithmetic (see the module docstring).
        """
        bits, group_size, axis = fmt.bits, fmt.group_size, fmt.axis
        if centre is not None:
            raise ConfigError(f"backend 'quanto' keeps min-max groups, which take no centre; got {fmt}")
        self.check_format(fmt)
        qtype = self._qtypes[bits]
        qaxis = QUANTO_AXIS[axis]
        x = x.contiguous()
        # MaxOptimizer.optimize on quanto's grouped view, with the axis kept: its __call__ switches to
        # axis=None when there is a single group, which gives every element its own scale and shift
        scale, shift = self._optimizer.optimize(self._group(x, qaxis, group_size), qtype, qaxis)
        # optimized=False: always the kernel-agnostic WeightQBitsTensor (quanto would otherwise pick
        # AWQ/TinyGemm layouts for some 2-D shapes, which this container does not know)
        qt = self._quantize_weight(x, qtype, qaxis, scale, shift, group_size, optimized=False)
        if x.dtype == torch.float16:
            # quanto computes in the input dtype: max - min of a float16 group wider than 65504 is an inf
            # scale, and dequantizing (scale * code, then - shift) can pass 65504 at the top code even with
            # a finite scale; that top grid point is checked as quanto computes it
            top = qt._scale * ((1 << bits) - 1) - qt._shift
            meta = {"scales": qt._scale, "zeros": qt._shift, "top grid points": top}
            check_metadata(self.name, x, meta, _FP16_REMEDY)
        return QuantoTensor(qt, bits, group_size, axis, tuple(x.shape), x.dtype)  # type: ignore[arg-type]

    quantizers: ClassVar[dict[type, Callable[..., QTensor]]] = {MinMax: _quantize}
