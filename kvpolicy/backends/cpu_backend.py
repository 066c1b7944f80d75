"""The ``cpu`` backend: the ``torch`` backend's storage with a C++ decode-attention kernel.

Quantize, dequantize, ``cat`` and the containers are the ``torch`` backend's
(:class:`~kvpolicy.backends.torch_backend.PackedTensor`, bit for bit). ``attend`` — the quantized
part of :mod:`kvpolicy.fused`'s decode attention — runs a hand-written C++ kernel
(:mod:`kvpolicy.kernels.cpu_attention`) that reads the packed codes inside the score and value
reductions: per key group, scores are ``(q ⊙ s) · codes + q · z``; per token, values add
``(p · s) · codes`` and ``p · z``; online softmax; float32 accumulation; OpenMP over
(batch, kv head, token split).

The kernel covers one layout: **keys grouped per channel, values grouped per token** (the default,
KIVI's), **2, 3 or 4 bits** (any key/value pair), with float16, bfloat16 or float32 metadata (every
``meta_dtype``). Other layouts or widths are refused when a cache is built (``check``), not run some other way: use
``backend="torch"`` for them.

Codebook blocks (``Quantize(scheme="codebook")``, :mod:`kvpolicy.backends.codebook`) are attended by
the ``torch`` backend's computation from their codes (query against the centroid values, one scale
per token), not by the C++ kernel; a store whose keys or values are codebook blocks goes that way
as a whole.
"""

from __future__ import annotations

import torch

from kvpolicy.backends import codebook
from kvpolicy.backends.base import META_DTYPES, SCHEMES, Capabilities, QTensor
from kvpolicy.backends.torch_backend import PackedTensor, TorchBackend, per_head_views
from kvpolicy.errors import ConfigError
from kvpolicy.kernels import cpu_attention

#: the grouping axis the kernel reads, by role
AXIS_BY_ROLE = {"key": "channel", "value": "token"}


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
        schemes=SCHEMES,
        codebook_bits=codebook.CODEBOOK_BITS,
    )

    def __init__(self) -> None:
        self._kernel = cpu_attention.load()
        #: token splits per (batch, kv head); ``None``: :func:`cpu_attention.default_splits`
        self.splits: int | None = None

    # the loaded kernel is a module: copies of a cache share it, pickles load it again
    def __deepcopy__(self, memo: dict) -> CpuBackend:
        return self

    def __getstate__(self) -> dict:
        return {"splits": self.splits}

    def __setstate__(self, state: dict) -> None:
        self._kernel = cpu_attention.load()
        self.splits = state["splits"]

    def check(self, *, bits: int, group_size: int, axis: str, role: str = "") -> None:
        """:meth:`Backend.check`, and keys must be grouped per channel, values per token."""
        super().check(bits=bits, group_size=group_size, axis=axis, role=role)
        want = AXIS_BY_ROLE.get(role)
        if want is not None and axis != want:
            raise ConfigError(
                f"backend 'cpu' reads {role}s grouped along {want!r} only; got {role}_axis={axis!r} "
                "(use backend='torch' for other layouts)"
            )

    def _packed(self, q: QTensor, role: str) -> PackedTensor:
        if not isinstance(q, PackedTensor):
            raise ConfigError(f"backend 'cpu' reads PackedTensor containers; got {role}s={type(q).__name__}")
        self.check(bits=q.bits, group_size=q.group_size, axis=q.axis, role=role)
        if q.codes.device.type != "cpu":
            raise ConfigError(f"backend 'cpu' runs on CPU tensors; got {role}s on {q.codes.device.type!r}")
        return q

    def attend(  # type: ignore[override]
        self, query: torch.Tensor, keys: QTensor, values: QTensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`Backend.attend` in the C++ kernel.

        Parameters
        ----------
        query : torch.Tensor
            ``(B, H, q, D)``, float32 / float16 / bfloat16 (converted to float32 and scaled).
        keys, values : PackedTensor
            ``(B, H, n, D)`` / ``(B, H, n, Dv)``: keys per channel, values per token, 2, 3 or 4 bits each.
        scale : float
            Score scale.

        Returns
        -------
        out : torch.Tensor
            ``(B, H, q, Dv)`` float32 (zeros when ``n = 0``).
        lse : torch.Tensor
            ``(B, H, q)`` float32 (``-inf`` when ``n = 0``).
        """
        if isinstance(keys, codebook.CodebookTensor) or isinstance(values, codebook.CodebookTensor):
            return TorchBackend.attend(self, query, keys, values, scale)
        k = self._packed(keys, "key")
        v = self._packed(values, "value")
        self.check_tensor(query)
        if query.dim() != 4:
            raise ConfigError(f"backend 'cpu': query must be (batch, kv_heads, q, head_dim); got {tuple(query.shape)}")
        b, h, nq, d = query.shape
        if k.shape[:2] != (b, h) or k.shape[3] != d:
            raise ConfigError(
                f"backend 'cpu': keys of shape {k.shape} do not match query of shape {tuple(query.shape)}"
            )
        if v.shape[:3] != k.shape[:3]:
            raise ConfigError(f"backend 'cpu': values of shape {v.shape} do not hold the tokens of keys {k.shape}")
        if k.scales.dtype != v.scales.dtype:
            raise ConfigError(
                f"backend 'cpu': keys and values must share their metadata dtype; got {k.scales.dtype} and "
                f"{v.scales.dtype}"
            )
        n, dv = k.shape[2], v.shape[3]
        if n == 0 or nq == 0 or b * h == 0:
            return (
                torch.zeros((b, h, nq, dv), dtype=torch.float32),
                torch.full((b, h, nq), -float("inf"), dtype=torch.float32),
            )
        q32 = (query.float() * scale).contiguous()
        kc, ks, kz = per_head_views(k)
        vc, vs, vz = per_head_views(v)
        n_tiles = n // k.group_size
        splits = self.splits if self.splits is not None else cpu_attention.default_splits(b * h, n_tiles)
        out, lse = self._kernel.attend(
            q32, kc, ks, kz, k.bits, k.group_size, vc, vs, vz, v.bits, v.group_size, max(1, int(splits))
        )
        return out, lse
