"""Tensor parallelism: what kvpolicy needs to know when transformers shards a model's heads.

Under ``AutoModelForCausalLM.from_pretrained(..., tp_plan="auto")`` (or
``distributed_config=DistributedConfig(tp_size=...)``) launched with ``torchrun --nproc_per_node N``,
transformers splits the key/value projections column-wise: rank ``r`` computes kv heads
``[r * h, (r + 1) * h)`` with ``h = num_key_value_heads / N`` (and the query heads of their GQA
groups), and a :class:`~kvpolicy.cache.CompressedCache` on that rank only ever sees those ``h`` heads.
Everything kvpolicy does is either per head (quantization groups never span heads, transforms act on
one head's channels and are seeded identically on every rank, per-head policies score and select
each head from its own queries) or data-independent (log, recent, sink), so each rank holds exactly
the single-process cache restricted to its heads, with nothing to communicate.

Two things need help, and live here:

- a head count the TP size does not divide: transformers loads such a model, then its attention
  fails on the first forward, before any cache is reached, with a reshape error (``shape '[1, 20,
  -1, 16]' is invalid for input of size 480``). :func:`check_config` / :func:`check_model` raise a
  :class:`~kvpolicy.errors.ConfigError` naming ``num_key_value_heads`` and the TP size instead;
  ``CompressedCache(config=model.config)`` runs it when the cache is built;
- a policy that shares one selection across heads and needs attention scores (``per_head = False``,
  ``needs_scores = True``: none is built in; a plugin may define one): each rank scores only its own
  heads, so the ranks would select differently. :func:`gather_heads` gives every rank the scores of
  every kv head, in the single-process order, before the policy sees them; kvpolicy's
  score-reporting attention (:mod:`kvpolicy.attention`) calls it.

Nothing here imports transformers; ``torch.distributed`` is touched only when it is initialised.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from kvpolicy.errors import ConfigError

#: tensor-parallel styles (transformers' ``tp_plan`` values) that split a projection's output
#: features across ranks, so that each rank holds a slice of the heads
SHARDING_STYLES = ("colwise", "packed_colwise")
#: names of the projections whose output holds the keys (separate or fused)
KEY_PROJECTIONS = ("k_proj", "qkv_proj", "query_key_value")


# ---------------------------------------------------------------------- head counts
def tp_size_of(config: Any) -> int:
    """The tensor-parallel size a model was loaded with, from its config (1: not sharded).

    transformers stores the ``DistributedConfig`` of ``from_pretrained(tp_plan=..., tp_size=...)`` on
    the loaded model's config as ``config.distributed_config``.
    """
    distributed = getattr(config, "distributed_config", None)
    size = getattr(distributed, "tp_size", None)
    return int(size) if isinstance(size, int) and size > 1 else 1


def shards_kv_heads(plan: dict[str, str] | None) -> bool:
    """Whether a ``tp_plan`` splits the key projection's output (the kv heads) across ranks.

    ``None`` (plan unknown) counts as splitting them: every attention plan transformers ships does.
    """
    if plan is None:
        return True
    return any(key.rsplit(".", 1)[-1] in KEY_PROJECTIONS and style in SHARDING_STYLES for key, style in plan.items())


def kv_heads_of(config: Any) -> int | None:
    """``num_key_value_heads`` of a model config (its text config for multimodal ones; falls back
    to ``num_attention_heads`` as transformers does); ``None`` when the config has neither."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_key_value_heads", None)
    if heads is None:
        heads = getattr(text, "num_attention_heads", None)
    return heads if isinstance(heads, int) else None


def check_kv_heads(num_key_value_heads: int, tp_size: int) -> None:
    """Raise :class:`~kvpolicy.errors.ConfigError` unless ``tp_size`` divides ``num_key_value_heads``.

    Parameters
    ----------
    num_key_value_heads : int
        The model's kv heads (all ranks together).
    tp_size : int
        Ranks the heads are split over (the ``torchrun`` world size for plain tensor parallelism).
    """
    if tp_size <= 1 or num_key_value_heads % tp_size == 0:
        return
    sizes = [n for n in range(1, num_key_value_heads + 1) if num_key_value_heads % n == 0]
    raise ConfigError(
        f"tensor parallelism: num_key_value_heads={num_key_value_heads} is not divisible by the tensor-parallel "
        f"size tp_size={tp_size} (the torchrun world size with tp_plan='auto'). Each rank must hold whole kv "
        f"heads: a CompressedCache quantizes and selects per head, and transformers would split a head between "
        f"two ranks (its attention then fails on the first forward with a reshape error such as \"shape '[1, n, "
        f"-1, head_dim]' is invalid\"). Use a tensor-parallel size that divides {num_key_value_heads}: {sizes}"
    )


def check_config(config: Any, plan: dict[str, str] | None = None) -> None:
    """:func:`check_kv_heads` for a loaded model's config (nothing to check when it is not sharded).

    Parameters
    ----------
    config : transformers.PretrainedConfig
        ``model.config`` of a model loaded with ``tp_plan``; its ``distributed_config`` gives the TP size.
    plan : dict, optional
        The model's resolved ``tp_plan`` (``model.tp_plan``); default: the plan the distributed config
        names when it is a dict, else the config's ``base_model_tp_plan``.
    """
    tp_size = tp_size_of(config)
    if tp_size == 1:
        return
    if plan is None:
        given = getattr(getattr(config, "distributed_config", None), "tp_plan", None)
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        plan = given if isinstance(given, dict) else getattr(text, "base_model_tp_plan", None)
    heads = kv_heads_of(config)
    if heads is not None and shards_kv_heads(plan):
        check_kv_heads(heads, tp_size)


def check_model(model: torch.nn.Module) -> None:
    """:func:`check_config` for a loaded model (``model.config``, ``model.tp_size``, ``model.tp_plan``)."""
    config = model.config
    size = getattr(model, "tp_size", None)
    if isinstance(size, int) and size > 1 and tp_size_of(config) == 1:
        heads = kv_heads_of(config)
        if heads is not None and shards_kv_heads(getattr(model, "tp_plan", None)):
            check_kv_heads(heads, size)
        return
    check_config(config, getattr(model, "tp_plan", None))


# ---------------------------------------------------------------------- where a saved cache was held
def placement(config: Any = None) -> dict[str, int | None]:
    """Which share of a model this process holds, as a saved cache records it.

    ``rank`` and ``world_size`` are ``torch.distributed``'s (0 and 1 when it is not initialised);
    ``tp_size`` is the tensor-parallel size of ``config`` (a model or its config), ``None`` when no
    model is known.
    """
    ready = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if ready else (0, 1)
    config = getattr(config, "config", config)
    return {"rank": rank, "world_size": world, "tp_size": tp_size_of(config) if config is not None else None}


def check_placement(saved: Any, here: dict[str, int | None]) -> None:
    """Refuse a cache saved by another share of a model than this process holds (``ValueError``).

    A cache saved under tensor parallelism holds its rank's heads only: it is refused on another
    rank, under another world size or TP size, and outside ``torchrun``. A file that records no TP
    size (saved without ``model=`` or ``config=``) by a process of several ranks is refused on another
    rank too, as its heads may be a share. ``saved`` is ``None`` for files written before placements
    were recorded (nothing to compare).
    """
    if saved is None:
        return
    from kvpolicy import state_check

    state_check.entries(saved, "distributed", ("rank", "world_size", "tp_size"))
    world = state_check.integer(saved["world_size"], "distributed world_size", 1)
    rank = state_check.integer(saved["rank"], "distributed rank", 0, world - 1)
    tp = None if saved["tp_size"] is None else state_check.integer(saved["tp_size"], "distributed tp_size", 1, world)
    sharded = (tp is None and world > 1) or (tp is not None and tp > 1)
    if sharded and (rank, world) != (here["rank"], here["world_size"]):
        share = f"tensor-parallel size {tp}" if tp is not None else "no recorded TP size"
        raise ValueError(
            f"the cache was saved by rank {rank} of {world} ({share}): its kv heads are that rank's share, and this "
            f"process is rank {here['rank']} of {here['world_size']}. Load each rank's own file on that rank"
        )
    if here["tp_size"] is not None and tp is not None and here["tp_size"] != tp:
        raise ValueError(
            f"the cache was saved under tensor-parallel size {tp}; the model given runs under {here['tp_size']}"
        )


# ---------------------------------------------------------------------- the TP group of a layer
_groups: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, int] | None] = weakref.WeakKeyDictionary()


def head_group(module: torch.nn.Module, local_heads: int) -> tuple[Any, int] | None:
    """The process group an attention module's kv heads are split over, and its size.

    Parameters
    ----------
    module : torch.nn.Module
        The attention module transformers passes to an attention function (``self`` of
        ``LlamaAttention.forward``...).
    local_heads : int
        kv heads of the keys this rank's attention received.

    Returns
    -------
    (group, size) or None
        ``None`` when the heads are not split: ``torch.distributed`` not initialised, no sharded
        (DTensor) parameter in the module, or the rank already holds every head of the model's config.
        Found once per module.

    Raises
    ------
    ConfigError
        If the module's parameters are sharded but ``local_heads`` times the group size is not the
        model's head count (a plan kvpolicy does not understand).
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    if module in _groups:
        return _groups[module]
    found = _find_group(module, local_heads)
    _groups[module] = found
    return found


def _find_group(module: torch.nn.Module, local_heads: int) -> tuple[Any, int] | None:
    from torch.distributed.tensor import DTensor

    total = kv_heads_of(getattr(module, "config", None))
    if total is not None and total == local_heads:
        return None  # every head is here (an unsharded attention, or a plan that gathers its output)
    for param in module.parameters():
        if not isinstance(param, DTensor):
            continue
        for dim, placement in enumerate(param.placements):
            if placement.is_shard():
                group, size = param.device_mesh.get_group(dim), param.device_mesh.size(dim)
                if total is not None and local_heads * size != total:
                    raise ConfigError(
                        f"tensor parallelism: this rank's attention received {local_heads} kv head(s), but the "
                        f"model has num_key_value_heads={total} split over a tensor-parallel group of {size}; "
                        f"kvpolicy supports plans that give every rank num_key_value_heads / tp_size whole heads"
                    )
                return group, size
    return None


def gather_heads(scores: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """Every kv head's scores on every rank (a no-op when the heads are not split).

    Collective: every rank of the group must call it, with the same shape (a shared policy holds the
    same positions on every rank, so it does). The result is what a single-process run computes, up
    to the float noise of the model's own tensor-parallel reductions.

    Parameters
    ----------
    scores : torch.Tensor
        ``(batch, local_heads, keys)``: this rank's heads.
    module : torch.nn.Module
        The attention module that produced them (see :func:`head_group`).

    Returns
    -------
    torch.Tensor
        ``(batch, local_heads * tp_size, keys)``: the heads of rank 0, then rank 1, ... (transformers'
        column-wise split gives rank ``r`` heads ``[r * local_heads, (r + 1) * local_heads)``).
    """
    found = head_group(module, scores.shape[1])
    if found is None:
        return scores
    group, size = found
    local = scores.contiguous()
    parts = [torch.empty_like(local) for _ in range(size)]
    torch.distributed.all_gather(parts, local, group=group)
    return torch.cat(parts, dim=1)
