"""What a decode step hands fused attention: the held tokens as parts, each attended on its own.

A :class:`Part` carries its keys and values, the backend that reads them (``None``: full precision,
plain attention) and the basis they are held in (``None``: the model's). A store answers
``parts()`` (:meth:`kvpolicy.actions.base.DemotedStore.parts`): a single-tier store gives its
quantized segment, a tiered store one segment per tier, and a staged tail a full-precision part. The
fused function (:func:`kvpolicy.fused.attend_parts`) attends over each part (``Backend.attend``, or
plain attention for full-precision parts) and merges the partial attentions by log-sum-exp; it never
reads the layer.

This module imports nothing of kvpolicy's at run time, so that stores can build parts without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpolicy.backends.base import Backend
    from kvpolicy.transforms.base import Transform


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
    positions : torch.Tensor, optional
        ``(rows, n)`` int32: the positions of the ``n`` tokens, in the part's order (``rows``: 1, or one row
        per kv head). The built-in stores give them; a basis that scores what each token holds beside its
        codes (``basis.scores_beside_codes``, :mod:`kvpolicy.transforms.lowrank`) finds the tokens by them.
    """

    keys: Any
    values: Any
    backend: Backend | None = None
    basis: Transform | None = None
    positions: Any = None
