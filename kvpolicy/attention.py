"""Attention scores for score-based policies (H2O) without forcing eager attention.

:func:`enable_scores` switches a model's attention implementation from ``"sdpa"`` (or
``"eager"``) to ``"kvpolicy_sdpa"`` (``"kvpolicy_eager"``): a function registered with
transformers' ``AttentionInterface`` that runs the original implementation unchanged and, when
the layer just updated belongs to a cache whose policy asks for scores, reports to it the
attention probability mass each held key received from the current queries (per kv-head, summed
over batch rows, query positions and the query heads of the group).

Which layer receives the scores is decided by identity: the attention call whose key tensor is the
one the layer's ``update`` just returned. The model's own attention (sdpa, or its own eager
function with softcapping and the like) computes the output; the scores are recomputed in float32
as ``softmax(q kᵀ · scale + mask)`` for both, so sdpa and eager select the same tokens (model-specific
extras such as logit softcapping are not applied to the scores).

Cost: one extra ``(batch, heads, queries, keys)`` matmul and softmax per layer whose policy needs
scores, and the memory of eager attention's weights for that layer while it runs. Models whose
layers do not report (any cache without a score-based policy) run exactly as before.
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


def expect_scores(layer: ScoreSink | None, keys: torch.Tensor | None = None) -> None:
    """Called by a cache layer's ``update``: the attention call that receives exactly ``keys`` (the
    tensor ``update`` returned) reports to ``layer``. Any earlier expectation is replaced."""
    _local.expected = None if layer is None else (layer, keys)


def _take_layer(key: torch.Tensor) -> ScoreSink | None:
    expected = getattr(_local, "expected", None)
    if expected is None or expected[1] is not key:
        return None
    _local.expected = None
    return expected[0]


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
    """The model's own eager attention (softcapping, sinks... included), else a plain one."""
    import inspect

    own = getattr(inspect.getmodule(type(module)), "eager_attention_forward", None)
    if own is not None:
        return own(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
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
        layer = _take_layer(key)
        if layer is not None:
            # recomputed in float32 for both implementations, so sdpa and eager select the same tokens
            probs = attention_probs(query, key, attention_mask, scale)
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
