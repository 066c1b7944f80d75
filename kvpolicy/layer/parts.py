"""What a decode step hands fused attention: the held tokens as parts, each attended on its own.

A :class:`Part` carries its keys and values, the backend that reads them (``None``: full precision,
plain attention) and the positions of its tokens. A store answers ``parts()``
(:meth:`kvpolicy.actions.base.DemotedStore.parts`): a single-tier store gives its quantized segment, a
tiered store one segment per tier, and a staged tail a full-precision part. The fused function
(:func:`kvpolicy.fused.attend_parts`) attends over each part (``Backend.attend``, or plain attention for
full-precision parts) and merges the partial attentions by log-sum-exp; it never reads the layer.

This module imports nothing of kvpolicy's at run time, so that stores can build parts without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvpolicy.backends.base import Backend


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
    positions : torch.Tensor, optional
        ``(rows, n)`` int32: the positions of the ``n`` tokens, in the part's order (``rows``: 1, or one row
        per kv head). A store's parts give them: a transform's score term (``Basis.score_term``) is taken
        at them.
    """

    keys: Any
    values: Any
    backend: Backend | None = None
    positions: Any = None


def columns(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Columns of ``table`` ``(batch, kv_heads, w, P)`` at ``positions`` ``(1 or kv_heads, n)``: ``(batch,
    kv_heads, w, n)`` (a score term's share of one part; shared positions select from a 2-d view, one
    ``index_select`` over the last dim, several times faster on CPU than over a middle dim)."""
    idx = positions.to(device=table.device, dtype=torch.long)
    b, h, w, p = table.shape
    if idx.shape[0] == 1:
        return table.reshape(b * h * w, p).index_select(1, idx[0]).view(b, h, w, idx.shape[1])
    return table.gather(3, idx[None, :, None, :].expand(b, h, w, idx.shape[1]))
