"""What a decode step hands fused attention: the held tokens as parts, each attended on its own.

A :class:`Part` carries its keys and values, the backend that reads them (``None``: full precision,
plain attention) and the basis they are held in (``None``: the model's). The fused function
(:func:`kvpolicy.fused.attend_parts`) attends over each part (``Backend.attend``, or plain attention
for full-precision parts) and merges the partial attentions by log-sum-exp; it never reads the layer.

:func:`store_parts` is the one adapter from a store's public ``attention_parts()`` and ``basis`` to
parts: a single-tier store gives its quantized segment, a tiered store one segment per tier, and a
staged tail a full-precision part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpolicy.backends.base import Backend
from kvpolicy.transforms import Transform


@dataclass(frozen=True, slots=True)
class Part:
    """One set of held tokens, read by one attention.

    Parameters
    ----------
    keys, values : torch.Tensor or QTensor
        ``(batch, kv_heads, n, head_dim)`` full-precision tensors (``backend`` None) or the backend's
        packed blocks of ``n`` tokens.
    backend : Backend, optional
        Reads packed blocks (``Backend.attend``); ``None``: the tensors are at full precision.
    basis : Transform, optional
        The transform the tokens are held in (:mod:`kvpolicy.transforms`); ``None``: the model's basis.
    """

    keys: Any
    values: Any
    backend: Backend | None = None
    basis: Transform | None = None


def store_parts(split: tuple[Any, Any], basis: Transform | None, backend: Backend) -> list[Part]:
    """The parts of a store's tokens: the one adapter from ``store.attention_parts()`` (``split``) and
    ``store.basis`` to parts.

    Parameters
    ----------
    split : (quantized, tail)
        ``attention_parts()``: ``(QTensor, QTensor)``, a list of such pairs (one per tier) or None, and
        the staged tail's full-precision ``(keys, values)`` ``(batch, kv_heads, n, head_dim)`` or None.
    basis : Transform or None
        The basis the store holds its tokens in (``store.basis``).
    backend : Backend
        Reads the quantized segments.

    Returns
    -------
    list of Part
        The staged tail (full precision) first, then each quantized segment.
    """
    quantized, tail = split
    parts = [] if tail is None else [Part(tail[0], tail[1], None, basis)]
    if quantized is not None:
        for keys, values in quantized if isinstance(quantized, list) else (quantized,):
            parts.append(Part(keys, values, backend, basis))
    return parts
