"""The ``triton`` backend: hand-written Triton kernels over the ``torch`` backend's packed format.

Quantize + pack, unpack + dequantize and decode attention are Triton kernels
(:mod:`kvpolicy.kernels.triton_quant`, :mod:`kvpolicy.kernels.triton_attention`). Containers are the
``torch`` backend's :class:`~kvpolicy.formats.packed.PackedTensor`, bit for bit: either
backend dequantizes, concatenates and attends over what the other quantized.

Where the kernels run is decided when the backend is constructed:

* ``TRITON_INTERPRET=1`` (or ``triton.knobs.runtime.interpret = True``): Triton's interpreter, on
  CPU tensors (NumPy; slow, for tests and debugging);
* otherwise, with a CUDA GPU: compiled, on CUDA tensors;
* otherwise: :class:`~kvpolicy.errors.ConfigError` saying what to do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import torch

from kvpolicy.backends.base import AXES, META_DTYPES, Backend, Capabilities, QTensor
from kvpolicy.errors import ConfigError
from kvpolicy.formats.packed import (
    MinMax,
    PackedTensor,
    metadata_check,
    per_head_views,
    quantize_packed,
    resolve_meta_dtype,
)
from kvpolicy.kernels import triton_runtime
from kvpolicy.kernels.triton_runtime import next_pow2

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclasses.dataclass(frozen=True)
class _Kernels:
    quantize: object
    dequantize: object
    attention: object


class TritonBackend(Backend):
    """Triton kernels for quantize, dequantize and decode attention (``attend``).

    The class-level :attr:`capabilities` list every device the backend can use; an instance narrows
    ``devices`` to the one its mode runs on: ``("cuda",)`` compiled, ``("cpu",)`` under the
    interpreter. ``attend`` is a single fused kernel for every layout: keys per channel (the default,
    KIVI) score as ``(q * scale_c) . codes + q . min_c`` per key group; keys per token and values in
    either layout are dequantized in registers. Nothing is written back in a float format.

    Raises
    ------
    ConfigError
        At construction, if ``triton`` is not installed or if there is neither a CUDA GPU nor the
        interpreter.
    """

    name = "triton"
    capabilities = Capabilities(
        bits=(2, 4, 8),
        axes=AXES,
        group_size_multiple=4,
        devices=("cuda", "cpu"),
        dtypes=_DTYPES,
        meta_dtypes=META_DTYPES,
    )

    def __init__(self) -> None:
        self.mode = triton_runtime.select_mode()
        interpret = self.mode == "interpret"
        from kvpolicy.kernels import triton_attention, triton_quant

        self._kernels = _Kernels(
            quantize=triton_runtime.for_mode(triton_quant.quantize_pack_kernel, interpret),
            dequantize=triton_runtime.for_mode(triton_quant.unpack_dequantize_kernel, interpret),
            attention=triton_runtime.for_mode(triton_attention.decode_attention_kernel, interpret),
        )
        self.capabilities = dataclasses.replace(
            TritonBackend.capabilities, devices=("cpu",) if interpret else ("cuda",)
        )
        # interpreted programs run one after another: fewer, bigger ones are faster
        self._block_elems = 1 << 16 if interpret else 1 << 11
        self._launch = {} if interpret else {"num_warps": 4}
        #: token splits of ``attend`` per (batch, head, query block), merged through their
        #: log-sum-exp; ``None``: automatic (enough programs to fill the GPU; 1 under the interpreter)
        self.splits: int | None = None

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _bits_view(t: torch.Tensor) -> torch.Tensor:
        """bf16 tensors travel as their ``int16`` bit patterns (see :mod:`kvpolicy.kernels.triton_quant`)."""
        return t.view(torch.int16) if t.dtype == torch.bfloat16 else t

    def _block_n(self, n_groups: int, gp: int) -> int:
        """Groups per program: a fixed block when compiled (one compile per layout), no bigger than
        the input under the interpreter (every program there costs Python time)."""
        block = max(1, self._block_elems // gp)
        return min(block, next_pow2(n_groups)) if self.mode == "interpret" else block

    @staticmethod
    def _group_walk(shape: tuple[int, ...], group_size: int, axis: str) -> tuple[int, int, int, int]:
        """``(n_groups, R_DIV, R_OUTER, E_STRIDE)`` of the kernels' group addressing."""
        b, h, t, d = shape
        if axis == "token":
            return b * h * t * d // group_size, 1, group_size, 1
        return b * h * (t // group_size) * d, d, group_size * d, d

    def _check_packed(self, q: PackedTensor, what: str) -> PackedTensor:
        self.check(bits=q.bits, group_size=q.group_size, axis=q.axis)
        if q.codes.device.type not in self.capabilities.devices:
            raise ConfigError(
                f"backend 'triton' ({self.mode}) does not run on device {q.codes.device.type!r}; "
                f"it supports {list(self.capabilities.devices)}"
            )
        return q

    # ------------------------------------------------------------------ Backend

    def _quantize(self, x: torch.Tensor, fmt: MinMax, centre: torch.Tensor | None = None) -> PackedTensor:
        """:meth:`Backend.quantize` of a :class:`~kvpolicy.formats.MinMax` format in one kernel; ``meta_dtype``
        as for the ``torch`` backend (:func:`~kvpolicy.formats.base.resolve_meta_dtype`), checked the same
        way (:class:`~kvpolicy.errors.MetadataOverflowError` where finite input can overflow it).

        ``fit="mse"`` (ranges fitted for the least squared error,
        :func:`~kvpolicy.formats.packed.quantize_packed`) runs the format's reference code, as torch
        operations on ``x``'s device (its errors name ``'triton'``): its blocks are this backend's format
        bit for bit, so the kernels dequantize and attend over them. The fit has no kernel of its own.
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
        if fit != "minmax":
            return quantize_packed(self, x, bits, group_size, axis, mdt, fit)
        shape = (b, h, t, d)
        x = x.contiguous()
        per = 8 // bits
        n_groups, r_div, r_outer, e_stride = self._group_walk(shape, group_size, axis)
        lead = (b, h, t, d // group_size) if axis == "token" else (b, h, t // group_size, d)
        codes = torch.empty((*lead, group_size // per), dtype=torch.uint8, device=x.device)
        scales = torch.empty(lead, dtype=mdt, device=x.device)
        zeros = torch.empty(lead, dtype=mdt, device=x.device)
        if n_groups:
            gp = next_pow2(group_size)
            block_n = self._block_n(n_groups, gp)
            opts = dict(self._launch, enable_fp_fusion=False) if self._launch else {}
            self._kernels.quantize[(triton_cdiv(n_groups, block_n),)](
                self._bits_view(x), codes, self._bits_view(scales), self._bits_view(zeros),
                n_groups, R_DIV=r_div, R_OUTER=r_outer, E_STRIDE=e_stride,
                G=group_size, GP=gp, BITS=bits, PER=per, NB=group_size // per, NBP=gp // per, BLOCK_N=block_n,
                IN_BF16=x.dtype == torch.bfloat16, META_BF16=mdt == torch.bfloat16, META_F32=mdt == torch.float32,
                **opts,
            )  # fmt: skip
        metadata_check(self, x, scales, zeros)
        return PackedTensor(codes, scales, zeros, bits, group_size, axis, shape, x.dtype)  # type: ignore[arg-type]

    def _dequantize(self, q: PackedTensor) -> torch.Tensor:
        q = self._check_packed(q, "q")
        out = torch.empty(q.shape, dtype=q.dtype, device=q.codes.device)
        n_groups, r_div, r_outer, e_stride = self._group_walk(q.shape, q.group_size, q.axis)
        if n_groups:
            gp = next_pow2(q.group_size)
            block_n = self._block_n(n_groups, gp)
            opts = dict(self._launch, enable_fp_fusion=False) if self._launch else {}
            per = 8 // q.bits
            self._kernels.dequantize[(triton_cdiv(n_groups, block_n),)](
                q.codes.contiguous(), self._bits_view(q.scales.contiguous()), self._bits_view(q.zeros.contiguous()),
                self._bits_view(out), n_groups, R_DIV=r_div, R_OUTER=r_outer, E_STRIDE=e_stride,
                G=q.group_size, GP=gp, BITS=q.bits, PER=per, NB=q.group_size // per, BLOCK_N=block_n,
                OUT_BF16=q.dtype == torch.bfloat16, OUT_F16=q.dtype == torch.float16,
                META_BF16=q.scales.dtype == torch.bfloat16, **opts,
            )  # fmt: skip
        return out

    def attend_without_kernel(
        self, query: torch.Tensor, keys: QTensor, values: QTensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Refused: the kernel reads packed blocks only (nothing falls back to torch at decode time)."""
        bad, what = (keys, "keys") if type(keys) is not PackedTensor else (values, "values")
        raise ConfigError(
            f"backend 'triton' reads PackedTensor containers (the 'torch' format); got {what}={type(bad).__name__}"
        )

    def _attend(
        self, query: torch.Tensor, keys: PackedTensor, values: PackedTensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused decode attention over packed keys and values (see :class:`TritonBackend`).

        Same contract as :meth:`Backend.attend`: ``query`` ``(B, H, q, D)``, ``keys``/``values``
        ``(B, H, n, D)`` / ``(B, H, n, Dv)`` packed; returns float32 ``out`` ``(B, H, q, Dv)`` and
        ``lse`` ``(B, H, q)`` (``-inf`` and zeros for ``n = 0``). Scores are formed in float32 from
        the stored codes and metadata (the reference rounds the dequantized keys to their dtype
        first, so bf16/fp16 segments differ from it by that rounding).
        """
        k = self._check_packed(keys, "keys")
        v = self._check_packed(values, "values")
        self.check_tensor(query)
        if query.dim() != 4:
            raise ConfigError(
                f"backend 'triton': query must be (batch, kv_heads, q, head_dim); got {tuple(query.shape)}"
            )
        b, h, nq, d = query.shape
        if k.shape[:2] != (b, h) or k.shape[3] != d:
            raise ConfigError(
                f"backend 'triton': keys of shape {k.shape} do not match query of shape {tuple(query.shape)}"
            )
        if v.shape[:3] != k.shape[:3]:
            raise ConfigError(f"backend 'triton': values of shape {v.shape} do not hold the tokens of keys {k.shape}")
        n, dv = k.shape[2], v.shape[3]
        dev = query.device
        if n == 0 or nq == 0 or b * h == 0:
            return (
                torch.zeros((b, h, nq, dv), dtype=torch.float32, device=dev),
                torch.full((b, h, nq), -float("inf"), dtype=torch.float32, device=dev),
            )
        q32 = query.float().contiguous()
        k_channel = k.axis == "channel"
        tile = k.group_size if k_channel else 64
        bt = max(16, next_pow2(tile))
        n_tiles = triton_cdiv(n, tile)
        interpret = self.mode == "interpret"
        qb = max(16, min(next_pow2(nq), 256 if interpret else 64))
        n_qb = triton_cdiv(nq, qb)
        if self.splits is not None:
            splits = max(1, min(int(self.splits), n_tiles))
        else:
            splits = 1 if interpret else self._splits(b * h * n_qb, n_tiles, dev)
        per_split = triton_cdiv(n_tiles, splits)
        splits = triton_cdiv(n_tiles, per_split)
        out = torch.empty((b * h, splits, nq, dv), dtype=torch.float32, device=dev)
        lse = torch.empty((b * h, splits, nq), dtype=torch.float32, device=dev)
        opts = {} if interpret else dict(self._launch, enable_fp_fusion=True)
        kc, ks, kz = per_head_views(k)
        vc, vs, vz = per_head_views(v)
        self._kernels.attention[(b * h, splits, n_qb)](
            q32, kc, self._bits_view(ks), self._bits_view(kz), vc, self._bits_view(vs), self._bits_view(vz),
            out, lse, n, nq, per_split, float(scale), h,
            kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1),
            vc.stride(0), vc.stride(1), vs.stride(0), vs.stride(1),
            D=d, DP=max(16, next_pow2(d)), DV=dv, DVP=max(16, next_pow2(dv)),
            K_CHANNEL=k_channel, K_BITS=k.bits, K_PER=8 // k.bits, K_G=k.group_size,
            K_BF16=k.scales.dtype == torch.bfloat16,
            V_CHANNEL=v.axis == "channel", V_BITS=v.bits, V_PER=8 // v.bits, V_G=v.group_size,
            V_BF16=v.scales.dtype == torch.bfloat16,
            TILE=tile, BT=bt, QB=qb, **opts,
        )  # fmt: skip
        if splits == 1:
            return out.view(b, h, nq, dv), lse.view(b, h, nq)
        total = torch.logsumexp(lse, dim=1)  # (BH, nq)
        w = torch.exp(lse - total.unsqueeze(1)).nan_to_num_(0.0)  # empty splits: exp(-inf) = 0
        merged = (out * w.unsqueeze(-1)).sum(dim=1)
        return merged.view(b, h, nq, dv), total.view(b, h, nq)

    quantizers: ClassVar[dict[type, Callable[..., QTensor]]] = {MinMax: _quantize}
    dequantizers: ClassVar[dict[type, Callable[..., torch.Tensor]]] = {PackedTensor: _dequantize}
    attention_kernels: ClassVar[dict[tuple[type, type], Callable[..., tuple]]] = {(PackedTensor, PackedTensor): _attend}

    @staticmethod
    def _splits(programs: int, n_tiles: int, device: torch.device) -> int:
        """Token splits per (batch, head, query block): enough programs to fill the GPU twice over,
        with at least 4 tiles per split."""
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        want = triton_cdiv(2 * sms, max(1, programs))
        return max(1, min(want, n_tiles // 4))


def triton_cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``."""
    return -(-a // b)
