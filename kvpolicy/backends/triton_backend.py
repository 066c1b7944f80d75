"""The ``triton`` backend: hand-written Triton kernels over the ``torch`` backend's formats.

Containers are the ``torch`` backend's, bit for bit: :class:`~kvpolicy.formats.packed.PackedTensor` (min-max
groups) and :class:`~kvpolicy.formats.codebook.CodebookTensor` (Lloyd-Max indices with one scale per vector,
16-bit or one-byte scales, an optional centre). Either backend dequantizes, concatenates and attends over
what the other quantized. Every format a shipped preset uses is read by one decode-attention kernel
(:mod:`kvpolicy.kernels.triton_attention`), in any pairing of key and value formats; min-max groups at 2,
4 and 8 bits are quantized and dequantized by Triton kernels too (:mod:`kvpolicy.kernels.triton_quant`).
Codebook blocks and 3-bit or fitted (``fit="mse"``) min-max groups are quantized by the format's reference
code, torch operations on the input's device.

Where the kernels run is decided when the backend is constructed:

* ``TRITON_INTERPRET=1`` (or ``triton.knobs.runtime.interpret = True``): Triton's interpreter, on
  CPU tensors (NumPy; slow, for tests and debugging);
* otherwise, with a CUDA GPU: compiled, on CUDA tensors;
* otherwise: :class:`~kvpolicy.errors.ConfigError` saying what to do.

The launchers are ``torch.library`` custom operators as well (:mod:`kvpolicy.kernels.triton_ops`), so
``torch.compile`` traces around them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import ClassVar

import torch

from kvpolicy.backends._optional import installed, missing
from kvpolicy.backends.base import AXES, META_DTYPES, Backend, Capabilities, QTensor, Usability
from kvpolicy.errors import ConfigError
from kvpolicy.formats import codebook
from kvpolicy.formats.codebook import CodebookTensor
from kvpolicy.formats.packed import MinMax, PackedTensor, metadata_check, quantize_packed, resolve_meta_dtype
from kvpolicy.kernels import triton_runtime

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: min-max widths with quantize and dequantize kernels (3 bits: the reference's torch operations)
_KERNEL_BITS = (2, 4, 8)


class TritonBackend(Backend):
    """Triton kernels for decode attention (``attend``, ``attend_biased``) over min-max and codebook blocks,
    and for min-max quantize and dequantize.

    ``attend`` is one fused kernel for every pairing of key and value blocks: min-max keys grouped per
    channel (KIVI's layout) score as ``(q * scale_c) . codes + q . min_c`` per key group; codebook keys as
    ``s_t (q . C[codes_t])`` (one-byte scales decoded in the kernel, a key centre adding ``q . mu`` to the
    part's log-sum-exp); min-max keys per token and min-max values in either layout are dequantized in
    registers; codebook values add ``(p_t s_t) C[codes_t]`` (a value centre adds ``mu``). Tokens are split
    across programs (flash-decoding) and the splits merged by their log-sum-exps in a second kernel. Nothing is
    written back in a float format.

    The class-level :attr:`capabilities` list every device the backend can use; an instance narrows
    ``devices`` to the one its mode runs on: ``("cuda",)`` compiled, ``("cpu",)`` under the interpreter.

    Attributes
    ----------
    splits : int or None
        Token splits of ``attend`` per (batch, head, query block); ``None``: automatic (enough programs to
        fill the GPU twice; 1 under the interpreter).
    tile : int or None
        Tokens per tile of keys that are not min-max per channel (those take one group per tile), a power of
        two; ``None``: 64 under the interpreter, 32 compiled.
    precision : {None, "ieee", "tf32"}
        The precision of the kernel's matrix products on a GPU: ``"tf32"`` (tensor cores, inputs rounded to a
        10-bit mantissa, sums in float32: finer than the 8-bit mantissa of a bfloat16 model's own queries and
        keys), ``"ieee"`` (float32 throughout), or ``None`` (the default): ``"tf32"`` for float16 and bfloat16
        queries, ``"ieee"`` for float32 and float64 ones, so the products are never coarser than the model's
        own. The interpreter computes in float32 either way.
    num_warps : int
        Warps per program of the compiled kernels.

    Raises
    ------
    ConfigError
        At construction, if ``triton`` is not installed or if there is neither a CUDA GPU nor the
        interpreter.
    """

    name = "triton"
    capabilities = Capabilities(
        bits=(2, 3, 4, 8),
        axes=AXES,
        group_size_multiple=4,
        devices=("cuda", "cpu"),
        dtypes=_DTYPES,
        meta_dtypes=META_DTYPES,
        formats=("minmax", "codebook"),
    )

    @classmethod
    def usability(cls) -> Usability:
        """Usable with the ``triton`` package and a CUDA GPU, or on CPU under ``TRITON_INTERPRET=1``; imports
        neither triton nor a kernel."""
        if not installed("triton"):
            return missing("triton", '"kvpolicy[triton]"')
        if torch.cuda.is_available():
            return Usability(True, "CUDA tensors (compiled kernels)")
        if os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on"):
            return Usability(True, "CPU tensors under Triton's interpreter (TRITON_INTERPRET=1; slow)")
        return Usability(False, "no CUDA GPU here; on CPU it runs only under TRITON_INTERPRET=1 (Triton's "
                                "interpreter, slow: for tests and debugging)")  # fmt: skip

    def __init__(self) -> None:
        self.mode = triton_runtime.select_mode()
        interpret = self.mode == "interpret"
        from kvpolicy.kernels import triton_ops

        self._ops = triton_ops
        self.capabilities = dataclasses.replace(
            TritonBackend.capabilities, devices=("cpu",) if interpret else ("cuda",)
        )
        self.splits: int | None = None
        self.tile: int | None = None
        self.precision: str | None = None
        self.num_warps = 4

    # ------------------------------------------------------------------ checks
    def check(self, *, bits: int, group_size: int, axis: str, role: str = "") -> None:
        """:meth:`Backend.check`, and 3-bit groups hold whole runs of eight codes (three bytes)."""
        super().check(bits=bits, group_size=group_size, axis=axis, role=role)
        if bits == 3 and group_size % 8:
            name = f"{role}_group_size" if role else "group_size"
            raise ConfigError(
                f"backend {self.name!r} packs 3-bit codes eight to three bytes: {name} must be a multiple of 8 "
                f"with bits=3; got {name}={group_size}"
            )

    def _on_device(self, t: torch.Tensor, what: str) -> None:
        if t.device.type not in self.capabilities.devices:
            raise ConfigError(
                f"backend 'triton' ({self.mode}) does not run on device {t.device.type!r}; it supports "
                f"{list(self.capabilities.devices)} (got {what} there)"
            )

    # ------------------------------------------------------------------ min-max groups
    def _quantize(self, x: torch.Tensor, fmt: MinMax, centre: torch.Tensor | None = None) -> PackedTensor:
        """:meth:`Backend.quantize` of a :class:`~kvpolicy.formats.MinMax` format in one kernel; ``meta_dtype``
        as for the ``torch`` backend (:func:`~kvpolicy.formats.base.resolve_meta_dtype`), checked the same
        way (:class:`~kvpolicy.errors.MetadataOverflowError` where finite input can overflow it).

        ``fit="mse"`` (ranges fitted for the least squared error,
        :func:`~kvpolicy.formats.packed.quantize_packed`) and 3-bit codes run the format's reference code,
        as torch operations on ``x``'s device (its errors name ``'triton'``): its blocks are this backend's
        format bit for bit, so the attention kernel reads them.
        """
        if centre is not None:
            raise ConfigError("backend 'triton': a centre applies to scheme='codebook' only; got scheme='minmax'")
        bits, group_size, axis, fit = fmt.bits, fmt.group_size, fmt.axis, fmt.fit
        mdt = resolve_meta_dtype(fmt.meta_dtype, x.dtype)
        if not isinstance(group_size, int) or group_size < 1:
            raise ConfigError(f"backend 'triton': group_size must be a positive integer; got group_size={group_size!r}")
        self.check(bits=bits, group_size=group_size, axis=axis)
        self.check_tensor(x)
        if x.dim() != 4:
            raise ConfigError(
                f"backend 'triton': x must be (batch, kv_heads, tokens, head_dim); got shape {tuple(x.shape)}"
            )
        b, h, t, d = x.shape
        along = d if axis == "token" else t
        if along % group_size:
            dim = "head_dim" if axis == "token" else "tokens"
            raise ConfigError(
                f"backend 'triton': axis={axis!r} needs {dim} to be a multiple of group_size={group_size}; "
                f"got {dim}={along}"
            )
        if fit != "minmax" or bits not in _KERNEL_BITS:
            return quantize_packed(self, x, bits, group_size, axis, mdt, fit)
        ops = self._ops
        codes, scales, zeros = ops.call(ops.minmax_quantize, x, bits, group_size, axis == "channel", mdt)
        metadata_check(self, x, scales, zeros)
        return PackedTensor(codes, scales, zeros, bits, group_size, axis, (b, h, t, d), x.dtype)

    def _dequantize(self, q: PackedTensor) -> torch.Tensor:
        self.check(bits=q.bits, group_size=q.group_size, axis=q.axis)
        self._on_device(q.codes, "the block")
        if q.bits not in _KERNEL_BITS:
            return q.dequantize()
        ops = self._ops
        return ops.call(
            ops.minmax_dequantize, q.codes, q.scales, q.zeros, q.bits, q.group_size, q.axis == "channel",
            list(q.shape), q.dtype,
        )  # fmt: skip

    # ------------------------------------------------------------------ attention
    def _role(self, q: QTensor, role: str) -> tuple:
        """``(codes, scales, zeros, base, centre, kind, bits, group)`` of one role's block, checked.

        Raises
        ------
        ConfigError
            Naming the role: a container the kernel does not read, a width or layout not served, tensors on
            another device.
        """
        ops = self._ops
        if type(q) is PackedTensor:
            self.check(bits=q.bits, group_size=q.group_size, axis=q.axis, role=role)
            self._on_device(q.codes, f"{role}s")
            kind = ops.MINMAX_CHANNEL if q.axis == "channel" else ops.MINMAX_TOKEN
            return q.codes, q.scales, q.zeros, None, None, kind, q.bits, q.group_size
        if type(q) is CodebookTensor:
            if q.bits not in codebook.CODEBOOK_BITS:
                raise ConfigError(
                    f"backend 'triton' reads codebook {role}s of bits in {list(codebook.CODEBOOK_BITS)}; got {q.bits}"
                )
            self._on_device(q.codes, f"{role}s")
            b, h, n, d = q.shape
            want = (b, h, n, d * q.bits // 8)
            if q.codes.dtype != torch.uint8 or tuple(q.codes.shape) != want or tuple(q.scales.shape) != (b, h, n):
                raise ConfigError(
                    f"backend 'triton': codebook {role}s of shape {q.shape} at {q.bits} bits need uint8 codes of "
                    f"shape {want} and scales of shape {(b, h, n)}; got {tuple(q.codes.shape)} and "
                    f"{tuple(q.scales.shape)}"
                )
            byte = q.scale_base is not None
            if byte != (q.scales.dtype == torch.uint8) or (byte and tuple(q.scale_base.shape) != (b, h, 1)):
                raise ConfigError(
                    f"backend 'triton': codebook {role}s hold one-byte scales (uint8) with a (batch, kv_heads, 1) "
                    f"scale_base, or floating-point scales without one; got {q.scales.dtype} scales and scale_base "
                    f"{None if q.scale_base is None else tuple(q.scale_base.shape)}"
                )
            if q.centre is not None and (
                tuple(q.centre.shape) != (b, h, 1, d) or (not byte and q.centre.dtype != q.scales.dtype)
            ):
                raise ConfigError(
                    f"backend 'triton': the centre of codebook {role}s of shape {q.shape} must be {(b, h, 1, d)} in "
                    f"the scales' dtype; got {tuple(q.centre.shape)} {q.centre.dtype}"
                )
            return q.codes, q.scales, None, q.scale_base, q.centre, ops.CODEBOOK, q.bits, 1
        raise ConfigError(
            f"backend 'triton' reads PackedTensor and CodebookTensor containers; got {role}s={type(q).__name__}"
        )

    def _attend(
        self, query: torch.Tensor, keys: QTensor, values: QTensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.attend_biased(query, keys, values, scale, None)

    def attend_biased(
        self, query: torch.Tensor, keys: QTensor, values: QTensor, scale: float, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused decode attention over quantized keys and values (see :class:`TritonBackend`), ``bias`` added
        to the scaled scores in the kernel.

        Same contract as :meth:`Backend.attend`: ``query`` ``(B, H, q, D)``, ``keys``/``values``
        ``(B, H, n, D)`` / ``(B, H, n, Dv)``, ``bias`` ``(B, H, q, n)`` or ``None``; returns float32 ``out``
        ``(B, H, q, Dv)`` and ``lse`` ``(B, H, q)`` (``-inf`` and zeros for ``n = 0``). Scores are formed from
        the stored codes and metadata with float32 sums (the reference rounds dequantized min-max keys to
        their dtype first, so bf16/fp16 segments differ from it by that rounding).

        Raises
        ------
        ConfigError
            If a block is not one the kernel reads (:meth:`_role`), or the shapes do not match.
        """
        k = self._role(keys, "key")
        v = self._role(values, "value")
        self.check_tensor(query)
        if query.dim() != 4:
            raise ConfigError(
                f"backend 'triton': query must be (batch, kv_heads, q, head_dim); got {tuple(query.shape)}"
            )
        b, h, nq, d = query.shape
        if tuple(keys.shape[:2]) != (b, h) or keys.shape[3] != d:
            raise ConfigError(
                f"backend 'triton': keys of shape {keys.shape} do not match query of shape {tuple(query.shape)}"
            )
        if tuple(values.shape[:3]) != tuple(keys.shape[:3]):
            raise ConfigError(
                f"backend 'triton': values of shape {values.shape} do not hold the tokens of keys {keys.shape}"
            )
        n, dv = keys.shape[2], values.shape[3]
        if bias is not None and tuple(bias.shape) != (b, h, nq, n):
            raise ConfigError(f"backend 'triton': bias of shape {tuple(bias.shape)} for scores {(b, h, nq, n)}")
        interpret = self.mode == "interpret"
        tile = self.tile if self.tile is not None else (64 if interpret else 32)
        if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1 or tile & (tile - 1):
            raise ConfigError(f"backend 'triton': tile must be a power of two; got tile={tile!r}")
        splits = self.splits
        if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int) or splits < 1):
            raise ConfigError(f"backend 'triton': splits must be None or a positive integer; got splits={splits!r}")
        precision = self.precision
        if precision is None:
            precision = "tf32" if query.dtype in (torch.float16, torch.bfloat16) else "ieee"
        elif precision not in self._ops.PRECISIONS:
            raise ConfigError(
                f"backend 'triton': precision must be None or one of {list(self._ops.PRECISIONS)}; got "
                f"precision={precision!r}"
            )
        ops = self._ops
        return ops.call(
            ops.attend, query, *k[:5], *v[:5], bias, *k[5:], *v[5:], n, dv, float(scale),
            splits or 0, tile, precision, int(self.num_warps),
        )  # fmt: skip

    def attend_without_kernel(
        self, query: torch.Tensor, keys: QTensor, values: QTensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Refused: the kernel reads min-max and codebook blocks only (nothing falls back to torch at decode
        time)."""
        bad, what = (keys, "keys") if type(keys) not in (PackedTensor, CodebookTensor) else (values, "values")
        raise ConfigError(
            f"backend 'triton' reads PackedTensor and CodebookTensor containers; got {what}={type(bad).__name__}"
        )

    quantizers: ClassVar[dict[type, Callable[..., QTensor]]] = {MinMax: _quantize}
    dequantizers: ClassVar[dict[type, Callable[..., torch.Tensor]]] = {PackedTensor: _dequantize}
    attention_kernels: ClassVar[dict[tuple[type, type], Callable[..., tuple]]] = dict.fromkeys(
        ((PackedTensor, PackedTensor), (PackedTensor, CodebookTensor), (CodebookTensor, PackedTensor),
         (CodebookTensor, CodebookTensor)),
        _attend,
    )  # fmt: skip
