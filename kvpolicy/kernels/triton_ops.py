"""The Triton launchers, and the same launchers as ``torch.library`` custom operators.

Each launcher takes plain tensors and numbers (no kvpolicy objects) and runs its kernels where the tensors
are: compiled on CUDA tensors, under Triton's interpreter on CPU tensors (the backend decides, when it is
built, which of the two a process may use; :mod:`kvpolicy.kernels.triton_runtime`):

- :func:`attend`: decode attention over one part's quantized keys and values
  (:mod:`kvpolicy.kernels.triton_attention`), its token splits merged by their log-sum-exps;
- :func:`minmax_quantize` / :func:`minmax_dequantize`: min-max groups (:mod:`kvpolicy.kernels.triton_quant`).

They are registered as the custom operators ``torch.ops.kvpolicy.triton_attend``,
``torch.ops.kvpolicy.triton_minmax_quantize`` and ``torch.ops.kvpolicy.triton_minmax_dequantize``, each with a
fake implementation that gives its outputs' shapes and dtypes without running anything, so ``torch.compile``
traces around them (the kernels stay opaque calls in the graph). :func:`call` picks the operator while a
graph is being traced and the launcher itself otherwise (a custom operator's dispatch costs a few
microseconds per call, which a decode step would pay once per part and layer).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from kvpolicy.formats.packed import _inner_contiguous
from kvpolicy.kernels.triton_runtime import for_mode, next_pow2

#: the kinds of a role's blocks, as the attention kernel reads them (see :mod:`kvpolicy.kernels.triton_attention`)
MINMAX_TOKEN, MINMAX_CHANNEL, CODEBOOK = 0, 1, 2
#: ``input_precision`` of the attention kernel's products: float32 (``"ieee"``) or TF32 tensor cores
PRECISIONS = ("ieee", "tf32")


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``."""
    return -(-a // b)


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """bfloat16 tensors travel as their ``int16`` bit patterns (the interpreter has no bfloat16)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def per_head(t: torch.Tensor) -> torch.Tensor:
    """``t`` with each (batch, head) slice one contiguous block (batch and head strides free: token slices of
    a larger block are read in place); anything else is copied."""
    return t if _inner_contiguous(t) else t.contiguous()


def _kernels(name: str, interpret: bool) -> Any:
    from kvpolicy.kernels import triton_attention, triton_quant

    module = triton_attention if name in ("decode_attention_kernel", "merge_splits_kernel") else triton_quant
    return for_mode(getattr(module, name), interpret)


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def auto_splits(programs: int, n_tiles: int, device: torch.device) -> int:
    """Token splits per (batch, head, query block): one under the interpreter; on a GPU enough programs to
    fill it twice over, with at least 4 tiles per split."""
    if device.type != "cuda":
        return 1
    want = cdiv(2 * _multiprocessors(device.index if device.index is not None else torch.cuda.current_device()),
                max(1, programs))  # fmt: skip
    return max(1, min(want, n_tiles // 4))


# ---------------------------------------------------------------------------------------------- attention
def attend(
    query: torch.Tensor,
    k_codes: torch.Tensor, k_scales: torch.Tensor, k_zeros: torch.Tensor | None, k_base: torch.Tensor | None,
    k_centre: torch.Tensor | None,
    v_codes: torch.Tensor, v_scales: torch.Tensor, v_zeros: torch.Tensor | None, v_base: torch.Tensor | None,
    v_centre: torch.Tensor | None,
    bias: torch.Tensor | None,
    k_kind: int, k_bits: int, k_group: int, v_kind: int, v_bits: int, v_group: int,
    n_tokens: int, value_dim: int, scale: float, splits: int, tile: int, precision: str, num_warps: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Decode attention of ``query`` over one part's quantized keys and values (the launcher).

    Parameters
    ----------
    query : torch.Tensor
        ``(B, H, q, D)``, any float dtype (read as float32, scaled by ``scale`` in the kernel).
    k_codes, k_scales, k_zeros, k_base, k_centre
        The keys' packed ``uint8`` codes and metadata as their block holds them (min-max: scales and minimums;
        codebook: scales, or one-byte scale codes with their int16 ``(B, H, 1)`` base, and an optional
        ``(B, H, 1, D)`` centre); ``None`` where the kind has none.
    v_codes, v_scales, v_zeros, v_base, v_centre
        Likewise for the values.
    bias : torch.Tensor or None
        ``(B, H, q, n_tokens)``, added to the scaled scores.
    k_kind, v_kind : int
        :data:`MINMAX_TOKEN`, :data:`MINMAX_CHANNEL` or :data:`CODEBOOK`.
    k_bits, k_group, v_bits, v_group : int
        Code widths and min-max group sizes (ignored for codebook roles).
    n_tokens, value_dim : int
        Tokens of the part and the values' head dim.
    scale : float
        Score scale.
    splits : int
        Token splits (flash-decoding); 0: :func:`auto_splits`.
    tile : int
        Tokens per tile, a power of two (keys of kind :data:`MINMAX_CHANNEL`: their group instead).
    precision : {"ieee", "tf32"}
        The products' precision on a GPU (the interpreter computes in float32 either way).
    num_warps : int
        Warps per program on a GPU.

    Returns
    -------
    out : torch.Tensor
        ``(B, H, q, value_dim)`` float32 (zeros when ``n_tokens = 0``).
    lse : torch.Tensor
        ``(B, H, q)`` float32 (``-inf`` when ``n_tokens = 0``).
    """
    b, h, nq, d = query.shape
    dv = value_dim
    dev = query.device
    if n_tokens == 0 or nq == 0 or b * h == 0:
        return (
            torch.zeros((b, h, nq, dv), dtype=torch.float32, device=dev),
            torch.full((b, h, nq), -float("inf"), dtype=torch.float32, device=dev),
        )
    interpret = dev.type != "cuda"
    q32 = query.float().contiguous()
    tile = k_group if k_kind == MINMAX_CHANNEL else tile
    n_tiles = cdiv(n_tokens, tile)
    qb = max(16, min(next_pow2(nq), 256 if interpret else 64))
    n_qb = cdiv(nq, qb)
    splits = max(1, min(splits, n_tiles)) if splits > 0 else auto_splits(b * h * n_qb, n_tiles, dev)
    per_split = cdiv(n_tiles, splits)
    splits = cdiv(n_tiles, per_split)
    out = torch.empty((b * h, splits, nq, dv), dtype=torch.float32, device=dev)
    lse = torch.empty((b * h, splits, nq), dtype=torch.float32, device=dev)
    k = _Role(k_codes, k_scales, k_zeros, k_base, k_centre, k_kind, k_bits, q32)
    v = _Role(v_codes, v_scales, v_zeros, v_base, v_centre, v_kind, v_bits, q32)
    if bias is not None:
        bias = bias.float().contiguous()
    # fused multiply-adds in the attention (its sums are float32 either way); the min-max kernels turn them off
    opts = {} if interpret else {"num_warps": num_warps, "enable_fp_fusion": True}
    _kernels("decode_attention_kernel", interpret)[(b * h, splits, n_qb)](
        q32, out, lse, q32 if bias is None else bias,
        *k.pointers, *v.pointers, _steps(dev) if k.byte or v.byte else q32,
        n_tokens, nq, per_split, float(scale), h, *k.strides, *v.strides,
        D=d, DP=max(16, next_pow2(d)), DV=dv, DVP=max(16, next_pow2(dv)),
        K_KIND=k_kind, K_BITS=k_bits, K_G=k_group, K_BF16=k.bf16, K_BYTE=k.byte, K_CENTRE=k.centre,
        V_KIND=v_kind, V_BITS=v_bits, V_G=v_group, V_BF16=v.bf16, V_BYTE=v.byte, V_CENTRE=v.centre,
        BIAS=bias is not None, TILE=tile, BT=max(16, next_pow2(tile)), QB=qb,
        PRECISION="ieee" if interpret else precision, **opts,
    )  # fmt: skip
    if splits == 1:
        return out.view(b, h, nq, dv), lse.view(b, h, nq)
    merged = torch.empty((b * h, nq, dv), dtype=torch.float32, device=dev)
    merged_lse = torch.empty((b * h, nq), dtype=torch.float32, device=dev)
    mqb = min(16, next_pow2(nq))
    _kernels("merge_splits_kernel", interpret)[(b * h, cdiv(nq, mqb))](
        out, lse, merged, merged_lse, nq, splits, DV=dv, DVP=max(16, next_pow2(dv)), SP=next_pow2(splits), QB=mqb,
        **opts,
    )  # fmt: skip
    return merged.view(b, h, nq, dv), merged_lse.view(b, h, nq)


class _Role:
    """One role's tensors as the attention kernel takes them: pointers, strides and flags."""

    def __init__(
        self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, base: torch.Tensor | None,
        centre: torch.Tensor | None, kind: int, bits: int, dummy: torch.Tensor,
    ) -> None:  # fmt: skip
        codes = per_head(codes)
        if zeros is None:
            scales = per_head(scales)
        else:
            scales, zeros = per_head(scales), per_head(zeros)
            if scales.stride() != zeros.stride():  # the kernel reads both at the scales' strides
                scales, zeros = scales.contiguous(), zeros.contiguous()
        table = _centroids(bits, codes.device) if kind == CODEBOOK else dummy
        float_meta = centre if scales.dtype == torch.uint8 else scales
        self.bf16 = float_meta is not None and float_meta.dtype == torch.bfloat16
        self.byte = base is not None
        self.centre = centre is not None
        self.pointers = (
            codes,
            bits_view(scales),
            dummy if zeros is None else bits_view(zeros),
            dummy if base is None else base.contiguous(),
            dummy if centre is None else bits_view(centre.contiguous()),
            table,
        )
        self.strides = (codes.stride(0), codes.stride(1), scales.stride(0), scales.stride(1))


def _centroids(bits: int, device: torch.device) -> torch.Tensor:
    from kvpolicy.formats.codebook import centroids

    return centroids(bits, device)


def _steps(device: torch.device) -> torch.Tensor:
    from kvpolicy.formats.scale_codes import octave_steps

    return octave_steps(str(device))


# ---------------------------------------------------------------------------------------------- min-max groups
def group_walk(shape: tuple[int, ...], group_size: int, channel: bool) -> tuple[int, int, int, int]:
    """``(n_groups, R_DIV, R_OUTER, E_STRIDE)`` of the min-max kernels' group addressing (see
    :mod:`kvpolicy.kernels.triton_quant`) for ``(B, H, T, D)`` tensors."""
    b, h, t, d = shape
    if not channel:
        return b * h * t * d // group_size, 1, group_size, 1
    return b * h * (t // group_size) * d, d, group_size * d, d


def _block_n(n_groups: int, gp: int, interpret: bool) -> int:
    """Groups per program: a fixed block when compiled (one compile per layout), no bigger than the input
    under the interpreter (every program there costs Python time, so fewer and bigger ones)."""
    block = max(1, (1 << 16 if interpret else 1 << 11) // gp)
    return min(block, next_pow2(n_groups)) if interpret else block


def _minmax_lead(shape: tuple[int, ...], group_size: int, channel: bool) -> tuple[int, ...]:
    b, h, t, d = shape
    return (b, h, t // group_size, d) if channel else (b, h, t, d // group_size)


def minmax_quantize(
    x: torch.Tensor, bits: int, group_size: int, channel: bool, meta_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min-max quantize + pack of ``x`` ``(B, H, T, D)`` at ``bits`` of 2, 4 or 8 (the launcher).

    Returns the codes, scales and minimums of a :class:`~kvpolicy.formats.packed.PackedTensor` (groups along
    channels of a token, or along tokens of a channel with ``channel``); metadata that overflows ``meta_dtype``
    is stored as it comes (the backend checks it)."""
    per = 8 // bits
    lead = _minmax_lead(tuple(x.shape), group_size, channel)
    codes = torch.empty((*lead, group_size // per), dtype=torch.uint8, device=x.device)
    scales = torch.empty(lead, dtype=meta_dtype, device=x.device)
    zeros = torch.empty(lead, dtype=meta_dtype, device=x.device)
    n_groups, r_div, r_outer, e_stride = group_walk(tuple(x.shape), group_size, channel)
    if n_groups:
        interpret = x.device.type != "cuda"
        x = x.contiguous()
        gp = next_pow2(group_size)
        block_n = _block_n(n_groups, gp, interpret)
        opts = {} if interpret else {"num_warps": 4, "enable_fp_fusion": False}
        _kernels("quantize_pack_kernel", interpret)[(cdiv(n_groups, block_n),)](
            bits_view(x), codes, bits_view(scales), bits_view(zeros),
            n_groups, R_DIV=r_div, R_OUTER=r_outer, E_STRIDE=e_stride,
            G=group_size, GP=gp, BITS=bits, PER=per, NB=group_size // per, NBP=gp // per, BLOCK_N=block_n,
            IN_BF16=x.dtype == torch.bfloat16, META_BF16=meta_dtype == torch.bfloat16,
            META_F32=meta_dtype == torch.float32, **opts,
        )  # fmt: skip
    return codes, scales, zeros


def minmax_dequantize(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int, channel: bool,
    shape: list[int], dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """``code * scale + min`` of min-max groups at ``bits`` of 2, 4 or 8, as ``(B, H, T, D)`` ``shape`` in ``dtype``
    (the launcher)."""
    out = torch.empty(shape, dtype=dtype, device=codes.device)
    n_groups, r_div, r_outer, e_stride = group_walk(tuple(shape), group_size, channel)
    if n_groups:
        interpret = codes.device.type != "cuda"
        gp = next_pow2(group_size)
        block_n = _block_n(n_groups, gp, interpret)
        opts = {} if interpret else {"num_warps": 4, "enable_fp_fusion": False}
        per = 8 // bits
        _kernels("unpack_dequantize_kernel", interpret)[(cdiv(n_groups, block_n),)](
            codes.contiguous(), bits_view(scales.contiguous()), bits_view(zeros.contiguous()),
            bits_view(out), n_groups, R_DIV=r_div, R_OUTER=r_outer, E_STRIDE=e_stride,
            G=group_size, GP=gp, BITS=bits, PER=per, NB=group_size // per, BLOCK_N=block_n,
            OUT_BF16=dtype == torch.bfloat16, OUT_F16=dtype == torch.float16,
            META_BF16=scales.dtype == torch.bfloat16, **opts,
        )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------- custom operators
# the launchers themselves are the operators' implementations (their annotations are the schemas)
_attend_op = torch.library.custom_op("kvpolicy::triton_attend", attend, mutates_args=())
_quantize_op = torch.library.custom_op("kvpolicy::triton_minmax_quantize", minmax_quantize, mutates_args=())
_dequantize_op = torch.library.custom_op("kvpolicy::triton_minmax_dequantize", minmax_dequantize, mutates_args=())


@_attend_op.register_fake
def _attend_fake(query: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` ``(B, H, q, value_dim)`` and ``lse`` ``(B, H, q)``, float32 (:func:`attend`)."""
    b, h, nq, _ = query.shape
    value_dim = _ATTEND_PARAMETERS.bind(query, *args).arguments["value_dim"]
    return (
        query.new_empty((b, h, nq, value_dim), dtype=torch.float32),
        query.new_empty((b, h, nq), dtype=torch.float32),
    )


_ATTEND_PARAMETERS = inspect.signature(attend)


@_quantize_op.register_fake
def _quantize_fake(
    x: torch.Tensor, bits: int, group_size: int, channel: bool, meta_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lead = _minmax_lead(tuple(x.shape), group_size, channel)
    return (
        x.new_empty((*lead, group_size * bits // 8), dtype=torch.uint8),
        x.new_empty(lead, dtype=meta_dtype),
        x.new_empty(lead, dtype=meta_dtype),
    )


@_dequantize_op.register_fake
def _dequantize_fake(codes: torch.Tensor, *args: Any) -> torch.Tensor:
    bound = _DEQUANTIZE_PARAMETERS.bind(codes, *args).arguments
    return codes.new_empty(bound["shape"], dtype=bound["dtype"])


_DEQUANTIZE_PARAMETERS = inspect.signature(minmax_dequantize)


#: launcher -> its custom operator
OPERATORS: dict[Callable[..., Any], Any] = {
    attend: torch.ops.kvpolicy.triton_attend,
    minmax_quantize: torch.ops.kvpolicy.triton_minmax_quantize,
    minmax_dequantize: torch.ops.kvpolicy.triton_minmax_dequantize,
}


def call(launcher: Callable[..., Any], *args: Any) -> Any:
    """``launcher(*args)``, through its custom operator while ``torch.compile`` traces (:data:`OPERATORS`)."""
    if torch.compiler.is_compiling():
        return OPERATORS[launcher](*args)
    return launcher(*args)
