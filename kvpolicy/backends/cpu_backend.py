"""The ``cpu`` backend: the ``torch`` backend's storage with a C++ decode-attention kernel.

Quantize, dequantize, ``cat`` and the containers are the ``torch`` backend's
(:class:`~kvpolicy.formats.packed.PackedTensor` and
:class:`~kvpolicy.formats.codebook.CodebookTensor`, bit for bit). ``attend`` — the quantized
part of :mod:`kvpolicy.fused`'s decode attention — runs a hand-written C++ kernel
(:mod:`kvpolicy.kernels.cpu_attention`) that reads the packed codes inside the score and value
reductions: for min-max blocks, per key group, scores are ``(q ⊙ s) · codes + q · z``; per token, values
add ``(p · s) · codes`` and ``p · z``; online softmax; float32 accumulation; OpenMP over
(batch, kv head, token split).

Codebook blocks (``Quantize(scheme="codebook")``, :class:`~kvpolicy.formats.codebook.CodebookTensor`:
one scale per token, Lloyd-Max indices) are read by the same kernel: codebook keys score
``s_t · (q · C[codes_t])`` eight tokens at a time where AVX2 and FMA allow (tiles of
:attr:`CpuBackend.tile` tokens), codebook values add
``(p · s_t) · C[codes_t]`` (a table lookup, no zero term). Lattice blocks (``Quantize(scheme="lattice")``,
:class:`~kvpolicy.formats.lattice.LatticeTensor`: one scale per token, one D4 table index per four channels)
take the same paths with each index decoded to its four table coordinates: keys score
``s_t · (q · P[codes_t])``, values add ``(p · s_t) · P[codes_t]``. Any key scheme goes with any value scheme.

The kernel covers: **keys** min-max grouped per channel (the default, KIVI's), codebook or lattice;
**values** min-max grouped per token, codebook or lattice; **2, 3 or 4 bits** (lattice: 2 or 3; any
key/value pair), with float16, bfloat16 or float32 metadata (every ``meta_dtype``, each role its own),
and codebook and lattice blocks with one-byte scales (``norm_bits=8``), whose codes the kernel reads as
they are stored: per (batch, head) it builds the 256 scales their codes decode to, by the formula and
table of :mod:`kvpolicy.formats.scale_codes`. Other min-max layouts or widths are refused when a cache is
built (``check``), not run some other way: use ``backend="torch"`` for them.
Nothing falls back to the ``torch`` computation at decode time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from kvpolicy.backends.base import FITS, META_DTYPES, Capabilities, QTensor
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.errors import ConfigError
from kvpolicy.formats import codebook, lattice
from kvpolicy.formats.base import META_TORCH_DTYPES
from kvpolicy.formats.codebook import CodebookTensor
from kvpolicy.formats.lattice import LatticeTensor
from kvpolicy.formats.packed import PackedTensor, _inner_contiguous, per_head_views
from kvpolicy.formats.scale_codes import octave_steps
from kvpolicy.kernels import cpu_attention

#: the grouping axis the kernel reads, by role
AXIS_BY_ROLE = {"key": "channel", "value": "token"}
#: tokens per tile of codebook keys (:attr:`CpuBackend.tile`)
CODEBOOK_TILE = 64


class CpuBackend(TorchBackend):
    """``torch`` storage plus a compiled C++ ``attend`` (see the module docstring).

    Raises
    ------
    ConfigError
        At construction, if the kernel cannot be built (no C++ compiler, no ``ninja``, a failing
        build); the first construction in an environment compiles it (tens of seconds).
    """

    name = "cpu"
    capabilities = Capabilities(
        bits=(2, 3, 4),
        axes=("channel", "token"),
        group_size_multiple=4,
        devices=("cpu",),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        meta_dtypes=META_DTYPES,
        schemes=("minmax", "codebook", "lattice"),
        codebook_bits=codebook.CODEBOOK_BITS,
        codebook_centre=True,
        codebook_norm_bits=codebook.NORM_BITS,
        fits=FITS,
    )

    def __init__(self) -> None:
        self._kernel = cpu_attention.load()
        #: token splits per (batch, kv head); ``None``: :func:`cpu_attention.default_splits`
        self.splits: int | None = None
        #: tokens per tile of codebook keys (min-max keys: their group); one online-softmax step each
        self.tile: int = CODEBOOK_TILE

    # the loaded kernel is a module: copies of a cache share it, pickles load it again
    def __deepcopy__(self, memo: dict) -> CpuBackend:
        return self

    def __getstate__(self) -> dict:
        return {"splits": self.splits, "tile": self.tile}

    def __setstate__(self, state: dict) -> None:
        self._kernel = cpu_attention.load()
        self.splits = state["splits"]
        self.tile = state.get("tile", CODEBOOK_TILE)

    def check(self, *, bits: int, group_size: int, axis: str, role: str = "") -> None:
        """:meth:`Backend.check`, and keys must be grouped per channel, values per token."""
        super().check(bits=bits, group_size=group_size, axis=axis, role=role)
        want = AXIS_BY_ROLE.get(role)
        if want is not None and axis != want:
            raise ConfigError(
                f"backend 'cpu' reads {role}s grouped along {want!r} only; got {role}_axis={axis!r} "
                "(use backend='torch' for other layouts)"
            )

    def _packed_args(self, q: PackedTensor, role: str) -> tuple:
        self.check(bits=q.bits, group_size=q.group_size, axis=q.axis, role=role)
        if q.codes.device.type != "cpu":
            raise ConfigError(f"backend 'cpu' runs on CPU tensors; got {role}s on {q.codes.device.type!r}")
        codes, scales, zeros = per_head_views(q)
        return (codes, scales, zeros, None, q.bits, q.group_size, None), None

    def _scaled_args(
        self, q: CodebookTensor | LatticeTensor, role: str, what: str, table: Callable[[int], torch.Tensor]
    ) -> tuple:
        """A block of scheme ``what`` (codebook or lattice): its kernel arguments, checked: codes, scales (or
        one-byte codes with their base) and ``table(bits)`` (codebook centroids, 1-d; lattice points, 2-d: the
        kernel tells the scheme by it), built once the width is checked."""
        self.check_scheme(what, q.bits, role=role)
        codes, scales, base = q.codes, q.scales, q.scale_base
        if codes.device.type != "cpu" or scales.device.type != "cpu":
            raise ConfigError(f"backend 'cpu' runs on CPU tensors; got {role}s on {codes.device.type!r}")
        b, h, n, d = q.shape
        want = (b, h, n, d * q.bits // 8)
        if codes.dtype != torch.uint8 or tuple(codes.shape) != want or (d * q.bits) % 8:
            raise ConfigError(
                f"backend 'cpu': {what} {role}s of shape {q.shape} at {q.bits} bits need uint8 codes of shape "
                f"{want}; got {codes.dtype} {tuple(codes.shape)}"
            )
        allowed = (*META_TORCH_DTYPES.values(), torch.uint8) if base is not None else META_TORCH_DTYPES.values()
        if scales.dtype not in allowed or tuple(scales.shape) != (b, h, n):
            raise ConfigError(
                f"backend 'cpu': {what} {role}s need one float16, bfloat16 or float32 scale per token (or one-byte "
                f"codes with their base), shape {(b, h, n)}; got {scales.dtype} {tuple(scales.shape)}"
            )
        if not _inner_contiguous(codes):
            codes = codes.contiguous()
        if not _inner_contiguous(scales):
            scales = scales.contiguous()
        if base is not None and not _inner_contiguous(base):  # one-byte codes: the kernel decodes them
            base = base.contiguous()
        group = max(1, int(self.tile)) if role == "key" else 0
        return (codes, scales, None, table(q.bits), q.bits, group, base), q.centre

    def _codebook_args(self, q: CodebookTensor, role: str) -> tuple:
        return self._scaled_args(q, role, "codebook", codebook.centroids)

    def _lattice_args(self, q: LatticeTensor, role: str) -> tuple:
        return self._scaled_args(q, role, "lattice", lattice.points)

    #: how the kernel reads each format's blocks: ``{block class: method(self, q, role) -> (kernel arguments,
    #: centre or None)}`` (a centre, ``(B, H, 1, D)``, enters after the kernel, which reads the codes alone)
    readers: ClassVar[dict[type, Callable[..., tuple]]] = {
        PackedTensor: _packed_args,
        CodebookTensor: _codebook_args,
        LatticeTensor: _lattice_args,
    }

    def _kernel_args(self, q: QTensor, role: str) -> tuple[tuple, torch.Tensor | None]:
        """``(codes, scales, minimums or None, table or None, bits, group, base or None)`` of one role's block
        as the kernel takes them (``group``: the key group or the value group; a codebook or lattice block's
        tile of :attr:`tile` tokens for keys, unused for values; ``base``: one-byte scales' int16 base, the
        scales then their uint8 codes), and the block's centre (or ``None``), after checking the block
        (:attr:`readers`).

        Raises
        ------
        ConfigError
            Naming the role and what is wrong: a container the kernel does not read, a layout or width it
            does not serve, tensors not on the CPU or of the wrong shape or dtype.
        """
        reader = self.readers.get(type(q))
        if reader is None:
            raise ConfigError(
                f"backend 'cpu' reads PackedTensor, CodebookTensor and LatticeTensor containers; got "
                f"{role}s={type(q).__name__}"
            )
        return reader(self, q, role)

    def attend(  # type: ignore[override]
        self, query: torch.Tensor, keys: QTensor, values: QTensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`Backend.attend` in the C++ kernel (:meth:`attend_biased` without a bias)."""
        return self.attend_biased(query, keys, values, scale, None)

    def attend_biased(  # type: ignore[override]
        self, query: torch.Tensor, keys: QTensor, values: QTensor, scale: float, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`Backend.attend_biased` in the C++ kernel, which adds ``bias`` to each tile's scores.

        Parameters
        ----------
        query : torch.Tensor
            ``(B, H, q, D)``, float32 / float16 / bfloat16 (converted to float32 and scaled).
        keys : PackedTensor, CodebookTensor or LatticeTensor
            ``(B, H, n, D)``: min-max per channel, codebook or lattice; 2, 3 or 4 bits (lattice: 2 or 3).
        values : PackedTensor, CodebookTensor or LatticeTensor
            ``(B, H, n, Dv)``: min-max per token, codebook or lattice; 2, 3 or 4 bits (lattice: 2 or 3).
        scale : float
            Score scale.
        bias : torch.Tensor or None
            ``(B, H, q, n)``, added to the scaled scores (converted to contiguous float32).

        Returns
        -------
        out : torch.Tensor
            ``(B, H, q, Dv)`` float32 (zeros when ``n = 0``).
        lse : torch.Tensor
            ``(B, H, q)`` float32 (``-inf`` when ``n = 0``).

        Raises
        ------
        ConfigError
            If a block is not one the kernel reads (see :meth:`_kernel_args`), or the shapes do not match the
            query or each other.
        """
        (kc, ks, kz, kt, kbits, kgroup, kbase), key_centre = self._kernel_args(keys, "key")
        (vc, vs, vz, vt, vbits, vgroup, vbase), value_centre = self._kernel_args(values, "value")
        self.check_tensor(query)
        if query.dim() != 4:
            raise ConfigError(f"backend 'cpu': query must be (batch, kv_heads, q, head_dim); got {tuple(query.shape)}")
        b, h, nq, d = query.shape
        if tuple(keys.shape[:2]) != (b, h) or keys.shape[3] != d:
            raise ConfigError(
                f"backend 'cpu': keys of shape {keys.shape} do not match query of shape {tuple(query.shape)}"
            )
        if tuple(values.shape[:3]) != tuple(keys.shape[:3]):
            raise ConfigError(
                f"backend 'cpu': values of shape {values.shape} do not hold the tokens of keys {keys.shape}"
            )
        n, dv = keys.shape[2], values.shape[3]
        if n == 0 or nq == 0 or b * h == 0:
            return (
                torch.zeros((b, h, nq, dv), dtype=torch.float32),
                torch.full((b, h, nq), -float("inf"), dtype=torch.float32),
            )
        if bias is not None:
            if tuple(bias.shape) != (b, h, nq, n):
                raise ConfigError(f"backend 'cpu': bias of shape {tuple(bias.shape)} for scores {(b, h, nq, n)}")
            bias = bias.float().contiguous()
        q32 = (query.float() * scale).contiguous()
        n_tiles = -(-n // kgroup)
        splits = self.splits if self.splits is not None else cpu_attention.default_splits(b * h, n_tiles)
        # one-byte scale codes are decoded in the kernel, through the table of their own decoder
        steps = octave_steps("cpu") if kbase is not None or vbase is not None else None
        out, lse = self._kernel.attend(
            q32,
            kc,
            ks,
            kz,
            kt,
            kbits,
            kgroup,
            vc,
            vs,
            vz,
            vt,
            vbits,
            vgroup,
            max(1, int(splits)),
            kbase,
            vbase,
            steps,
            bias,
        )
        # a centred codebook block: the kernel reads the codes alone, and the centre enters after it
        # (every key score of the block shifts by q · μ, which moves the block's log-sum-exp only; the
        # values' centre adds to the output, whose probabilities sum to one)
        if key_centre is not None:
            lse = lse + torch.matmul(q32, key_centre.float().transpose(-1, -2)).squeeze(-1)
        if value_centre is not None:
            out = out + value_centre.float()
        return out, lse
