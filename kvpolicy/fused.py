"""Fused decode attention: read the compressed history where it lies instead of rebuilding it.

:func:`enable_fused` switches a model's attention implementation from ``"sdpa"`` (``"eager"``,
or kvpolicy's score-reporting ``"kvpolicy_sdpa"``/``"kvpolicy_eager"``) to ``"kvpolicy_fused_sdpa"``
(``"kvpolicy_fused_eager"``), a function registered with transformers' ``AttentionInterface``.

On a decode step (one new token), a :class:`~kvpolicy.cache.CompressedLayer` hands its history
to attention as a :mod:`kvpolicy.handoff` pair whose ticket carries its parts
(:class:`kvpolicy.layer.parts.Part`: keys, values, the backend that reads them and their positions) and
the layer's transform (:class:`kvpolicy.transforms.base.Basis`), in whose basis the store's parts lie.
This function never reads the layer: it computes, for the queries of each kv head,

- attention over the full-precision segment plus the few stored tokens still staged
  (plain float32 matmuls over a segment bounded by the policy),
- attention over the quantized tokens from their packed codes (``Backend.attend``: the torch
  backend dequantizes group by group in float32; the triton backend reads the codes in its kernel),

and merges the two with their log-sum-exps: ``lse = logaddexp(lse_a, lse_b)``,
``out = out_a·exp(lse_a − lse) + out_b·exp(lse_b − lse)``. Softmax attention is invariant to the
order of keys, so neither the position order (``layout="ordered"``) nor a concatenation
(``"agnostic"``) of the history is built: both layouts give the same fused result.

Every other call (prefill, other caches, layers that cannot fuse) goes to kvpolicy's
score-reporting wrapper of the original implementation, which serves the hand-off (materialising
it) and runs the original implementation unchanged. When a decode step's call carries something
the fused computation does not model (a mask that hides some keys, logit softcapping, attention
sinks, a position bias, dropout in training, ``output_attentions``), the fused function declines
it: under ``CompressedCache(attention="auto")`` the step goes the same way, the layer records why
(``CompressedCache.attention_paths()``) and a warning is issued once per reason; under
``attention="fused"`` it raises a ``RuntimeError`` naming the reason and the remedy instead.

If the model's attention is anything else (``disable_fused`` mid-generation, a layer that reuses
another layer's keys and values), the hand-off materialises itself in position order on first use,
so the result is correct either way; only the path (``attention_paths()``) differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvpolicy.attention import register as register_scores
from kvpolicy.attention import register_wrappers, strip_wrapper, unwatch_forward, watch_forward
from kvpolicy.backends.base import dense_attention
from kvpolicy.errors import ConfigError
from kvpolicy.handoff import TICKET_KWARG, HandedOff, all_visible, warn_once
from kvpolicy.layer.parts import Part, columns
from kvpolicy.transforms.base import Basis, cast_clamped

PREFIX = "kvpolicy_fused_"
INNER = ("sdpa", "eager")
_SCORES_PREFIX = "kvpolicy_"


# ---------------------------------------------------------------------- the computation
def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attentions over disjoint key sets.

    Parameters
    ----------
    parts : list of (out, lse)
        ``out`` ``(..., q, dv)`` float32, ``lse`` ``(..., q)`` float32 (``-inf`` for an empty set).

    Returns
    -------
    out, lse : torch.Tensor
        The attention over the union of the key sets.
    """
    out, lse = parts[0]
    for o, m in parts[1:]:
        total = torch.logaddexp(lse, m)
        out = out * torch.exp(lse - total).nan_to_num(0.0).unsqueeze(-1) + o * torch.exp(m - total).nan_to_num(
            0.0
        ).unsqueeze(-1)
        lse = total
    return out, lse


def attend_parts(query: torch.Tensor, parts: list[Part], scale: float, basis: Basis | None = None) -> torch.Tensor:
    """Attention of decode queries over disjoint parts of a history: ``merge(attend(q, p) for p in parts)``.

    Parameters
    ----------
    query : torch.Tensor
        ``(batch, q_heads, q, head_dim)``.
    parts : list of Part
        The held tokens (:mod:`kvpolicy.layer.parts`): the store's, then the full-precision segment
        ``(batch, kv_heads, n_full, head_dim)`` in the model's basis. Without ``basis`` the full-precision
        parts are attended as one (their keys concatenated in order), each packed part on its own.
    scale : float
        Score scale.
    basis : Basis, optional
        The layer's transform (:class:`kvpolicy.transforms.base.Basis`), in whose basis the store's parts
        are held: the query is mapped into it once (``map_query``), the store's merged output mapped back
        (``unmap_output``) before the merge with the segment, and the basis' score term (``score_term``,
        per position) added to each part's scores at its tokens' positions: the history is never rebuilt
        in the model's basis.

    Returns
    -------
    torch.Tensor
        ``(batch, q_heads, q, head_dim_v)`` float32.
    """
    b, hq, nq, d = query.shape
    full = parts[-1]
    hk = full.keys.shape[1]
    q = query.reshape(b, hk, (hq // hk) * nq, d)  # the query heads of a group share their kv head
    keys, values, stored = [], [], []
    for part in parts[:-1]:
        if basis is None and part.backend is None:  # staged tokens in the model's basis join the segment
            keys.append(part.keys)
            values.append(part.values)
        else:
            stored.append(part)
    keys.append(full.keys)
    values.append(full.values)
    fk, fv = (keys[0], values[0]) if len(keys) == 1 else (torch.cat(keys, dim=2), torch.cat(values, dim=2))
    pieces = []
    if fk.shape[2]:
        pieces.append(dense_attention(q, fk, fv, scale))
    if stored:
        q_stored, term = (q, None) if basis is None else (basis.map_query(q), basis.score_term(q, scale))
        partial = []
        for part in stored:
            if term is not None and part.positions is None:
                raise ValueError(
                    f"{basis.transform!r} adds a score term at each stored token's position, and a part of the store "
                    "does not say its tokens' positions (DemotedStore.parts must give Part.positions)"
                )
            bias = None if term is None else columns(term, part.positions)
            if part.backend is None:
                partial.append(dense_attention(q_stored, part.keys, part.values, scale, bias))
            elif bias is None:
                partial.append(part.backend.attend(q_stored, part.keys, part.values, scale))
            else:
                partial.append(part.backend.attend_biased(q_stored, part.keys, part.values, scale, bias))
        out, lse = partial[0] if len(partial) == 1 else merge(partial)
        pieces.append((out if basis is None else basis.unmap_output(out), lse))
    out = pieces[0][0] if len(pieces) == 1 else merge(pieces)[0]  # merging one piece changes nothing
    return out.reshape(b, hq, nq, out.shape[-1])


@dataclass(frozen=True)
class Decline:
    """Why the fused function declines a decode step, and what a caller can do about it.

    Parameters
    ----------
    reason : str
        What in the call the fused computation does not model (recorded in ``attention_paths()``).
    remedy : str
        How to run such a step fused, or which ``attention=`` materialises it (in the error that
        ``CompressedCache(attention="fused")`` raises).
    """

    reason: str
    remedy: str


_AUTO = "or build the cache with attention='auto', which materialises the history for such steps"


def _why_not(
    module: Any, attention_mask: torch.Tensor | None, key_len: int, dropout: float, kwargs: dict
) -> Decline | None:
    """What in this call the fused computation does not model (None: nothing).

    Parameters
    ----------
    module : torch.nn.Module
        The attention module of the call (its ``training`` flag, its ``sliding_window`` if any).
    attention_mask : torch.Tensor or None
        ``(batch, 1, q, keys)`` bool or additive float, as transformers passes it.
    key_len : int
        The number of keys the hand-off stands for.
    dropout : float
        The attention dropout of the call.
    kwargs : dict
        The call's other keywords.
    """
    for name in ("softcap", "s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            return Decline(
                f"attention argument {name!r}",
                f"this model's attention passes {name!r}, which the fused computation does not apply; {_AUTO}",
            )
    if kwargs.get("output_attentions"):
        return Decline("output_attentions", f"the fused path computes no attention weights: call without them, {_AUTO}")
    if dropout and getattr(module, "training", False):
        return Decline("dropout in training", f"the fused path applies no dropout: call model.eval() first, {_AUTO}")
    if attention_mask is not None and not all_visible(attention_mask[..., :key_len]):
        window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        if window is not None:
            remedy = (
                f"this layer attends over a sliding window ({window} tokens): build the cache with "
                f"config=model.config, so that transformers' own sliding layer serves it, {_AUTO}"
            )
        else:
            remedy = f"the fused path attends over every held key (a mask with holes cannot be applied): {_AUTO}"
        return Decline("an attention mask that hides some keys", remedy)
    return None


def _inner(name: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[f"{_SCORES_PREFIX}{name}"]


def _make(inner_name: str):
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs: Any):
        # handoff.ticket_of, inlined; a step traced by torch.compile hands its ticket in the keywords
        ticket = key.ticket if isinstance(key, HandedOff) else kwargs.pop(TICKET_KWARG, None)
        if ticket is not None and ticket.fusable:
            decline = _why_not(module, attention_mask, key.shape[2], dropout, kwargs)
            if decline is None:
                scale = scaling if scaling is not None else query.shape[-1] ** -0.5
                out = attend_parts(query, ticket.parts, scale, ticket.basis)
                ticket.fused()
                # the attention of finite values stays within their range: a float32 result a rounding past
                # float16's edge is clamped, not made infinite
                if out.dtype != query.dtype:
                    out = cast_clamped(out, query.dtype)
                return out.transpose(1, 2).contiguous(), None
            if ticket.strict:
                raise RuntimeError(
                    f"CompressedCache(attention='fused'): layer {ticket.layer().layer_idx}'s decode step cannot run "
                    f"fused: {decline.reason}. To fix: {decline.remedy}."
                )
            ticket.reason = decline.reason
            warn_once(
                f"kvpolicy fused attention: {decline.reason}; this step materialised the compressed history instead "
                "(see CompressedCache.attention_paths())"
            )
        if ticket is not None and not isinstance(key, HandedOff):
            kwargs[TICKET_KWARG] = ticket
        # everything else: the score-reporting wrapper of the original implementation serves the hand-off
        return _inner(inner_name)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

    attention.__name__ = f"{PREFIX}{inner_name}"
    return attention


def register() -> None:
    """Register ``kvpolicy_fused_sdpa`` and ``kvpolicy_fused_eager`` with transformers (idempotent)."""
    register_scores()
    register_wrappers(PREFIX, INNER, _make)


def enable_fused(model: torch.nn.Module) -> None:
    """Switch ``model`` to kvpolicy's fused decode attention (idempotent).

    Outputs of every cache other than :class:`~kvpolicy.cache.CompressedCache` are unchanged (the
    original implementation runs); score-based policies still get their scores (this function
    includes :func:`kvpolicy.attention.enable_scores`). It also installs forward hooks through which a
    compressed cache applies a decode step's demotions before the forward (``CompressedCache.demote_ahead``, which
    keeps a compiled forward one graph) and demotes its last layer's prompt when the forward returns
    (``CompressedCache.release_forward``), not at the first decode step.
    """
    current = model.config._attn_implementation
    if current.startswith(PREFIX):
        watch_forward(model)
        return
    base = current[len(_SCORES_PREFIX) :] if current.startswith(_SCORES_PREFIX) else current
    if base not in INNER:
        raise ConfigError(
            f"kvpolicy's fused attention wraps attn_implementation in {list(INNER)}; the model uses {current!r}"
        )
    register()
    model.set_attn_implementation(f"{PREFIX}{base}")
    watch_forward(model)


def disable_fused(model: torch.nn.Module) -> None:
    """Undo :func:`enable_fused` (back to the original implementation). Caches in use stay correct: their
    next decode steps materialise the history (``attention_paths()`` says so)."""
    strip_wrapper(model, PREFIX, INNER)
    unwatch_forward(model)
