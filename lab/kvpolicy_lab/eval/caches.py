"""Cache specifications of an ablation grid: kvpolicy compositions, presets and transformers' own caches.

A :class:`CacheSpec` is what a grid cell names; :meth:`CacheSpec.build` makes a fresh cache for a
model. Four kinds:

``compressed``
    ``CompressedCache(**args)``: any registered policy, action and backend (plugins included),
    with their parameters, e.g. ``{"policy": "log", "action": "quantize", "bits": 2}``.
``preset``
    ``CompressedCache.from_preset(args["name"], **overrides)``.
``dynamic``
    transformers' ``DynamicCache``: the uncompressed reference.
``hf-quantized``
    transformers' ``QuantizedCache(backend, config, nbits, axis_key, axis_value, q_group_size,
    residual_length)`` with backend ``quanto`` or ``hqq``: the "KiVi" of the LogQuant paper (the
    whole prompt is quantized at once and the history is re-quantized at every flush).

Bytes held are counted from the tensors each cache really holds (:func:`held_bytes`).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpolicy.errors import ConfigError

KINDS = ("compressed", "preset", "dynamic", "hf-quantized")
HF_BACKENDS = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}
_HF_ARGS = ("backend", "nbits", "axis_key", "axis_value", "q_group_size", "residual_length")
_HF_PACKAGES = {"quanto": "optimum.quanto", "hqq": "hqq"}


@dataclass
class CacheSpec:
    """One cache configuration of a grid.

    Parameters
    ----------
    kind : str
        One of ``KINDS``.
    args : dict
        Keyword arguments: of ``CompressedCache`` (``compressed``), ``{"name": preset, **overrides}``
        (``preset``), nothing (``dynamic``), or of transformers' ``QuantizedCache`` without
        ``config`` (``hf-quantized``).
    label : str, optional
        Name in tables and plots; derived from ``args`` when empty.
    size_params : tuple of str
        Integer parameters scaled by ``--equal-bytes`` (empty: the default for the policy, see
        :mod:`kvpolicy_lab.eval.equal_bytes`).
    resize : bool
        Whether ``--equal-bytes`` makes a resized copy of this cache.
    """

    kind: str = "compressed"
    args: dict[str, Any] = field(default_factory=dict)
    label: str = ""
    size_params: tuple[str, ...] = ()
    resize: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"cache kind must be one of {list(KINDS)}; got kind={self.kind!r}")
        if not isinstance(self.args, dict):
            raise ConfigError(f"cache args must be a dict; got args={self.args!r}")
        self.args = dict(self.args)
        self.size_params = tuple(self.size_params)
        if not isinstance(self.resize, bool):
            raise ConfigError(f"cache resize must be true or false; got resize={self.resize!r}")
        if not self.label:
            self.label = self.default_label()

    # ------------------------------------------------------------------ naming
    def default_label(self) -> str:
        a = self.args
        if self.kind == "dynamic":
            return "DynamicCache"
        if self.kind == "hf-quantized":
            return f"HF-{a.get('backend', '?')}-{a.get('nbits', 4)}bit"
        if self.kind == "preset":
            rest = ",".join(f"{k}={v}" for k, v in sorted(a.items()) if k != "name")
            return f"preset:{a.get('name')}" + (f"({rest})" if rest else "")
        policy = _part_name(a.get("policy", "log"))
        action = _part_name(a.get("action", "quantize"))
        extras = [f"{k}={v}" for k, v in sorted(a.items()) if k not in ("policy", "action", "bits", "backend")]
        name = f"{policy}/{action}"
        if "bits" in a:
            name += f"/{a['bits']}b"
        if a.get("backend", "torch") != "torch":
            name += f"/{_part_name(a['backend'])}"
        return name + (f"({','.join(extras)})" if extras else "")

    @property
    def compresses(self) -> bool:
        """False for the uncompressed caches (``dynamic``, action ``none``)."""
        if self.kind == "dynamic":
            return False
        if self.kind == "compressed":
            return _part_name(self.args.get("action", "quantize")) != "none"
        return True

    def with_args(self, label: str | None = None, **args: Any) -> CacheSpec:
        """A copy with ``args`` updated (and a new label)."""
        new = copy.deepcopy(self)
        new.args.update(args)
        new.label = label if label is not None else new.default_label()
        return new

    # ------------------------------------------------------------------ building
    def validate(self) -> str:
        """Build once without a model: unknown names or bad parameters raise
        :class:`~kvpolicy.errors.ConfigError` now. Returns the description (see :meth:`describe`)."""
        if self.kind == "hf-quantized":
            _check_hf_args(self.args)
            return self.describe()
        if self.kind == "dynamic":
            if self.args:
                raise ConfigError(f"cache kind 'dynamic' takes no arguments; got {self.args!r}")
            return self.describe()
        return repr(self._compressed(None))

    def needs_scores(self) -> bool:
        """Whether the cache's policy needs attention scores (``kvpolicy.attention.enable_scores``)."""
        if self.kind not in ("compressed", "preset"):
            return False
        cache = self._compressed(None)
        return bool(cache.action.compresses and cache.policy.needs_scores)

    def needs_queries(self) -> bool:
        """Whether the cache's transform fits itself on the prompt's queries (``transform="query-hadamard"``):
        its prefill must run through kvpolicy's attention wrapper, which reports them, not be replayed."""
        if self.kind not in ("compressed", "preset"):
            return False
        cache = self._compressed(None)
        return bool(cache.action.compresses and cache.transform.needs_queries)

    def build(self, model: torch.nn.Module) -> Any:
        """A fresh cache for ``model``."""
        if self.kind == "dynamic":
            from transformers import DynamicCache

            return DynamicCache(config=model.config)
        if self.kind == "hf-quantized":
            from transformers import QuantizedCache

            _check_hf_args(self.args)
            return QuantizedCache(config=model.config, **self.args)
        return self._compressed(model.config)

    def _compressed(self, config: Any) -> Any:
        from kvpolicy.cache import CompressedCache

        if self.kind == "preset":
            args = dict(self.args)
            name = args.pop("name", None)
            if not isinstance(name, str):
                raise ConfigError(f"cache kind 'preset' needs args['name'] (a preset name); got {self.args!r}")
            if config is not None:
                args["config"] = config
            return CompressedCache.from_preset(name, **args)
        return CompressedCache(config=config, **self.args)

    def canonical(self) -> dict[str, Any]:
        """What this cache is, as JSON data that does not depend on how it prints; cell ids hash it.

        kvpolicy caches: their spec's dict (:meth:`kvpolicy.spec.CacheSpec.to_dict`) with the backend
        ``"auto"`` chose on this machine written in, since the backend decides the arithmetic.
        transformers' caches: the kind and the arguments given.

        Raises
        ------
        ConfigError
            A part of the cache has a parameter that is not a JSON value, so the cache has no canonical form.
        """
        if self.kind == "dynamic":
            return {"kind": "dynamic"}
        if self.kind == "hf-quantized":
            return {"kind": "hf-quantized", "args": {k: self.args[k] for k in _HF_ARGS if k in self.args}}
        cache = self._compressed(None)
        try:
            spec = cache.spec.to_dict()
            spec["backend"] = dataclasses.replace(cache.spec, backend=cache.backend).to_dict()["backend"]
        except TypeError as exc:
            raise ConfigError(
                f"cache {self.label!r}: {exc}; a grid's cache must be data to be given a cell id"
            ) from None
        return {"kind": "kvpolicy", "spec": _without_provenance(without_added_defaults(spec))}

    def describe(self) -> str:
        """The exact ``repr`` of the cache (kvpolicy caches) or its constructor call (transformers')."""
        if self.kind == "dynamic":
            return "DynamicCache()"
        if self.kind == "hf-quantized":
            inner = ", ".join(f"{k}={self.args[k]!r}" for k in _HF_ARGS if k in self.args)
            return f"QuantizedCache({inner})"
        return repr(self._compressed(None))


def without_added_defaults(node: Any) -> Any:
    """A spec dict (:meth:`kvpolicy.spec.CacheSpec.to_dict`) without the format parameters that sit at the
    value reproducing what their format computed before they were added
    (:attr:`kvpolicy.formats.base.Format.added_defaults`): so adding a parameter to a format changes no
    cell id of a cache that does not use it."""
    from kvpolicy import registry

    if isinstance(node, list):
        return [without_added_defaults(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: without_added_defaults(v) for k, v in node.items()}
    if out.get("role") == "format" and isinstance(out.get("name"), str) and isinstance(out.get("params"), dict):
        try:
            added = registry.get("formats", out["name"]).added_defaults
        except ConfigError:
            added = {}
        out["params"] = {k: v for k, v in out["params"].items() if not (k in added and added[k] == v)}
    return out


def _part_name(part: Any) -> str:
    return part if isinstance(part, str) else getattr(part, "name", type(part).__name__)


def _check_hf_args(args: dict[str, Any]) -> None:
    unknown = sorted(set(args) - set(_HF_ARGS))
    if unknown:
        raise ConfigError(f"hf-quantized cache: unknown argument(s) {unknown}; accepted: {list(_HF_ARGS)}")
    backend = args.get("backend")
    if backend not in HF_BACKENDS:
        raise ConfigError(f"hf-quantized cache: backend must be one of {sorted(HF_BACKENDS)}; got backend={backend!r}")
    nbits = args.get("nbits", 4)
    if nbits not in HF_BACKENDS[backend]:
        raise ConfigError(f"hf-quantized cache ({backend}): nbits must be one of {HF_BACKENDS[backend]}; got {nbits!r}")
    if importlib.util.find_spec(_HF_PACKAGES[backend].split(".")[0]) is None:
        raise ConfigError(f"hf-quantized cache: backend {backend!r} needs the package {_HF_PACKAGES[backend]!r}")


# ---------------------------------------------------------------------- bytes
def held_bytes(cache: Any, at_16bit: bool = False, layers: list[int] | None = None) -> int:
    """Bytes of every tensor ``cache`` holds.

    kvpolicy caches answer through ``memory_report()`` (codes, scales, staging and position indices
    included). For other caches every tensor reachable from the cache's layers is counted once:
    plain tensors, tensor subclasses that flatten into inner tensors (optimum-quanto's quantized
    tensors) and tensors inside tuples, lists and dicts (hqq's metadata).

    ``at_16bit``: count full-precision tensors at 16 bits per element, as a 16-bit model would hold
    them (kvpolicy: ``MemoryReport.total_bytes_16bit``; other caches: every floating-point tensor
    wider than 16 bits, their residuals and their metadata alike, since those follow the model's dtype).
    ``layers``: count only these layer indices (default: every layer).
    """
    report = getattr(cache, "memory_report", None)
    if callable(report):
        mine = [x for x in report().layers if layers is None or x.layer_idx in layers]
        return int(sum(x.total_bytes_16bit if at_16bit else x.total_bytes for x in mine))
    seen: set[int] = set()
    return sum(_walk(layer, seen, 0, at_16bit) for i, layer in enumerate(getattr(cache, "layers", []))
               if layers is None or i in layers)  # fmt: skip


def global_layers(config: Any) -> list[int] | None:
    """Indices of the full-attention layers of a hybrid model (Gemma-3: 5, 11, 17), the layers whose
    history a cache can compress; ``None`` when every layer is full attention."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kinds = getattr(text, "layer_types", None)
    if not kinds or all(kind == "full_attention" for kind in kinds):
        return None
    return [i for i, kind in enumerate(kinds) if kind == "full_attention"]


def budget_bits(cache: Any, config: Any, tokens: int) -> float:
    """The bits per element a budget counts, full-precision tensors at 16 bits: over a hybrid model's
    full-attention layers (:func:`global_layers`, the layers a cache compresses), else over every layer
    (the cache's memory report).

    Parameters
    ----------
    cache : Any
        A cache after ``tokens`` tokens of one batch row.
    config : Any
        The model's configuration.
    tokens : int
        Tokens the cache has seen.
    """
    layers = global_layers(config)
    if not layers:
        return float(cache.memory_report().bits_per_element_16bit)
    return 16 * held_bytes(cache, at_16bit=True, layers=layers) / baseline_bytes(config, tokens, layers=layers)


def analysed_layers(config: Any, analysis: str) -> list[int] | None:
    """:func:`global_layers` for an analysis of compressed history (``analysis``, e.g. ``"analyze
    attention"``): ``None`` (every layer), or a hybrid model's full-attention layers.

    Raises
    ------
    ConfigError
        If every layer is a sliding window: there is no compressed history to analyse.
    """
    from kvpolicy.errors import ConfigError

    layers = global_layers(config)
    if layers == []:
        raise ConfigError(
            f"{analysis}: the model has no full-attention layer (every layer is a sliding window, which kvpolicy "
            "leaves to transformers); there is no compressed history to analyse"
        )
    return layers


def _walk(obj: Any, seen: set[int], depth: int, at_16bit: bool = False) -> int:
    if depth > 6 or id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        flatten = getattr(obj, "__tensor_flatten__", None)
        if flatten is not None and type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            names, _ = flatten()
            return sum(_walk(getattr(obj, n), seen, depth + 1, at_16bit) for n in names)
        size = obj.element_size()
        if at_16bit and obj.is_floating_point():
            size = min(size, 2)
        return obj.numel() * size
    if isinstance(obj, (list, tuple)):
        return sum(_walk(x, seen, depth + 1, at_16bit) for x in obj)
    if isinstance(obj, dict):
        return sum(_walk(x, seen, depth + 1, at_16bit) for x in obj.values())
    if hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        return sum(_walk(x, seen, depth + 1, at_16bit) for x in vars(obj).values())
    return 0


def baseline_bytes(config: Any, tokens: int, batch: int = 1, layers: list[int] | None = None) -> int:
    """Bytes a 16-bit ``DynamicCache(config=config)`` holds after ``tokens`` tokens: every token in a
    full-attention layer, the last ``sliding_window - 1`` in a sliding-window layer (what transformers
    keeps there), so that an uncompressed hybrid model (Gemma-3) is the 16-bits-per-element anchor.
    ``layers``: count only these layer indices (default: every layer)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    window = getattr(text, "sliding_window", None)
    held = sum(
        min(tokens, window - 1) if kind == "sliding_attention" and isinstance(window, int) else tokens
        for i, kind in enumerate(kinds)
        if layers is None or i in layers
    )
    return int(held * batch * heads * head_dim * 2 * 2)


def _without_provenance(value: Any) -> Any:
    """``value`` without the ``"from"`` entries a saved spec gives a plugin's parts: which distribution
    registers a part says where to find it, not what it computes, so it changes no cell id."""
    if isinstance(value, dict):
        return {k: _without_provenance(v) for k, v in value.items() if not (k == "from" and "name" in value)}
    if isinstance(value, list):
        return [_without_provenance(v) for v in value]
    return value
