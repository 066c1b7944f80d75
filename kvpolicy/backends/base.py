"""The backend contract: how quantized bits are stored.

A backend turns a floating-point tensor into a quantized container (``quantize``), turns it back
(``dequantize``), concatenates containers along the token axis, applies batch-row operations
(beam reorder, batch select/repeat) and reports the bytes it holds. Backends know nothing about
policies or about transformers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpolicy.errors import ConfigError

AXES = ("token", "channel")


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
    """

    bits: tuple[int, ...]
    axes: tuple[str, ...]
    group_size_multiple: int
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]


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
        """

    @abstractmethod
    def dequantize(self, q: QTensor) -> torch.Tensor:
        """Return ``(batch, kv_heads, tokens, head_dim)`` in ``q.dtype``."""

    @abstractmethod
    def cat(self, blocks: list[QTensor]) -> QTensor:
        """Concatenate containers of the same configuration along the token axis."""

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
