"""Whether kvpolicy can compress a model's cache: what :meth:`CompressedCache.for_model` checks first.

A model qualifies when it has a transformers config whose text decoder declares at least one
full-attention layer, and every other layer type is one transformers has a cache layer for (those
layers stay transformers' own). The checks read the config only: no forward runs.
"""

from __future__ import annotations

from typing import Any

from kvpolicy.errors import ConfigError


def check_model(model: Any, compresses: bool = True) -> Any:
    """``model.config`` after checking that kvpolicy can compress the model's cache.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model (any object with a transformers ``config``).
    compresses : bool
        The cache's action compresses. ``False`` (``action="none"``): a model without a full-attention layer
        is served too (every layer is transformers' own, the cache holds what ``DynamicCache`` holds).

    Returns
    -------
    transformers.PretrainedConfig
        The model's config.

    Raises
    ------
    ConfigError
        Naming the model class: no transformers config, no full-attention layer (when ``compresses``), or a
        layer type without a transformers cache layer.
    """
    from transformers import PretrainedConfig
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, get_layer_types_and_kwargs

    name = type(model).__name__
    config = getattr(model, "config", None)
    if not isinstance(config, PretrainedConfig):
        raise ConfigError(
            f"for_model: a {name} has no transformers config (model.config); pass a transformers model, or build "
            "CompressedCache(...) directly"
        )
    text = config.get_text_config(decoder=True)
    if not isinstance(getattr(text, "num_hidden_layers", None), int):
        raise ConfigError(f"for_model: the config of {name} declares no num_hidden_layers, so no attention layers")
    try:
        kinds, _ = get_layer_types_and_kwargs(text)
    except (AttributeError, TypeError, ValueError) as exc:
        raise ConfigError(f"for_model: cannot read the layer types of {name}'s config: {exc}") from None
    unknown = sorted({k for k in kinds if k not in DYNAMIC_LAYER_TYPE_MAPPING and k != "dummy"})
    if unknown:
        raise ConfigError(
            f"for_model: {name} has layers of type(s) {unknown}, for which transformers has no cache layer; kvpolicy "
            f"compresses 'full_attention' layers and leaves {sorted(DYNAMIC_LAYER_TYPE_MAPPING)} to transformers"
        )
    if compresses and "full_attention" not in kinds:
        raise ConfigError(
            f"for_model: {name} has no full-attention layer (layer types: {sorted(set(kinds))}); kvpolicy compresses "
            "full-attention layers only, so it has nothing to compress in its cache. Use transformers' DynamicCache, "
            "or action='none' for a CompressedCache that holds the same"
        )
    return config


def head_dim(config: Any) -> int | None:
    """The attention head dim a config declares: ``head_dim``, else hidden size over attention heads
    (of its text decoder config); None without a config, or when it declares neither."""
    if config is None:
        return None
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    dim = getattr(text, "head_dim", None)
    if isinstance(dim, int) and not isinstance(dim, bool) and dim > 0:
        return dim
    hidden, heads = getattr(text, "hidden_size", None), getattr(text, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads == 0:
        return hidden // heads
    return None
