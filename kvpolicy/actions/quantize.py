"""The ``"quantize"`` action: demoted tokens are quantized once, when demoted, and never again."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpolicy.actions.base import Action, DemotedStore
from kvpolicy.backends.base import AXES, Backend, QTensor
from kvpolicy.errors import ConfigError, NonFiniteError
from kvpolicy.policies.base import check_int


@dataclass(frozen=True)
class Quantize(Action):
    """Quantize demoted tokens to ``bits`` with asymmetric min-max groups of ``group_size``.

    Parameters
    ----------
    bits : int
        Code width; which widths exist depends on the backend (``torch``: 2, 4, 8).
    group_size : int
        Elements sharing one 16-bit scale and minimum. ``"token"`` axis: channels of one token
        (must divide ``head_dim``); ``"channel"`` axis: tokens of one channel.
    key_axis, value_axis : {"channel", "token"}
        Grouping axis of keys and values. Defaults follow KIVI (keys per channel, values per
        token): on SmolLM2-135M at 2 bits with the log policy, per-token keys raise next-token
        loss far more than per-channel keys. Per-channel tokens wait in a full-precision staging
        buffer until ``group_size`` of them are demoted, then are quantized once, in demotion order.
    check_finite : bool
        Raise :class:`~kvpolicy.errors.NonFiniteError` if NaN or Inf reaches the quantizer
        (one reduction over the demoted tokens; switch off for speed once a model is known good).
    """

    bits: int = 2
    group_size: int = 64
    key_axis: str = "channel"
    value_axis: str = "token"
    check_finite: bool = True

    name = "quantize"

    def __post_init__(self) -> None:
        check_int("bits", self.bits, 1, "Quantize")
        if self.bits > 8:
            raise ConfigError(f"Quantize: bits must be between 1 and 8; got bits={self.bits!r}")
        check_int("group_size", self.group_size, 1, "Quantize")
        for param in ("key_axis", "value_axis"):
            value = getattr(self, param)
            if value not in AXES:
                raise ConfigError(f"Quantize: {param} must be one of {list(AXES)}; got {param}={value!r}")
        if not isinstance(self.check_finite, bool):
            raise ConfigError(f"Quantize: check_finite must be a bool; got check_finite={self.check_finite!r}")

    def check_backend(self, backend: Backend) -> None:
        backend.check(bits=self.bits, group_size=self.group_size, axis=self.key_axis, role="key")
        backend.check(bits=self.bits, group_size=self.group_size, axis=self.value_axis, role="value")

    def check_head_dim(self, head_dim: int, multiple: int = 4) -> None:
        """Per-token groups split each token's channels: ``group_size`` must divide ``head_dim``.

        ``multiple`` is the backend's group-size granularity, used to suggest valid sizes.
        """
        if (self.key_axis == "token" or self.value_axis == "token") and head_dim % self.group_size != 0:
            divisors = [g for g in range(multiple, head_dim + 1, multiple) if head_dim % g == 0]
            raise ConfigError(
                f"Quantize: group_size={self.group_size} does not divide head_dim={head_dim} "
                f"(per-token groups split each token's channels); choose one of {divisors}"
            )

    def new_store(self, backend: Backend, layer_idx: int) -> QuantizedStore:
        return QuantizedStore(self, backend, layer_idx)


class QuantizedStream:
    """Append-only quantized storage of one tensor kind (keys or values) of one layer.

    Tokens are quantized in the order they are appended. With ``axis="channel"`` they first wait
    in ``staging`` (full precision) until a whole group of ``group_size`` tokens is there.
    """

    def __init__(self, backend: Backend, bits: int, group_size: int, axis: str) -> None:
        self.backend = backend
        self.bits = bits
        self.group_size = group_size
        self.axis = axis
        self.q: QTensor | None = None
        self.staging: torch.Tensor | None = None

    def append(self, x: torch.Tensor) -> None:
        """Append ``x``: ``(batch, kv_heads, n, head_dim)``."""
        if self.axis == "token":
            self._push(self.backend.quantize(x, self.bits, self.group_size, "token"))
            return
        staged = x if self.staging is None else torch.cat([self.staging, x], dim=2)
        ready = staged.shape[2] - staged.shape[2] % self.group_size
        if ready:
            self._push(self.backend.quantize(staged[:, :, :ready].contiguous(), self.bits, self.group_size, "channel"))
        self.staging = staged[:, :, ready:].contiguous() if ready < staged.shape[2] else None

    def _push(self, block: QTensor) -> None:
        self.q = block if self.q is None else self.backend.cat([self.q, block])

    def read(self) -> torch.Tensor:
        """All held tokens in append order, ``(batch, kv_heads, n, head_dim)``."""
        return self.read_from(0)

    def read_from(self, start: int) -> torch.Tensor:
        """Tokens ``[start, n)`` at full precision (dequantized and staged), ``(batch, kv_heads, n - start, head_dim)``.

        ``start`` must be a group boundary of a per-channel stream's quantized part (see :meth:`QTensor.narrow`).
        """
        parts = []
        if self.q is not None and start < self.q.num_tokens:
            block = self.q if start == 0 else self.q.narrow(start, self.q.num_tokens - start)
            parts.append(self.backend.dequantize(block))
        if self.staging is not None:
            parts.append(self.staging)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    @property
    def num_quantized(self) -> int:
        return 0 if self.q is None else self.q.num_tokens

    def nbytes(self) -> dict[str, int]:
        out = dict.fromkeys(("codes", "scales", "zeros", "staging"), 0)
        if self.q is not None:
            for role, n in self.q.nbytes().items():
                out[role] = out.get(role, 0) + n
        if self.staging is not None:
            out["staging"] = self.staging.numel() * self.staging.element_size()
        return out

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.q is not None:
            self.q = self.q.map_batch(fn)
        if self.staging is not None:
            self.staging = fn(self.staging)


class QuantizedStore(DemotedStore):
    """Keys and values of demoted tokens, quantized once each, with their positions."""

    def __init__(self, action: Quantize, backend: Backend, layer_idx: int) -> None:
        self.action = action
        self.layer_idx = layer_idx
        self.k = QuantizedStream(backend, action.bits, action.group_size, action.key_axis)
        self.v = QuantizedStream(backend, action.bits, action.group_size, action.value_axis)
        self.positions = torch.empty(1, 0, dtype=torch.long)

    def _check_finite(self, x: torch.Tensor, what: str) -> None:
        if not torch.isfinite(x).all():
            bad = int((~torch.isfinite(x)).sum())
            raise NonFiniteError(
                f"{bad} non-finite value(s) (NaN/Inf) in the {what} of layer {self.layer_idx} reached the "
                "quantizer; quantizing them would corrupt their whole group. Fix the model inputs/dtype "
                "(e.g. fp16 overflow), or pass check_finite=False to skip this check."
            )

    def add(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        if self.action.check_finite:
            self._check_finite(keys, "keys")
            self._check_finite(values, "values")
        self.k.append(keys)
        self.v.append(values)
        self.positions = torch.cat([self.positions.to(positions.device), positions], dim=1)

    def keys(self) -> torch.Tensor:
        return self.k.read()

    def values(self) -> torch.Tensor:
        return self.v.read()

    def attention_parts(self) -> tuple[tuple[QTensor, QTensor] | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """The stored tokens split for attention without materialising them (:mod:`kvpolicy.fused`).

        Returns
        -------
        quantized : (QTensor, QTensor) or None
            Keys and values of the first ``m`` stored tokens, both quantized (``m`` = the smaller
            quantized count of the two streams).
        tail : (torch.Tensor, torch.Tensor) or None
            Keys and values of the remaining tokens at full precision (staged, or dequantized when the
            other stream still stages them): ``(batch, kv_heads, n - m, head_dim)``, fewer than
            ``group_size`` tokens.
        """
        nk, nv = self.k.num_quantized, self.v.num_quantized
        m = min(nk, nv)
        quantized = None
        if m:
            kq = self.k.q if nk == m else self.k.q.narrow(0, m)
            vq = self.v.q if nv == m else self.v.q.narrow(0, m)
            quantized = (kq, vq)
        tail = (self.k.read_from(m), self.v.read_from(m)) if len(self) > m else None
        return quantized, tail

    def staged_key_positions(self) -> torch.Tensor:
        """Positions whose keys still wait in the full-precision staging buffer."""
        return self.positions[:, self.k.num_quantized :]

    def staged_value_positions(self) -> torch.Tensor:
        """Positions whose values still wait in the full-precision staging buffer."""
        return self.positions[:, self.v.num_quantized :]

    def nbytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for stream in (self.k, self.v):
            for role, n in stream.nbytes().items():
                out[role] = out.get(role, 0) + n
        out["positions"] = self.positions.numel() * self.positions.element_size()
        return out

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.k.map_batch(fn)
        self.v.map_batch(fn)
