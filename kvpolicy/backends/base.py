"""The backend contract: how quantized bits are stored.

A backend turns a floating-point tensor into a quantized container (``quantize``), turns it back
(``dequantize``), concatenates containers along the token axis, applies batch-row operations
(beam reorder, batch select/repeat) and reports the bytes it holds. Backends know nothing about
policies or about transformers.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpolicy.errors import ConfigError, MetadataOverflowError

AXES = ("token", "channel")
#: ``meta_dtype`` values of :class:`~kvpolicy.actions.quantize.Quantize`: ``"auto"`` (each backend's
#: default) or the name of the dtype scales and minimums are stored in
META_DTYPES = ("auto", "float16", "bfloat16", "float32")
#: ``scheme`` values of :class:`~kvpolicy.actions.quantize.Quantize`: asymmetric min-max groups, or a
#: per-vector norm with Lloyd-Max indices (:mod:`kvpolicy.backends.codebook`)
SCHEMES = ("minmax", "codebook")
#: ``fit`` values of :class:`~kvpolicy.actions.quantize.Quantize`: how a min-max group's range is chosen,
#: its extremes (``"minmax"``) or the range of least squared error (``"mse"``; same storage, same kernels)
FITS = ("minmax", "mse")


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; checked when a cache is constructed.

    Parameters
    ----------
    bits : tuple of int
        Supported code widths.
    axes : tuple of str
        Supported grouping axes (``"token"``: groups of channels of one token; ``"channel"``: groups
        of tokens of one channel).
    group_size_multiple : int
        Group sizes must be positive multiples of this number (packing granularity).
    devices : tuple of str
        Device types the kernels run on.
    dtypes : tuple of torch.dtype
        Input dtypes accepted.
    fused : bool
        Whether the fused decode path (:mod:`kvpolicy.fused`) can read this backend's blocks
        (``attend`` over blocks that ``QTensor.narrow`` can cut to whole groups). Without it,
        ``attention="auto"`` materialises the history and ``attention="fused"`` is refused.
    meta_dtypes : tuple of str
        ``meta_dtype`` values accepted (see :data:`META_DTYPES`); ``("auto",)``: the backend stores its
        metadata its own way and takes no ``meta_dtype`` argument.
    bit_pairs : tuple of (int, int), optional
        ``(key_bits, value_bits)`` pairs served when keys and values differ; ``None``: every pair of
        ``bits`` (keys and values are quantized, stored and attended independently).
    schemes : tuple of str
        Quantization schemes served (see :data:`SCHEMES`); a backend listing ``"codebook"`` takes a
        ``scheme`` keyword in ``quantize`` (passed only when it is not ``"minmax"``).
    codebook_bits : tuple of int
        Index widths of the codebook scheme, when it is served.
    codebook_centre : bool
        Whether codebook blocks may carry a centre (``quantize(..., centre=μ)``, read back by
        ``dequantize`` and ``attend``): what ``Quantize(key_centre=True)`` needs.
    fits : tuple of str
        How min-max groups may choose their range (see :data:`FITS`); a backend listing ``"mse"`` takes
        a ``fit`` keyword in ``quantize`` (passed only when it is not ``"minmax"``). The stored block is
        the same either way, so ``dequantize`` and ``attend`` need nothing new. Keys are fitted by
        default (``Quantize``'s ``key_fit="mse"``): on a backend listing only ``"minmax"`` a cache must
        pass ``key_fit="minmax"``, which the refusal says.
    """

    bits: tuple[int, ...]
    axes: tuple[str, ...]
    group_size_multiple: int
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    fused: bool = True
    meta_dtypes: tuple[str, ...] = ("auto",)
    bit_pairs: tuple[tuple[int, int], ...] | None = None
    schemes: tuple[str, ...] = ("minmax",)
    codebook_bits: tuple[int, ...] = ()
    codebook_centre: bool = False
    fits: tuple[str, ...] = ("minmax",)


def dense_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 attention in the mergeable ``(out, lse)`` form of :meth:`Backend.attend`.

    ``query`` ``(B, H, q, D)`` over ``keys``/``values`` ``(B, H, n, D)``; returns ``out``
    ``(B, H, q, Dv)`` and ``lse`` ``(B, H, q)``, both float32.
    """
    scores = torch.matmul(query.float(), keys.float().transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), values.float())
    return out, lse


def metadata_may_overflow(dtype: torch.dtype, meta: torch.dtype) -> bool:
    """Whether finite input of ``dtype`` can give scales or minimums beyond the range of ``meta``.

    True when ``meta`` holds smaller magnitudes than ``dtype`` (float32 or float64 input with float16
    metadata, float32 input with bfloat16, float64 input with any). Otherwise only groups within a
    factor of about 2 of float32's maximum can overflow (``max - min`` in float32).
    """
    return torch.finfo(meta).max < torch.finfo(dtype).max


def check_metadata(backend: str, x: torch.Tensor, meta: dict[str, torch.Tensor], remedy: str) -> None:
    """Raise :class:`~kvpolicy.errors.MetadataOverflowError` if finite ``x`` gave non-finite metadata.

    One reduction over the metadata (``1 / G`` of the input) and one host synchronisation. When the
    metadata is not finite because ``x`` itself is not (NaN / Inf input), nothing is raised: refusing
    non-finite input is the caller's choice (``Quantize(check_finite=True)`` does it before quantizing).

    Parameters
    ----------
    backend : str
        The backend's name, for the message.
    x : torch.Tensor
        ``(batch, kv_heads, tokens, head_dim)``, the input just quantized.
    meta : dict of str to torch.Tensor
        The floating-point metadata held for ``x``, by role (``scales``, ``zeros``), any shapes.
    remedy : str
        What the user can do, appended to the message.
    """
    if not meta:
        return
    if bool(torch.isfinite(torch.cat([t.reshape(-1) for t in meta.values()])).all()):  # one reduction
        return
    if not bool(torch.isfinite(x).all()):
        return
    counts = ", ".join(f"{n} non-finite {name}" for name, t in meta.items() if (n := int((~torch.isfinite(t)).sum())))
    dtypes = "/".join(sorted({str(t.dtype).removeprefix("torch.") for t in meta.values()}))
    limit = min(torch.finfo(t.dtype).max for t in meta.values())
    amax = float(x.detach().abs().amax()) if x.numel() else 0.0
    raise MetadataOverflowError(
        f"backend {backend!r}: quantizing finite {str(x.dtype).removeprefix('torch.')} values (largest |value| "
        f"{amax:.4g}) gave {counts} in {dtypes} metadata, which holds magnitudes up to {limit:.6g} (a group's "
        f"minimum, and its scale (max - min) / (2**bits - 1), must fit); dequantizing would give NaN/Inf. {remedy}"
    )


def widen_remedy(meta: torch.dtype, supported: tuple[str, ...]) -> str:
    """What to do when metadata overflowed in ``meta``, given the ``meta_dtype`` values supported."""
    wider = [n for n in ("float32", "bfloat16") if n in supported and str(meta) != f"torch.{n}"]
    if meta == torch.float16 and wider:
        options = " or ".join(f"meta_dtype={n!r}" for n in wider)
        return (
            f"Store the metadata with float32's range: {options} (Quantize(meta_dtype='float32') or "
            "CompressedCache(..., meta_dtype='float32'); float32 costs 32 more bits per group, bfloat16 the "
            "same bytes as float16 with an 8-bit significand)."
        )
    return (
        "Magnitudes this close to float32's limit (3.4e38) mean the model's keys/values are overflowing; "
        "check the model and the dtype it runs in."
    )


class QTensor(ABC):
    """A quantized block of keys or values, logically shaped ``(batch, kv_heads, tokens, head_dim)``.

    Subclasses hold their own tensors; ``tensors()`` names every tensor held so bytes can be counted
    from what is really stored.
    """

    #: logical shape ``(batch, kv_heads, tokens, head_dim)``
    shape: tuple[int, int, int, int]
    #: dtype of the original (and dequantized) tensor
    dtype: torch.dtype

    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor this container holds, keyed by role (``codes``, ``scales``, ``zeros``...)."""

    @abstractmethod
    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QTensor:
        """Apply a batch-axis (dim 0) operation to every held tensor and return the new container."""

    def narrow(self, start: int, length: int) -> QTensor:
        """Tokens ``[start, start + length)`` (per-channel blocks: whole groups). Optional: the fused
        decode path (:mod:`kvpolicy.fused`) needs it when a store's key and value streams hold
        different numbers of quantized tokens; without it that path is not used."""
        raise NotImplementedError(f"{type(self).__name__} does not implement narrow()")

    def select(self, index: torch.Tensor) -> QTensor:
        """Tokens ``index`` (a 1-D index into the token axis), in that order, of a block quantized per
        token: every tensor field of a dataclass container indexed along dim 2. Containers holding a
        tensor without a token axis override it (a codebook block keeps its centre)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        picked = {name: t.index_select(2, index) for name, t in fields.items() if isinstance(t, torch.Tensor)}
        shape = (*self.shape[:2], int(index.numel()), self.shape[3])
        return dataclasses.replace(self, **picked, shape=shape)  # type: ignore[type-var]

    @property
    def num_tokens(self) -> int:
        """Number of tokens held."""
        return self.shape[2]

    def nbytes(self) -> dict[str, int]:
        """Bytes held, by role."""
        return {name: t.numel() * t.element_size() for name, t in self.tensors().items()}


class Backend(ABC):
    """Packs and unpacks quantized tensors.

    Implementations must agree with the ``torch`` reference within one quantization step
    (``|x - x_hat| <= s / 2`` plus the rounding of the output dtype).
    """

    name: str = ""
    capabilities: Capabilities

    @abstractmethod
    def quantize(self, x: torch.Tensor, bits: int, group_size: int, axis: str) -> QTensor:
        """Quantize ``x``.

        Parameters
        ----------
        x : torch.Tensor
            ``(batch, kv_heads, tokens, head_dim)``. For ``axis="channel"`` ``tokens`` must be a
            multiple of ``group_size``; for ``axis="token"`` ``head_dim`` must be.
        bits : int
            Code width.
        group_size : int
            Elements per (scale, min) pair.
        axis : {"token", "channel"}
            Grouping axis.
        meta_dtype : str, optional
            The dtype scales and minimums are stored in, one of :data:`META_DTYPES`. Callers pass it
            (as a keyword) only when it is not ``"auto"``, and only to a backend whose
            ``capabilities.meta_dtypes`` lists it: backends that do not declare it need not accept it.
        scheme : str, optional
            ``"codebook"``: a per-vector scale and Lloyd-Max indices (``group_size`` and ``axis`` do not
            apply; :mod:`kvpolicy.backends.codebook`). Passed (as a keyword) only when it is not
            ``"minmax"``, and only to a backend whose ``capabilities.schemes`` lists it.
        fit : str, optional
            ``"mse"``: each min-max group's range is the one of least squared error rather than its
            extremes (:data:`FITS`). Passed (as a keyword) only when it is not ``"minmax"``, and only
            to a backend whose ``capabilities.fits`` lists it.

        Raises
        ------
        MetadataOverflowError
            If finite ``x`` would be stored with non-finite metadata. The built-in backends check
            (:func:`check_metadata`) wherever finite input can overflow their metadata dtype.
        """

    @abstractmethod
    def dequantize(self, q: QTensor) -> torch.Tensor:
        """Return ``(batch, kv_heads, tokens, head_dim)`` in ``q.dtype``."""

    @abstractmethod
    def cat(self, blocks: list[QTensor]) -> QTensor:
        """Concatenate containers of the same configuration along the token axis."""

    def block_state(self, q: QTensor) -> dict:
        """``q`` as JSON values and tensors, for a saved cache (:meth:`kvpolicy.CompressedCache.save`).

        Optional: a backend without it cannot save caches (the cache says so before writing)."""
        raise NotImplementedError(f"backend {self.name!r} cannot save its quantized blocks (no block_state())")

    def load_block(self, state: dict) -> QTensor:
        """The block :meth:`block_state` described."""
        raise NotImplementedError(f"backend {self.name!r} cannot load quantized blocks (no load_block())")

    def attend(
        self, query: torch.Tensor, keys: QTensor, values: QTensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of decode queries over a quantized segment, in mergeable (out, log-sum-exp) form.

        The reference implementation dequantizes; backends override it with kernels that read
        the packed codes directly. Results over disjoint key sets merge exactly:
        ``lse = logaddexp(lse_a, lse_b)``, ``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``.

        Parameters
        ----------
        query : torch.Tensor
            ``(batch, kv_heads, q, head_dim)``: the queries that share each kv head (grouped-query
            heads and query tokens flattened into ``q``).
        keys, values : QTensor
            ``(batch, kv_heads, n, head_dim)`` each, the same ``n`` tokens.
        scale : float
            Multiplies ``query @ keys.T`` (usually ``head_dim ** -0.5``).

        Returns
        -------
        out : torch.Tensor
            ``(batch, kv_heads, q, head_dim_v)`` float32, ``softmax(scores) @ values`` over these tokens.
        lse : torch.Tensor
            ``(batch, kv_heads, q)`` float32, ``logsumexp(scores)`` over these tokens.
        """
        return dense_attention(query, self.dequantize(keys), self.dequantize(values), scale)

    def check(self, *, bits: int, group_size: int, axis: str, role: str = "") -> None:
        """Raise :class:`ConfigError` if this backend cannot do what is asked.

        Parameters
        ----------
        bits, group_size, axis
            The requested configuration.
        role : str
            ``"key"`` or ``"value"``, used to name the parameter in the message.
        """
        caps = self.capabilities
        prefix = f"{role}_" if role else ""
        if bits not in caps.bits:
            raise ConfigError(
                f"backend {self.name!r} does not support bits={bits!r}; it supports bits in {list(caps.bits)}"
            )
        if axis not in caps.axes:
            raise ConfigError(
                f"backend {self.name!r} does not support {prefix}axis={axis!r}; it supports {list(caps.axes)}"
            )
        mult = caps.group_size_multiple
        if group_size % mult != 0:
            raise ConfigError(
                f"backend {self.name!r} needs group_size to be a multiple of {mult}; got group_size={group_size}"
            )

    def check_scheme(self, scheme: str, bits: int, role: str = "") -> None:
        """Raise :class:`ConfigError` if this backend cannot quantize ``role`` tensors with ``scheme``
        at ``bits`` (min-max widths are checked by :meth:`check`)."""
        caps = self.capabilities
        prefix = f"{role}_" if role else ""
        if scheme not in caps.schemes:
            raise ConfigError(
                f"backend {self.name!r} does not support {prefix}scheme={scheme!r}; it supports {list(caps.schemes)}"
            )
        if scheme == "codebook" and bits not in caps.codebook_bits:
            raise ConfigError(
                f"backend {self.name!r} does not support {prefix}bits={bits!r} with scheme='codebook'; it supports "
                f"bits in {list(caps.codebook_bits)}"
            )

    def check_meta_dtype(self, meta_dtype: str) -> None:
        """Raise :class:`ConfigError` if this backend cannot store metadata as ``meta_dtype`` asks."""
        supported = self.capabilities.meta_dtypes
        if meta_dtype not in supported:
            raise ConfigError(
                f"backend {self.name!r} does not support meta_dtype={meta_dtype!r}; it supports {list(supported)}"
            )

    def check_tensor(self, x: torch.Tensor) -> None:
        """Raise :class:`ConfigError` if the device or dtype of ``x`` is not supported."""
        caps = self.capabilities
        if x.device.type not in caps.devices:
            raise ConfigError(
                f"backend {self.name!r} does not run on device {x.device.type!r}; it supports {list(caps.devices)}"
            )
        if x.dtype not in caps.dtypes:
            raise ConfigError(
                f"backend {self.name!r} does not accept dtype {x.dtype}; it supports {[str(d) for d in caps.dtypes]}"
            )

    def __repr__(self) -> str:
        return repr(self.name)
