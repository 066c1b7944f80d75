"""Attention scores for score-based policies (H2O) without forcing eager attention.

:func:`enable_scores` switches a model's attention implementation from ``"sdpa"`` (or
``"eager"``) to ``"kvpolicy_sdpa"`` (``"kvpolicy_eager"``): a function registered with
transformers' ``AttentionInterface`` that runs the original implementation unchanged and, when
the layer just updated belongs to a cache whose policy asks for scores, reports to it the
attention probability mass each held key received from the current queries (per kv-head, summed
over batch rows, query positions and the query heads of the group).

Cost: with ``sdpa``, the probabilities are recomputed as ``softmax(q kᵀ · scale + mask)`` — one
extra ``(batch, heads, queries, keys)`` matmul and softmax per layer, the memory of eager
attention's weights for that layer, only for layers whose policy needs scores. With ``eager`` the
weights are already there and the cost is the reduction alone. Models whose layers do not report
(any cache without a score-based policy) run exactly as before.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch

from kvpolicy.errors import ConfigError

WRAPPED = ("sdpa", "eager")
PREFIX = "kvpolicy_"


class ScoreSink(Protocol):
    """What a cache layer exposes to receive scores."""

    layer_idx: int

    def observe_attention(self, scores: torch.Tensor) -> None:
        """``scores``: ``(kv_heads, keys)`` attention mass per returned key."""


_local = threading.local()


def expect_scores(layer: ScoreSink | None) -> None:
    """Called by a cache layer's ``update``: the next attention call reports to ``layer``."""
    _local.layer = layer


def _take_layer(layer_idx: int | None) -> ScoreSink | None:
    layer = getattr(_local, "layer", None)
    if layer is None or (layer_idx is not None and layer.layer_idx != layer_idx):
        return None
    _local.layer = None
    return layer


def attention_probs(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """Softmax attention probabilities ``(batch, q_heads, q_len, k_len)`` in float32.

    ``key`` is ``(batch, kv_heads, k_len, head_dim)`` (GQA groups are expanded here). A missing
    mask means causal attention with the queries at the end of the keys (sdpa's convention).
    """
    hq, q_len = query.shape[1], query.shape[2]
    hk, k_len = key.shape[1], key.shape[2]
    k = key.repeat_interleave(hq // hk, dim=1) if hq != hk else key
    scores = torch.matmul(query.float(), k.float().transpose(-1, -2)) * scaling
    if attention_mask is None:
        if q_len > 1:
            qi = torch.arange(q_len, device=query.device)[:, None] + (k_len - q_len)
            ki = torch.arange(k_len, device=query.device)[None, :]
            scores = scores.masked_fill(ki > qi, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask[..., :k_len], float("-inf"))
    else:
        scores = scores + attention_mask[..., :k_len].float()
    return torch.softmax(scores, dim=-1)


def _eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Plain eager attention (as in transformers' Llama), returning the weights."""
    probs = attention_probs(query, key, attention_mask, scaling).to(query.dtype)
    hq, hk = query.shape[1], value.shape[1]
    v = value.repeat_interleave(hq // hk, dim=1) if hq != hk else value
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, v).transpose(1, 2).contiguous()
    return out, probs


def _wrap(inner_name: str):
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs: Any):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if inner_name == "eager":
            out, weights = _eager(module, query, key, value, attention_mask, scale, dropout, **kwargs)
        else:
            inner = ALL_ATTENTION_FUNCTIONS[inner_name]
            out, weights = inner(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        layer = _take_layer(getattr(module, "layer_idx", None))
        if layer is not None:
            probs = weights if weights is not None else attention_probs(query, key, attention_mask, scale)
            b, hq, q_len, k_len = probs.shape
            hk = key.shape[1]
            mass = probs.float().reshape(b, hk, hq // hk, q_len, k_len).sum(dim=(0, 2, 3))
            layer.observe_attention(mass)
        return out, weights

    attention.__name__ = f"{PREFIX}{inner_name}"
    return attention


_registered = False


def register() -> None:
    """Register ``kvpolicy_sdpa`` and ``kvpolicy_eager`` with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    for name in WRAPPED:
        AttentionInterface.register(f"{PREFIX}{name}", _wrap(name))
        AttentionMaskInterface.register(f"{PREFIX}{name}", ALL_MASK_ATTENTION_FUNCTIONS[name])
    _registered = True


def enable_scores(model: torch.nn.Module) -> None:
    """Switch ``model`` to the score-reporting wrapper of its current attention implementation.

    Outputs are unchanged; layers of a cache whose policy needs scores (H2O) then receive them.
    """
    current = model.config._attn_implementation
    if current.startswith(PREFIX):
        return
    if current not in WRAPPED:
        raise ConfigError(
            f"kvpolicy can report attention scores for attn_implementation in {list(WRAPPED)}; "
            f"the model uses {current!r}"
        )
    register()
    model.set_attn_implementation(f"{PREFIX}{current}")


def disable_scores(model: torch.nn.Module) -> None:
    """Undo :func:`enable_scores`."""
    current = model.config._attn_implementation
    if current.startswith(PREFIX):
        model.set_attn_implementation(current[len(PREFIX) :])
