"""Attention scores for score-based policies (H2O) without forcing eager attention.

:func:`enable_scores` switches a model's attention implementation from ``"sdpa"`` (or
``"eager"``) to ``"kvpolicy_sdpa"`` (``"kvpolicy_eager"``): a function registered with
transformers' ``AttentionInterface`` that runs the original implementation unchanged and, when
the layer just updated belongs to a cache whose policy asks for scores, reports to it the
attention probability mass each held key received from the current queries (per kv-head, summed
over batch rows, query positions and the query heads of the group). A policy that sets
``score_queries = k`` (SnapKV's observation window) gets the mass from the last ``k`` query
positions of each forward only; the others are not even computed.

Which layer receives the scores is decided by the hand-off (:mod:`kvpolicy.handoff`): the keys a
compressed layer's ``update`` returned carry a ticket naming the layer. The model's own attention
(sdpa, or its own eager function with softcapping and the like) computes the output; the scores
are recomputed in float32 as ``softmax(q kᵀ · scale + mask)`` for both, so sdpa and eager select
the same tokens (model-specific extras such as logit softcapping are not applied to the scores).

Under tensor parallelism (``from_pretrained(..., tp_plan="auto")``) each rank scores only its own
heads, which is all a per-head policy (H2O, SnapKV) needs. For a policy that shares one selection
across heads (``per_head = False``), the scores of every head are gathered on every rank first
(:func:`kvpolicy.distributed.gather_heads`: one all-gather of ``(batch, kv_heads, keys)`` floats per
layer and forward), so every rank selects what a single process would.

Cost: one extra ``(batch, heads, queries, keys)`` matmul and softmax per layer whose policy needs
scores, and the memory of eager attention's weights for that layer while it runs. Models whose
layers do not report (any cache without a score-based policy) run exactly as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvpolicy.distributed import gather_heads
from kvpolicy.errors import ConfigError
from kvpolicy.handoff import TICKET_KWARG, ticket_of

WRAPPED = ("sdpa", "eager")
PREFIX = "kvpolicy_"


def with_key_mask(
    attention_mask: torch.Tensor | None, key_mask: torch.Tensor, q_len: int, dtype: torch.dtype
) -> torch.Tensor:
    """Combine transformers' mask (``None``: causal, bool, or additive float) with a ``(batch, keys)``
    key mask into a mask of the same kind (bool when there was none)."""
    k_len = key_mask.shape[1]
    keep = key_mask[:, None, None, :]
    if attention_mask is None:
        qi = torch.arange(q_len, device=key_mask.device)[:, None] + (k_len - q_len)
        causal = torch.arange(k_len, device=key_mask.device)[None, :] <= qi
        return causal[None, None] & keep
    if attention_mask.dtype == torch.bool:
        return attention_mask[..., :k_len] & keep
    blocked = torch.zeros_like(keep, dtype=attention_mask.dtype).masked_fill(~keep, torch.finfo(dtype).min)
    return attention_mask[..., :k_len] + blocked


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
        return torch.softmax(scores, dim=-1)
    if attention_mask.dtype == torch.bool:
        allowed = attention_mask[..., :k_len]
        scores = scores.masked_fill(~allowed, float("-inf"))
    else:
        mask = attention_mask[..., :k_len]
        allowed = mask > torch.finfo(mask.dtype).min / 2
        scores = scores + mask.float()
    probs = torch.softmax(scores, dim=-1)
    # a query that may see no key (a pad's own query in a padded batch) gives no attention to anyone
    return probs.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0).nan_to_num(0.0)


def _scored_queries(
    policy: Any, query: torch.Tensor, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The query rows whose attention is reported: the last ``policy.score_queries`` of them
    when the policy sets it (SnapKV's observation window), else all (the mask is cut to match)."""
    keep = getattr(policy, "score_queries", None)
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ConfigError(f"policy {policy!r}: score_queries must be None or an integer >= 1; got {keep!r}")
    if keep is None or keep >= query.shape[2]:
        return query, attention_mask
    query = query[:, :, query.shape[2] - keep :]
    if attention_mask is not None and attention_mask.shape[-2] > 1:  # a mask with one row broadcasts
        attention_mask = attention_mask[..., attention_mask.shape[-2] - keep :, :]
    return query, attention_mask


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
        ticket = ticket_of(key)
        if ticket is None:  # a step traced by torch.compile hands its ticket in the keywords
            ticket = kwargs.pop(TICKET_KWARG, None)
        if ticket is not None:
            key, value, layout = ticket.materialize(attention_mask, query.shape[2], kwargs)
            if ticket.key_mask is not None:
                attention_mask = with_key_mask(attention_mask, ticket.key_mask, query.shape[2], query.dtype)
        if inner_name == "eager":
            out, weights = _eager(module, query, key, value, attention_mask, scale, dropout, **kwargs)
        else:
            inner = ALL_ATTENTION_FUNCTIONS[inner_name]
            out, weights = inner(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        if ticket is not None and ticket.wants_report and not ticket.reported:  # once, not per shared-KV consumer
            mass = None
            if ticket.scores:
                # recomputed in float32 for both implementations, so sdpa and eager select the same tokens
                q_rows, mask_rows = _scored_queries(ticket.layer().policy, query, attention_mask)
                probs = attention_probs(q_rows, key, mask_rows, scale)
                b, hq, q_len, k_len = probs.shape
                hk = key.shape[1]
                mass = probs.reshape(b, hk, hq // hk, q_len, k_len).sum(dim=(2, 3))
                if not ticket.layer().policy.per_head:
                    # one selection shared by every head: under tensor parallelism this rank holds only
                    # some heads, so every rank gets every head's scores (kvpolicy.distributed)
                    mass = gather_heads(mass, module)
            ticket.report(mass, layout, (query, key))
        return out, weights

    attention.__name__ = f"{PREFIX}{inner_name}"
    return attention


_registered: set[str] = set()  # prefixes whose implementations are registered


def register_wrappers(prefix: str, names: tuple[str, ...], make: Callable[[str], Callable]) -> None:
    """Register ``make(name)`` with transformers as attention implementation ``prefix + name``, for each
    of ``names``, with the mask function of ``name`` (idempotent per ``prefix``)."""
    if prefix in _registered:
        return
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    for name in names:
        AttentionInterface.register(f"{prefix}{name}", make(name))
        AttentionMaskInterface.register(f"{prefix}{name}", ALL_MASK_ATTENTION_FUNCTIONS[name])
    _registered.add(prefix)


def strip_wrapper(model: torch.nn.Module, prefix: str, names: tuple[str, ...]) -> None:
    """Switch ``model`` from attention implementation ``prefix + name`` back to ``name``, for ``name`` in
    ``names``; leave any other implementation alone (``kvpolicy_fused_sdpa`` also starts with
    ``kvpolicy_``, and is not the score wrapper)."""
    current = model.config._attn_implementation
    if current.startswith(prefix) and current[len(prefix) :] in names:
        model.set_attn_implementation(current[len(prefix) :])


#: the attribute of a model that holds the handle of its :func:`watch_forward` hooks
HOOK_ATTR = "_kvpolicy_release_hook"


def _cache_of(kwargs: dict, output: Any = None) -> Any:
    """The cache a forward was called with (``cache=``, or the deprecated ``past_key_values=``), else the one its
    output carries."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return getattr(output, "past_key_values", None) if cache is None else cache


def _new_tokens(args: tuple, kwargs: dict) -> int | None:
    """The tokens a forward appends: the length of its ``input_ids`` ``(batch, n)`` or ``inputs_embeds``
    ``(batch, n, hidden)`` (``None``: neither given)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(ids, torch.Tensor) and ids.dim() == 2:
        return ids.shape[1]
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor) and embeds.dim() == 3:
        return embeds.shape[1]
    return None


def _note_mask_before_forward(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: the cache this forward updates is told the forward's 2-D attention mask
    (``CompressedCache.note_attention_mask``), from which its compressed layers read which columns are padding,
    and applies ahead of the forward the demotions a decode step would apply in it
    (``CompressedCache.demote_ahead``)."""
    cache = _cache_of(kwargs)
    note = getattr(cache, "note_attention_mask", None)
    if callable(note):
        mask = kwargs.get("attention_mask")
        note(mask if isinstance(mask, torch.Tensor) else None)
    ahead = getattr(cache, "demote_ahead", None)
    n = _new_tokens(args, kwargs)
    if callable(ahead) and n is not None:
        ahead(n)


def _release_after_forward(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    """Forward hook: the cache this forward updated may demote what its layers' attention has read
    (``CompressedCache.release_forward``, which also forgets the forward's attention mask), and checks that it
    was built for this model (``CompressedCache.check_model_config``: a warning, once, when it was not); any
    other cache, or none, is left alone."""
    cache = _cache_of(kwargs, output)
    release = getattr(cache, "release_forward", None)
    if callable(release):
        release()
    check = getattr(cache, "check_model_config", None)
    if callable(check):
        check(getattr(module, "config", None), type(module).__name__)


class _Hooks:
    """The handles of :func:`watch_forward`'s two hooks, removed together."""

    def __init__(self, *handles: Any) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def watch_forward(model: torch.nn.Module) -> None:
    """Install (once) the forward hooks through which a :class:`~kvpolicy.cache.CompressedCache` reads each
    forward's attention mask (padding) before it runs, and demotes its last layer's prompt when it returns
    rather than at the first decode step."""
    if getattr(model, HOOK_ATTR, None) is None:
        before = model.register_forward_pre_hook(_note_mask_before_forward, with_kwargs=True)
        after = model.register_forward_hook(_release_after_forward, with_kwargs=True)
        setattr(model, HOOK_ATTR, _Hooks(before, after))


def unwatch_forward(model: torch.nn.Module) -> None:
    """Remove :func:`watch_forward`'s hook once ``model`` runs none of kvpolicy's implementations."""
    handle = getattr(model, HOOK_ATTR, None)
    if handle is not None and not model.config._attn_implementation.startswith(PREFIX):
        handle.remove()
        setattr(model, HOOK_ATTR, None)


def register() -> None:
    """Register ``kvpolicy_sdpa`` and ``kvpolicy_eager`` with transformers (idempotent)."""
    register_wrappers(PREFIX, WRAPPED, _wrap)


def enable_scores(model: torch.nn.Module) -> None:
    """Switch ``model`` to the score-reporting wrapper of its current attention implementation.

    Outputs are unchanged; layers of a cache whose policy needs scores (H2O) then receive them.
    """
    current = model.config._attn_implementation
    if current.startswith(PREFIX):
        watch_forward(model)
        return
    if current not in WRAPPED:
        raise ConfigError(
            f"kvpolicy can report attention scores for attn_implementation in {list(WRAPPED)}; "
            f"the model uses {current!r}"
        )
    register()
    model.set_attn_implementation(f"{PREFIX}{current}")
    watch_forward(model)


def disable_scores(model: torch.nn.Module) -> None:
    """Undo :func:`enable_scores`. A model switched to fused attention (which includes the scores) is
    left as it is: :func:`kvpolicy.fused.disable_fused` undoes that."""
    strip_wrapper(model, PREFIX, WRAPPED)
    unwatch_forward(model)
