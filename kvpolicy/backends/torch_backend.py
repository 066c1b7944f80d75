"""The ``torch`` backend: the reference, pure PyTorch; every format through its own methods.

Its default format is :mod:`kvpolicy.formats.packed` (asymmetric min-max groups with real bit packing;
the names below are re-exported from there for the code that imports them from this module). This backend
registers no kernel: quantize, dequantize, cat and attend are the formats' own, so a new format runs here as
soon as it is registered (``Format.backends`` names ``torch`` unless a format says otherwise).
"""

from __future__ import annotations

import torch

from kvpolicy import formats
from kvpolicy.backends.base import AXES, META_DTYPES, Backend, Capabilities, QTensor
from kvpolicy.errors import ConfigError
from kvpolicy.formats.packed import (  # noqa: F401 - re-exported for the tests and scripts that import them here
    FP16_MAX,
    PackedTensor,
    _grouped,
    _ungrouped,
    fit_range,
    pack,
    quantize_groups,
    unpack,
)


class TorchBackend(Backend):
    """Pure-PyTorch reference backend (any device torch runs on): every format through its own methods.

    ``attend`` (blocks without a kernel: every pair here) is :func:`kvpolicy.formats.attend`, which reads
    each block's :meth:`~kvpolicy.formats.base.QTensor.scores` and :meth:`~kvpolicy.formats.base.QTensor.mix`:
    min-max keys grouped per channel score without forming a dequantized key, codebook blocks score the
    query against the centroid values times each key's scale; float32 throughout.
    """

    name = "torch"
    capabilities = Capabilities(
        bits=(2, 3, 4, 8),
        axes=AXES,
        group_size_multiple=4,
        devices=("cpu", "cuda", "mps", "xpu"),
        dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.float64),
        meta_dtypes=META_DTYPES,
    )

    def check(self, *, bits: int, group_size: int, axis: str, role: str = "") -> None:
        """:meth:`Backend.check`, and 3-bit groups hold whole runs of eight codes (three bytes)."""
        super().check(bits=bits, group_size=group_size, axis=axis, role=role)
        if bits == 3 and group_size % 8:
            name = f"{role}_group_size" if role else "group_size"
            raise ConfigError(
                f"backend {self.name!r} packs 3-bit codes eight to three bytes: {name} must be a multiple of 8 "
                f"with bits=3; got {name}={group_size}"
            )

    def attend_without_kernel(
        self, query: torch.Tensor, keys: QTensor, values: QTensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`Backend.attend` from the blocks' own score and mix (:func:`kvpolicy.formats.attend`)."""
        return formats.attend(query, keys, values, scale)

    def attend_biased(
        self, query: torch.Tensor, keys: QTensor, values: QTensor, scale: float, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`Backend.attend_biased` from the blocks' own score and mix, the bias added to the scores."""
        if bias is None:
            return self.attend(query, keys, values, scale)
        return formats.attend(query, keys, values, scale, bias)
