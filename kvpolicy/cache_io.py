"""Saving and loading a :class:`~kvpolicy.cache.CompressedCache` (``cache.save`` / ``CompressedCache.load``).

What a file holds (the format itself is :mod:`kvpolicy.persist`):

- ``composition``: each part's registered name and dataclass parameters, the layout, the
  attention mode and whether the backend was chosen by ``"auto"``. Loading builds the parts from
  the registry, so a plugin part loads wherever its plugin is installed (and is refused with the
  registered names where it is not);
- ``model``: the identity of the model the cache was filled by (architecture when known, layer
  count, kv heads, key and value head dims, dtype, batch);
- ``layer_types`` / ``layer_kwargs``: a hybrid model's layer layout (``config=``), so its sliding
  layers come back as transformers' own;
- one entry per layer: its tensors and counts, the policy's state (``PolicyState.state_dict``) and
  the action's store (``DemotedStore.state_dict``, quantized blocks by ``Backend.block_state``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kvpolicy import persist, registry
from kvpolicy.distributed import kv_heads_of
from kvpolicy.errors import CacheFileError, ConfigError

_KINDS = {"policy": "policies", "action": "actions", "backend": "backends", "transform": "transforms"}


def _bases() -> dict[str, type]:
    from kvpolicy.actions.base import Action
    from kvpolicy.backends.base import Backend
    from kvpolicy.policies.base import Policy
    from kvpolicy.transforms.base import Transform

    return {"policy": Policy, "action": Action, "backend": Backend, "transform": Transform}


_BASES = _bases()


def save(cache: Any, path: str | Path, model: Any = None) -> int:
    """See :meth:`kvpolicy.CompressedCache.save`."""
    layers = [_layer_state(layer, i) for i, layer in enumerate(cache.layers)]
    header = {
        "composition": composition(cache),
        "model": identity(cache, model if model is not None else cache._config),
        "layer_types": cache._layer_types,
        "layer_kwargs": cache._layer_kwargs if cache._layer_types is not None else None,
    }
    return persist.write(path, header, {"layers": layers})


def composition(cache: Any) -> dict[str, Any]:
    """The parts of ``cache`` by registered name and parameters, and its other settings."""
    parts = {role: _part(getattr(cache, role), role) for role in _KINDS}
    widths = {str(i): list(pair) for i, pair in sorted(cache.layer_bits.items())}
    out = {**parts, "backend_auto": cache._auto, "layout": cache.layout, "attention": cache.attention}
    return {**out, "layer_bits": widths} if widths else out


def _part(obj: Any, role: str) -> dict[str, Any]:
    """``{"name", "params"}`` of a part. A parameter that is itself a part (the policy a
    :class:`~kvpolicy.policies.Sinks` wraps, the tiers and keep policies of
    :class:`~kvpolicy.actions.tiered.Tiered`), or a list of them, is nested as ``{"part": {"role", "name",
    "params"}}``."""
    params = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else {}
    return {"name": obj.name, "params": {key: _encode(value, role, obj, key) for key, value in params.items()}}


def _encode(value: Any, role: str, owner: Any, key: str) -> Any:
    for kind, base in _BASES.items():
        if isinstance(value, base):
            return {"part": {"role": kind, **_part(value, kind)}}
    if isinstance(value, (list, tuple)):
        return [_encode(v, role, owner, key) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{role} {owner.name!r}: parameter {key}={value!r} is not a JSON value; it cannot be saved")


def _decode(value: Any, role: str, where: str) -> Any:
    if isinstance(value, dict) and "part" in value:
        spec = value["part"]
        return _rebuild(spec, spec.get("role", role), where)
    if isinstance(value, list):
        return [_decode(v, role, where) for v in value]
    return value


def _rebuild(spec: dict[str, Any], role: str, where: str) -> Any:
    """The part :func:`_part` described (nested parts first)."""
    kind = _KINDS[role]
    params = {key: _decode(value, role, where) for key, value in spec["params"].items()}
    try:
        cls = registry.get(kind, spec["name"])
    except ConfigError as exc:
        msg = f"{where!r} was saved with {role} {spec['name']!r}, which is not installed: {exc}"
        raise CacheFileError(msg) from None
    return cls(**params)


def identity(cache: Any, model: Any = None) -> dict[str, Any]:
    """What the cache's tensors say about the model (and its architecture, when ``model`` is given)."""
    out: dict[str, Any] = {"architecture": None, "layers": len(cache.layers)}
    if model is not None:
        out["architecture"] = _model_identity(model)["architecture"]
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if layer.is_initialized and isinstance(keys, torch.Tensor) and keys.dim() == 4:
            out.update(
                kv_heads=keys.shape[1], head_dim=keys.shape[-1], value_head_dim=values.shape[-1],
                dtype=persist.dtype_name(keys.dtype), batch=keys.shape[0],
            )  # fmt: skip
            break
    return out


def _model_identity(model: Any) -> dict[str, Any]:
    """Architecture, layer count, kv heads, head dim and dtype of a model (or of a config)."""
    config = getattr(model, "config", model)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    archs = getattr(config, "architectures", None) or []
    arch = archs[0] if archs else (type(model).__name__ if model is not config else None)
    dtype = getattr(model, "dtype", None) if model is not config else None
    return {
        "architecture": arch,
        "layers": getattr(text, "num_hidden_layers", None),
        "kv_heads": kv_heads_of(config),
        "head_dim": head_dim,
        "dtype": persist.dtype_name(dtype) if isinstance(dtype, torch.dtype) else None,
    }


def _layer_state(layer: Any, idx: int) -> dict[str, Any]:
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    from kvpolicy.cache import CompressedLayer

    if isinstance(layer, CompressedLayer):
        return layer.state_dict()
    if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
        raise NotImplementedError(f"layer {idx} is a {type(layer).__name__}, which CompressedCache.save cannot save")
    if not layer.is_initialized:
        return {"kind": "transformers", "initialized": False}
    out = {"kind": "transformers", "initialized": True, "keys": layer.keys, "values": layer.values}
    if isinstance(layer, DynamicSlidingWindowLayer):
        out["cumulative_length"] = int(layer.cumulative_length)
    return out


def load(cls: type, path: str | Path, device: Any = None, model: Any = None) -> Any:
    """See :meth:`kvpolicy.CompressedCache.load`."""
    per_layer = isinstance(device, Mapping)
    header, tree = persist.read(path, None if per_layer else device)
    where = str(path)
    try:
        cache = _build(cls, header, where)
        if model is not None:
            _check_model(header.get("model") or {}, _model_identity(model), where)
        layers = tree["layers"]
        if per_layer:
            missing = [i for i in range(len(layers)) if i not in device]
            if missing:
                raise CacheFileError(
                    f"device: a mapping of layer index -> device must name every one of the file's {len(layers)} "
                    f"layers; missing {missing}"
                )
        for i, state in enumerate(layers):
            layer = cache._new_layer(i)
            _load_layer(layer, _moved(state, device[i]) if per_layer else state, i)
            cache.layers.append(layer)
        _share_positions(cache)
    except CacheFileError:
        raise
    except (ConfigError, ValueError, KeyError, TypeError, IndexError, NotImplementedError) as exc:
        raise CacheFileError(f"{where!r} cannot be loaded: {type(exc).__name__}: {exc}") from None
    return cache


def _moved(node: Any, device: Any) -> Any:
    """``node`` with every tensor on ``device``."""
    if isinstance(node, torch.Tensor):
        return node.to(device)
    if isinstance(node, dict):
        return {k: _moved(v, device) for k, v in node.items()}
    if isinstance(node, list):
        return [_moved(v, device) for v in node]
    return node


def _build(cls: type, header: dict[str, Any], where: str) -> Any:
    comp = header["composition"]
    parts = {}
    for role in _KINDS:
        spec = comp[role]
        if role == "backend" and comp.get("backend_auto"):
            parts[role] = "auto"
            continue
        parts[role] = _rebuild(spec, role, where)
    widths = {int(i): tuple(pair) for i, pair in comp.get("layer_bits", {}).items()}
    cache = cls(**parts, layout=comp["layout"], attention=comp["attention"], layer_bits=widths)
    types, kwargs = header.get("layer_types"), header.get("layer_kwargs")
    if types is not None:
        cache._layer_types, cache._layer_kwargs = list(types), list(kwargs)
    return cache


def _check_model(saved: dict[str, Any], model: dict[str, Any], where: str) -> None:
    diffs = []
    for key in ("architecture", "layers", "kv_heads", "head_dim", "dtype"):
        a, b = saved.get(key), model.get(key)
        if a is not None and b is not None and a != b:
            diffs.append(f"{key}: file {a!r}, model {b!r}")
    if diffs:
        raise CacheFileError(f"{where!r} was saved from another model than the one given ({'; '.join(diffs)})")


def _load_layer(layer: Any, state: dict[str, Any], idx: int) -> None:
    from kvpolicy.cache import CompressedLayer

    kind = state["kind"]
    if isinstance(layer, CompressedLayer) != (kind == "compressed"):
        raise ValueError(f"layer {idx} is saved as {kind!r} but the cache's layout makes it a {type(layer).__name__}")
    if kind == "compressed":
        layer.load_state_dict(state)
        return
    if not state["initialized"]:
        return
    keys, values = state["keys"], state["values"]
    layer.lazy_initialization(keys[:, :, :0], values[:, :, :0])
    layer.keys, layer.values = keys, values
    if "cumulative_length" in state:
        layer.cumulative_length = int(state["cumulative_length"])


def _share_positions(cache: Any) -> None:
    """Shared policies' demoted positions held once between layers again (as before saving)."""
    from kvpolicy.cache import CompressedLayer

    for layer in cache.layers:
        shared = isinstance(layer, CompressedLayer) and layer.store is not None and layer.book is not None
        if shared and layer.store.positions.shape[0] == 1:
            layer.store.positions = layer.book.intern(layer.store.positions)
