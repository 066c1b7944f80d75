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

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kvpolicy import distributed, persist, state_check
from kvpolicy.errors import CacheFileError
from kvpolicy.layer.held import HeldTokens
from kvpolicy.spec import CacheSpec


def save(cache: Any, path: str | Path, model: Any = None, codec: str | None = None) -> int:
    """See :meth:`kvpolicy.CompressedCache.save`."""
    layers = [_layer_state(layer, i, cache.layer_class) for i, layer in enumerate(cache.layers)]
    config = model if model is not None else cache._config
    header = {
        "composition": composition(cache),
        "model": identity(cache, config),
        "distributed": distributed.placement(config),
        "layer_types": cache._layer_types,
        "layer_kwargs": cache._layer_kwargs if cache._layer_types is not None else None,
    }
    return persist.write(path, header, {"layers": layers}, codec)


def composition(cache: Any) -> dict[str, Any]:
    """The composition a file records: :meth:`CacheSpec.to_dict` of the cache's spec."""
    return cache.spec.to_dict()


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
        "kv_heads": _local_heads(config),
        "head_dim": head_dim,
        "dtype": persist.dtype_name(dtype) if isinstance(dtype, torch.dtype) else None,
    }


def _local_heads(config: Any) -> int | None:
    """The kv heads one process holds: the model's, divided by its tensor-parallel size."""
    heads = distributed.kv_heads_of(config)
    return None if heads is None else heads // distributed.tp_size_of(config)


def _layer_state(layer: Any, idx: int, layer_class: type) -> dict[str, Any]:
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    if isinstance(layer, layer_class):
        return layer.state_dict()
    if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
        raise NotImplementedError(f"layer {idx} is a {type(layer).__name__}, which CompressedCache.save cannot save")
    if not layer.is_initialized:
        return {"kind": "transformers", "initialized": False}
    out = {"kind": "transformers", "initialized": True, "keys": layer.keys, "values": layer.values}
    if isinstance(layer, DynamicSlidingWindowLayer):
        out["cumulative_length"] = int(layer.cumulative_length)
    return out


#: a header's entries (``distributed`` is absent from older files, ``coding`` and ``codec`` from files not coded)
HEADER_KEYS = ("composition", "model", "layer_types", "layer_kwargs", "format", "version", "tree", "checksums")


def load(cls: type, path: str | Path, device: Any = None, model: Any = None) -> Any:
    """See :meth:`kvpolicy.CompressedCache.load`."""
    where = str(path)
    per_layer = isinstance(device, Mapping)
    for each in device.values() if per_layer else [device]:
        _check_device(each, where)
    header, tree = persist.read(path, None if per_layer else device)
    try:
        state_check.entries(header, "header", HEADER_KEYS, ("distributed", "coding", "codec"))
        state_check.entries(tree, "tree", ("layers",))
        layers = tree["layers"]
        if not isinstance(layers, list):
            raise ValueError(f"tree: layers is a {type(layers).__name__}, not a list")
        saved = state_check.entries(header["model"], "model", ("architecture", "layers"), _IDENTITY_KEYS)
        if saved.get("dtype") is not None:
            _model_dtype(saved["dtype"])
        if saved["layers"] != len(layers):
            raise ValueError(f"model: {saved['layers']!r:.40} layers recorded, {len(layers)} saved")
        distributed.check_placement(header.get("distributed"), distributed.placement(model))
        cache = _build(cls, header, len(layers), where)
        if model is not None:
            _check_model(saved, _model_identity(model), where)
            cache._config = getattr(model, "config", model)  # what the layers' transform binds with
        if per_layer:
            missing = [i for i in range(len(layers)) if i not in device]
            if missing:
                raise CacheFileError(
                    f"device: a mapping of layer index -> device must name every one of the file's {len(layers)} "
                    f"layers; missing {missing}"
                )
        for i, state in enumerate(layers):
            layer = cache._new_layer(i)
            try:
                state = _moved(state, device[i]) if per_layer else state
                _load_layer(layer, state, i, saved.get("dtype"), cls.layer_class)
            except CacheFileError:
                raise
            except Exception as exc:
                reason = _reason(exc)  # a compressed layer's own checks name the layer already
                reason = reason if reason.startswith(f"layer {i}: ") else f"layer {i}: {reason}"
                raise CacheFileError(f"{where!r}: {reason}") from None
            cache.layers.append(layer)
        _share_positions(cache)
        cache._saved_layers = len(layers)
    except CacheFileError:
        raise
    except Exception as exc:  # anything a malformed header reaches is refused, never raised raw
        raise CacheFileError(f"{where!r} cannot be loaded: {_reason(exc)}") from None
    return cache


#: the optional entries of a header's ``model``
_IDENTITY_KEYS = ("kv_heads", "head_dim", "value_head_dim", "dtype", "batch")


def _model_dtype(name: Any) -> torch.dtype:
    """The dtype the file's model identity records (a ValueError, so that the message names the file)."""
    try:
        return persist.dtype_of(name, "model: dtype")
    except CacheFileError as exc:
        raise ValueError(str(exc)) from None


def _reason(exc: BaseException) -> str:
    """What ``exc`` says; a check's ``ValueError`` as it is, anything else with its type."""
    text = str(exc) if type(exc) is ValueError else f"{type(exc).__name__}: {exc}"
    return text[:2000]


def _check_device(device: Any, where: str) -> None:
    """Refuse a ``device`` torch does not know or cannot allocate on, before reading the file."""
    try:
        torch.empty(0, device=device)
    except Exception as exc:
        raise CacheFileError(
            f"cannot load {where!r} onto device={device!r:.40}: {_reason(exc).splitlines()[0]} (give a device this "
            "torch can use: 'cpu', or 'cuda' / 'cuda:N' with a GPU build, or a mapping of layer index -> device)"
        ) from None


def _moved(node: Any, device: Any) -> Any:
    """``node`` with every tensor on ``device``."""
    if isinstance(node, torch.Tensor):
        return node.to(device)
    if isinstance(node, dict):
        return {k: _moved(v, device) for k, v in node.items()}
    if isinstance(node, list):
        return [_moved(v, device) for v in node]
    return node


def _check_formats_whole(node: Any) -> None:
    """Every format a saved composition holds lists all its options: one left out would take the format's
    default, which the stored blocks need not share (fitted and min-max ranges hold the same bytes), so
    the loaded cache would continue with other logits."""
    from kvpolicy import registry

    if isinstance(node, list):
        for item in node:
            _check_formats_whole(item)
    if not isinstance(node, dict):
        return
    part = node.get("part")
    if isinstance(part, dict) and part.get("role") == "format" and part.get("name") in registry.names("formats"):
        params = part.get("params")
        cls = registry.get("formats", part["name"])
        missing = sorted(set(cls.options()) - set(cls.options_added) - set(params or {}))
        if not isinstance(params, dict) or missing:
            raise ValueError(f"composition: the saved format {part['name']!r} lacks its options {missing}")
    for value in node.values():
        _check_formats_whole(value)


def _build(cls: type, header: dict[str, Any], layers: int, where: str) -> Any:
    _check_formats_whole(header["composition"])
    spec = CacheSpec.from_dict(header["composition"], where)
    outside = [i for i, _ in spec.layer_bits if i >= layers]
    if outside:
        raise ValueError(f"composition: layer_bits names layer(s) {outside} of a file of {layers} layers")
    cache = cls.from_spec(spec)
    types, kwargs = header.get("layer_types"), header.get("layer_kwargs")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers or not all(isinstance(t, str) for t in types):
            raise ValueError(f"layer_types is not a list of {layers} layer type names")
        if not isinstance(kwargs, list) or len(kwargs) != layers or not all(isinstance(k, dict) for k in kwargs):
            raise ValueError(f"layer_kwargs is not a list of {layers} mappings")
        _check_layer_types(types, kwargs)
        cache._layer_types, cache._layer_kwargs = list(types), list(kwargs)
    return cache


def _check_layer_types(types: list[str], kwargs: list[dict[str, Any]]) -> None:
    """Layer types transformers knows, with keyword arguments of its own layers (integers only)."""
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING

    known = ["full_attention", *DYNAMIC_LAYER_TYPE_MAPPING]
    for i, (kind, extra) in enumerate(zip(types, kwargs, strict=True)):
        state_check.choice(kind, f"layer_types[{i}]", known)
        for key, value in extra.items():
            state_check.choice(key, f"layer_kwargs[{i}] key", ("sliding_window", "chunk_size", "max_cache_len"))
            state_check.integer(value, f"layer_kwargs[{i}][{key!r}]", 1)


def _check_model(saved: dict[str, Any], model: dict[str, Any], where: str) -> None:
    diffs = []
    for key in ("architecture", "layers", "kv_heads", "head_dim", "dtype"):
        a, b = saved.get(key), model.get(key)
        if a is not None and b is not None and a != b:
            diffs.append(f"{key}: file {a!r}, model {b!r}")
    if diffs:
        raise CacheFileError(f"{where!r} was saved from another model than the one given ({'; '.join(diffs)})")


def _load_layer(layer: Any, state: dict[str, Any], idx: int, dtype: str | None, layer_class: type) -> None:
    """Restore one layer's state (checked: see :meth:`HeldTokens.load_state_dict`); its tokens must
    be of the ``dtype`` the file's model identity records."""
    kind = state_check.entries(state, "layer", ("kind",), _LAYER_KEYS)["kind"]
    if isinstance(layer, layer_class) != (kind == "compressed"):
        raise ValueError(
            f"layer {idx} is saved as {kind!r:.40} but the cache's layout makes it a {type(layer).__name__}"
        )
    if state.get("initialized") is True and dtype is not None:
        keys = state_check.tensor(state.get("keys"), "keys")
        if keys.dtype != _model_dtype(dtype):
            raise ValueError(f"keys of dtype {persist.dtype_name(keys.dtype)} in a cache of {dtype}")
    if kind == "compressed":
        layer.load_state_dict(state)
        return
    initialized = state_check.flag(state.get("initialized"), "initialized")
    if not initialized:
        state_check.entries(state, "an empty layer", ("kind", "initialized"))
        return
    sliding = hasattr(layer, "cumulative_length")
    state_check.entries(
        state, "layer", ("kind", "initialized", "keys", "values", *(["cumulative_length"] if sliding else []))
    )
    keys, values = state_check.layer_tokens(state["keys"], state["values"])
    layer.lazy_initialization(keys[:, :, :0], values[:, :, :0])
    layer.keys, layer.values = keys, values
    if sliding:
        layer.cumulative_length = state_check.integer(state["cumulative_length"], "cumulative_length", keys.shape[2])


_LAYER_KEYS = ("initialized", "backend", "cumulative_length", *HeldTokens.STATE_KEYS)


def _share_positions(cache: Any) -> None:
    """Shared policies' demoted positions held once between layers again (as before saving)."""
    for layer in cache.layers:
        if not isinstance(layer, cache.layer_class):
            continue
        held = layer.engine.held
        if held is not None and held.store is not None and held.book is not None and held.store.positions.shape[0] == 1:
            held.store.positions = held.book.intern(held.store.positions)
