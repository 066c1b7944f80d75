"""The transformers adapter: the only module that knows transformers' ``Cache`` API.

``CompressedCache`` is a ``transformers.Cache`` whose per-layer objects (``CompressedLayer``)
translate transformers' calls for a :class:`~kvpolicy.layer.engine.LayerEngine` (plain torch),
which holds the tokens in a :class:`~kvpolicy.layer.held.HeldTokens`: full-precision ones (the
policy's set) and demoted ones (the action's store, one or more compressed tiers), each with the
logical positions of its tokens. The cache builds its parts once, as a
:class:`~kvpolicy.layer.composition.Composition`, which every layer reads by reference.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvpolicy import distributed, fused, inference_tensors, model_check
from kvpolicy import layer_bits as per_layer
from kvpolicy import spec as specs
from kvpolicy.actions.base import Action
from kvpolicy.backends.base import Backend
from kvpolicy.continuation import Continuation, refuse_empty
from kvpolicy.errors import CacheFileError, ConfigError
from kvpolicy.layer.composition import Composition, choose_backend, plan
from kvpolicy.layer.engine import LayerEngine
from kvpolicy.layer.held import SEGMENTS, nbytes
from kvpolicy.layer.padding import StepMask
from kvpolicy.memory import LayerBytes, MemoryReport
from kvpolicy.policies.base import Policy
from kvpolicy.positions import PositionBook
from kvpolicy.transforms import Transform

# kvpolicy's attention implementations ("kvpolicy_fused_sdpa", "kvpolicy_sdpa", ... ) are known to
# transformers from here on, so a model can be loaded with attn_implementation="kvpolicy_fused_sdpa"
fused.register()

LAYOUTS = specs.LAYOUTS
ATTENTION = specs.ATTENTION
#: the keyword through which CompressedCache.update hands a layer its step's columns of the attention mask
MASK_KWARG = "kvpolicy_step_mask"
#: the message of a compiled step whose attention mask shows padding (checked when the step runs)
COMPILED_PADDING = (
    "CompressedCache: a step compiled with torch.compile was given an attention mask with padding in its new "
    "columns; a compiled step serves batches without padding only (run padded batches eagerly)"
)


def _engine(name: str, doc: str, settable: bool = False) -> property:
    """A name other code reads off the layer, kept as a read of its engine's (not on the hot path)."""

    def put(layer: CompressedLayer, value: Any) -> None:
        setattr(layer.engine, name, value)

    return property(lambda layer: getattr(layer.engine, name), put if settable else None, doc=doc)


class CompressedLayer(CacheLayerMixin):
    """One layer of a :class:`CompressedCache`: transformers' layer contract translated onto its
    engine (:class:`~kvpolicy.layer.engine.LayerEngine`, plain torch), which holds the tokens, runs
    the policy, decides what to hand attention and records the path each step took. A left-padded
    batch is the engine's batch form (:class:`~kvpolicy.layer.padded.PaddedEngine`) behind the same methods.
    Both read the cache's one :class:`~kvpolicy.layer.composition.Composition`. What the layer holds is read
    off its engine: ``layer.engine.held`` (the tokens: ``.store``, ``.state``, ``.full_pos``, ``.basis``),
    ``.policy``, ``.backend``, ``.action``, ``.length``; the layer itself answers transformers' ``keys``,
    ``values`` and ``is_croppable``.

    Contract with transformers:

    - ``get_seq_length()`` is the logical length (tokens seen), never a physical count, so RoPE
      positions of new tokens stay logical;
    - ``get_mask_sizes(q)`` is the number of keys the next ``update`` returns and the logical
      position the first of them stands for: ``(length + q, 0)`` when demoted tokens are kept
      (quantized), ``(held + q, length - held)`` for a multi-token update with eviction and
      ``(held_after, length + 1 - held_after)`` for a single-token one;
    - a single-token update (decode) demotes before returning, so the query at position ``T - 1``
      attends over ``FP(T)`` (plus the compressed rest); a multi-token update (prefill, a second
      turn) returns every held token with the new ones at full precision, so prefill attention
      always sees the uncompressed prompt, and score-based policies get the prefill's attention
      before choosing. It is demoted once that attention has run: :meth:`release`, which the cache
      calls when the model updates a later layer of the same forward (keeping the last tokens a
      ``crop`` could remove, see :meth:`HeldTokens.release`), else at the start of the next call.
    """

    is_sliding = False
    keys = _engine(
        "keys", "The full-precision segment's keys, ``(batch, kv_heads, n_full, head_dim)`` (a padded batch: each "
        "row's, right-aligned; while nothing is demoted, at the columns of the attention mask, as in DynamicLayer).",
        True,
    )  # fmt: skip
    values = _engine("values", "The full-precision segment's values, laid out as :attr:`keys`.", True)
    is_croppable = _engine("is_croppable", "Whether :meth:`crop` can undo the latest update now.")  # type: ignore[assignment]

    def __init__(self, composition: Composition, layer_idx: int) -> None:
        self.engine = LayerEngine(composition, layer_idx)
        self.layer_idx = layer_idx
        super().__init__()

    # ------------------------------------------------------------------ transformers API
    def lazy_initialization(
        self, key_states: torch.Tensor, value_states: torch.Tensor, position_ids: torch.Tensor | None = None,
        mask: StepMask | None = None,
    ) -> None:  # fmt: skip
        self.engine = self.engine.start(key_states, value_states, position_ids, mask)
        self.device, self.dtype, self.is_initialized = key_states.device, key_states.dtype, True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` (``(batch, kv_heads, n, head_dim)``) and return
        the keys and values attention must use (``get_mask_sizes`` announced how many)."""
        # a decode step of an initialised layer reads no positions (only a first or multi-token update reads padding
        # from them); the attention mask, when the cache was told it, is read at every step (StepMask)
        mask = kwargs.get(MASK_KWARG)
        position_ids = _position_ids(kwargs) if key_states.shape[-2] > 1 or not self.is_initialized else None
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states, position_ids, mask)
        grad = torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad)
        side = kwargs.get("kwargs")
        return self.engine.step(
            key_states, value_states, grad, position_ids, mask, side if isinstance(side, dict) else None
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.engine.mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self.engine.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.engine, self.is_initialized = self.engine.reset(), False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.engine.reorder(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.engine.select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.engine.repeat(repeats)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (assisted decoding's rollback of rejected drafts):
        exact while they arrived in the latest multi-token update, whose demotions are still deferred;
        tokens that a policy already saw cannot be taken back (``ValueError``)."""
        self.engine.crop(tokens_to_remove)

    def release(self) -> int:
        """The model has moved past this layer's attention: demote what the latest multi-token update may
        demote now (:meth:`LayerEngine.release`); returns the tokens the policy was told of."""
        return self.engine.release()

    # ------------------------------------------------------------------ saving (kvpolicy.persist)
    def state_dict(self) -> dict[str, Any]:
        """Everything this layer holds, as JSON values and tensors (see :meth:`CompressedCache.save`),
        after the demotions a multi-token update deferred."""
        return self.engine.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output into this fresh layer, checking that its parts agree."""
        if (keys := self.engine.load_state_dict(state)) is not None:
            self.device, self.dtype, self.is_initialized = keys.device, keys.dtype, True

    # ------------------------------------------------------------------ kvpolicy.attention, kvpolicy.fused
    def observe_attention(self, scores: torch.Tensor, layout: str = "ordered") -> None:
        """Attention mass per returned key, ``(kv_heads, keys)`` with keys in ``layout``'s order."""
        self.engine.observe(scores, layout)

    def attention_view(self, layout: str = "ordered") -> tuple[torch.Tensor, torch.Tensor]:
        """The whole history, materialised in position order or as ``[demoted, full-precision]``."""
        return self.engine.view(layout)

    # ------------------------------------------------------------------ inspection
    def positions(self) -> dict[str, torch.Tensor]:
        """Logical positions held at full precision and in compressed form (sorted int64), after the
        demotions a multi-token update deferred (see :meth:`HeldTokens.positions`)."""
        return self.engine.positions()

    def memory(self, seen: set[tuple[str, int]] | None = None) -> LayerBytes:
        """Bytes of every tensor this layer holds, by segment (``seen``: storages already counted)."""
        return self.engine.memory(seen)

    def __repr__(self) -> str:
        return f"CompressedLayer(layer_idx={self.layer_idx}, length={self.engine.length})"


def _described(layer: CompressedLayer) -> str | None:
    """How ``layer``'s latest step read its history, as :meth:`CompressedCache.attention_paths` shows it."""
    return None if layer.engine.path is None else str(layer.engine.path)


def _position_ids(kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``position_ids`` reach ``Cache.update`` in its kwargs (nested under ``kwargs`` in Llama-style models)."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None and isinstance(kwargs.get("kwargs"), dict):
        position_ids = kwargs["kwargs"].get("position_ids")
    return position_ids


def _layer_memory(layer: Any, layer_idx: int, seen: set[tuple[str, int]]) -> LayerBytes:
    """What ``layer`` holds: a compressed layer reports its segments; any other layer (transformers' own: sliding
    windows, linear-attention or convolution states, indexers, layers holding nothing) counts every tensor it
    holds as full precision, with a 16-bit baseline of the same elements (what ``DynamicCache`` would hold)."""
    if isinstance(layer, CompressedLayer):
        return layer.memory(seen)
    segments = dict.fromkeys(SEGMENTS, 0)
    baseline, width = 0, None
    for t in held_tensors(layer):
        segments["full_precision"] += nbytes(t)
        baseline += t.numel() * 2 if t.is_floating_point() else nbytes(t)
        if width is None and t.is_floating_point():
            width = t.element_size()
    return LayerBytes(layer_idx, _tokens(layer), segments, baseline, width or 2, type(layer).__name__)


def held_tensors(layer: Any) -> list[torch.Tensor]:
    """The tensors with elements that a cache layer kvpolicy does not own holds, each once: its attributes, and the
    dicts, lists and tuples in them (linear-attention layers keep conv and recurrent states in dicts by index).
    Zero-dimensional tensors (counters, window sizes) are bookkeeping, not held tokens or states."""
    out: list[torch.Tensor] = []
    ids: set[int] = set()
    todo = list(vars(layer).values()) if hasattr(layer, "__dict__") else []
    while todo:
        obj = todo.pop()
        if isinstance(obj, torch.Tensor):
            if obj.dim() > 0 and obj.numel() > 0 and id(obj) not in ids:
                ids.add(id(obj))
                out.append(obj)
        elif isinstance(obj, (Mapping, list, tuple)) and id(obj) not in ids:
            ids.add(id(obj))  # a container reached twice (or holding itself) is walked once
            todo.extend(obj.values() if isinstance(obj, Mapping) else obj)
    return out


def in_use(layer: Any) -> bool:
    """Whether a layer of a cache has received anything: a compressed layer its first update, any other layer a
    tensor with elements (:func:`held_tensors`)."""
    if isinstance(layer, CompressedLayer):
        return bool(layer.is_initialized)
    return bool(held_tensors(layer))


def _tokens(layer: Any) -> int:
    """Tokens a layer kvpolicy does not own has seen (``get_seq_length``, an int or a 0-d tensor); 0 if it
    cannot tell."""
    try:
        return int(layer.get_seq_length())
    except Exception:  # a layer of an unknown kind: the report still counts its tensors
        return 0


class CompressedCache(Cache):
    """A transformers ``Cache`` that compresses keys and values by policy x action x backend.

    Parameters
    ----------
    policy : str or Policy
        Which tokens stay at full precision; a registered name (``"log"``) or a policy object.
    action : {"quantize", "tiered", "evict", "none"} or Action
        What happens to the tokens the policy demotes. ``"quantize"`` (default): stored once as codes
        of 2, 3, 4 or 8 bits (``bits=``, ``key_bits=``, ``value_bits=``, ``group_size=``, ``scheme=``...;
        :class:`~kvpolicy.actions.quantize.Quantize`). ``"tiered"``: held in precision tiers, the
        tokens a policy over each tier keeps there and the rest one tier down (``tiers=``, ``keep=``;
        :class:`~kvpolicy.actions.tiered.Tiered`). ``"evict"``: dropped. ``"none"``: kept at full
        precision (equals ``DynamicCache`` bit for bit). Or an action object, a plugin's included.
    backend : str or Backend
        How bits are packed. ``"auto"`` (default): the fastest built-in backend that serves the
        composition on the device (``cpu`` on CPU, ``triton`` on CUDA, else ``torch``; see
        :func:`kvpolicy.layer.composition.choose_backend`); or a registered name (``"torch"``, ``"cpu"``...) or object.
    layout : {"ordered", "agnostic"}
        ``"ordered"`` returns keys in position order (correct with any mask). ``"agnostic"``
        returns ``[demoted tokens, full-precision tokens]`` without reordering (LogQuant's
        position-agnostic trick): valid because every past token precedes every new token, so
        the causal mask is unchanged. In a left-padded batch each row's view fills the columns
        after its pads, whatever the layout.
    attention : {"auto", "fused", "materialized"}
        How decode steps read the compressed history. ``"auto"`` (default): when the model runs
        kvpolicy's fused attention function (:func:`kvpolicy.fused.enable_fused`), a decode step
        hands it the full-precision segment and the packed store, and attention over the quantized
        tokens is computed from their codes (``Backend.attend``) and merged by log-sum-exp, without
        rebuilding the history; otherwise, and for compositions the fused path does not cover
        (per-head or score-based policies, left-padded batches), the history is materialised as
        before. ``"fused"``: the same, but refuse (ConfigError / RuntimeError) instead of
        materialising, including a decode step the fused function declines (a mask that hides
        some keys, ``output_attentions``...: the error names the reason and the remedy); a
        multi-token update (a later turn's prompt) is no decode step and materialises under every
        setting. ``"materialized"``: always materialise. :meth:`attention_paths` tells which path
        each layer took on the latest step.
    config : transformers.PretrainedConfig, optional
        The model's config. Needed for models with sliding-window layers (Gemma 2/3, Mistral
        configs with ``sliding_window`` set): those layers are left to transformers' own sliding
        layer and only full-attention layers are compressed. Without it every layer is compressed.
    transform : {"none", "hadamard"}, a plugin's name, or Transform
        A change of basis applied to demoted tokens before the action stores them. ``"none"``
        (default). ``"hadamard"``: a randomized Hadamard rotation, which spreads outlier channels
        over all of them (:class:`~kvpolicy.transforms.hadamard.Hadamard`). Plugins register more
        (``kvpolicy plugins`` lists them); one whose basis fits on the prompt's queries
        (``Transform.needs_queries``) needs kvpolicy's attention on the model
        (:func:`kvpolicy.fused.enable_fused` or :func:`kvpolicy.attention.enable_scores`). Or a transform object.
    layer_bits : mapping of int to int or (int, int), optional
        Code widths of single layers, ``{layer index: bits or (key_bits, value_bits)}``, with the
        action's other settings: ``{0: 4, -1: (4, 2)}``. Negative indices count from the last layer
        and need ``config``; :func:`kvpolicy.layer_bits.boundary` builds the common map. For
        ``action="quantize"`` only (another action refuses).
    **params
        Hyperparameters of the policy, action or backend given by name when those are strings,
        e.g. ``window=64``, ``bits=2``, ``group_size=64``. A keyword no part accepts is an error.
        ``sinks=S`` with a policy that has no ``sinks`` parameter wraps it in
        :class:`~kvpolicy.policies.Sinks`: the first ``S`` tokens stay at full precision for good and
        the policy selects among the tokens after them (``policy="log", sinks=4``).

    Examples
    --------
    Build the cache for its model (:meth:`for_model` reads ``model.config``: hybrid models keep their
    sliding-window layers, head dims adapt the defaults), from a preset or from keywords:

    >>> cache = CompressedCache.for_model(model, "kvpolicy-3bit")  # doctest: +SKIP
    >>> cache = CompressedCache.for_model(model, policy="log", window=64, bits=2)  # doctest: +SKIP
    >>> out = model.generate(**inputs, cache=cache, max_new_tokens=64)  # doctest: +SKIP
    >>> print(cache.memory_report())  # doctest: +SKIP
    """

    #: the class of its compressed layers (:mod:`kvpolicy.cache_io` saves and loads their state)
    layer_class = CompressedLayer

    def __init__(
        self,
        policy: str | Policy = "log",
        action: str | Action = "quantize",
        backend: str | Backend = "auto",
        layout: str = "ordered",
        config: Any = None,
        attention: str = "auto",
        transform: str | Transform = "none",
        layer_bits: Mapping[int, int | tuple[int, int]] | None = None,
        **params: Any,
    ) -> None:
        spec = specs.CacheSpec.resolve(
            policy=policy, action=action, backend=backend, layout=layout, attention=attention, transform=transform,
            layer_bits=layer_bits, **params,
        )  # fmt: skip
        self._bind(spec, config)

    @classmethod
    def from_spec(cls, spec: specs.CacheSpec, config: Any = None) -> CompressedCache:
        """The cache of a :class:`~kvpolicy.spec.CacheSpec` (``CacheSpec.resolve``, ``from_preset``,
        ``from_file``, ``from_dict``), for the model whose ``config`` is given (see ``config`` above)."""
        if not isinstance(spec, specs.CacheSpec):
            raise ConfigError(f"from_spec takes a CacheSpec (CacheSpec.resolve(...)); got {type(spec).__name__}")
        cache = cls.__new__(cls)
        cache._bind(spec, config)
        return cache

    def _bind(self, spec: specs.CacheSpec, config: Any) -> None:
        """Set up this cache for ``spec`` and the model's ``config``: the backend ``"auto"`` stands for, the
        per-layer actions, the defaults adapted to the backend, and the layers ``config`` describes."""
        auto = spec.backend is None
        #: what the cache was loaded from (:meth:`from_preset`, :meth:`from_config`, :meth:`for_model` with a
        #: preset): a :class:`~kvpolicy.preset_source.PresetSource`; ``None`` for a cache built from keywords
        self.preset: Any = None
        #: ``{layer index: (key_bits, value_bits)}`` of the layers whose widths differ from the action's
        self.layer_bits = per_layer.resolve(spec.widths, _num_layers(config))
        #: the composition this cache was built from (``backend=None``: ``"auto"``), with layer indices counted
        #: from the end (``-1``) resolved by the config; :meth:`save` writes it
        self.spec = dataclasses.replace(spec, layer_bits=self.layer_bits)
        action = spec.action
        layer_actions = per_layer.layer_actions(action, self.layer_bits) if action.compresses else {}
        # backend="auto": the fastest backend that serves every layer's widths
        backend = choose_backend([action, *layer_actions.values()]) if auto else spec.backend
        #: the defaults replaced because they cannot serve the backend or a head dim (an ordered set of
        #: notes, filled further by each layer's first update), see :meth:`Action.serving`
        adapted: dict[str, None] = {}
        if action.compresses:
            action = _served(spec.policy, action, backend, auto, spec.attention, config, adapted)
            layer_actions = {i: _served(spec.policy, a, backend, auto, spec.attention, config, adapted)
                             for i, a in layer_actions.items()}  # fmt: skip
            for each in [action, *layer_actions.values()]:
                each.check_backend(backend)
                each.check_transform(spec.transform)
        if spec.attention == "fused":
            reason = plan(spec.policy, action, backend, auto=auto, attention="fused").fused_reason
            if reason is not None:
                raise ConfigError(
                    f"attention='fused' cannot serve this composition: {reason}; use attention='auto' (materialises "
                    "the history for it) or 'materialized'"
                )
        #: the parts, built once here and read by every layer (the demoted positions of shared policies are
        #: held once for all layers in its ``book``)
        self.composition = Composition(
            spec.policy, action, backend, spec.transform, spec.layout, spec.attention, auto, layer_actions, config,
            PositionBook(), adapted,
        )  # fmt: skip
        super().__init__(layers=[])
        self._unreleased: list[int] = []  # layers whose multi-token update of this forward awaits release
        self._mask: torch.Tensor | None = None  # the 2-D attention mask of this forward (note_attention_mask)
        self._step_mask: tuple[int, int, StepMask] | None = None  # (past, n, its columns), once per forward
        #: the rows' positions so far, read at the first compressed layer of each forward (``_watched``): a forward
        #: that does not continue them (generate given a cache filled before) is refused
        self._continuation = Continuation()
        self._watched: int | None = None
        self._inference = False  # the cache ran under torch.inference_mode() since it last left it (_outside)
        self._layer_types: list[str] | None = None
        self._layer_kwargs: list[dict] = []
        self._model_warned = False  # check_model_config warned already
        #: the number of layers of the file a loaded cache came from (None: not loaded)
        self._saved_layers: int | None = None
        if config is not None:
            from transformers import PretrainedConfig
            from transformers.cache_utils import get_layer_types_and_kwargs

            if not isinstance(config, PretrainedConfig):
                raise ConfigError(
                    f"config must be the model's transformers PretrainedConfig (model.config); got a "
                    f"{type(config).__name__}: {config!r:.80}"
                )
            distributed.check_config(config)  # kv heads a tensor-parallel model cannot split: a clear error now
            self._layer_types, self._layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
            left = sorted(i for i in self.layer_bits if self._layer_types[i] != "full_attention")
            if left:
                raise ConfigError(
                    f"layer_bits names layer(s) {left}, which are {sorted({self._layer_types[i] for i in left})} "
                    "layers left to transformers (only 'full_attention' layers are compressed)"
                )
            self.layers = [self._new_layer(i) for i in range(len(self._layer_types))]
            if self.action.compresses and not any(isinstance(layer, CompressedLayer) for layer in self.layers):
                kinds = sorted(set(self._layer_types))
                warnings.warn(
                    f"CompressedCache: config= leaves no layer compressed (layer types: {kinds}); only "
                    "'full_attention' layers are compressed, so this cache holds as many bytes as DynamicCache",
                    stacklevel=2,
                )

    def _new_layer(self, layer_idx: int) -> CacheLayerMixin:
        """A compressed layer, or transformers' own layer for non-full-attention layer types."""
        kind = "full_attention" if self._layer_types is None else self._layer_types[layer_idx]
        if kind == "full_attention":
            return CompressedLayer(self.composition, layer_idx)
        from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING

        return DYNAMIC_LAYER_TYPE_MAPPING[kind](**self._layer_kwargs[layer_idx])

    # the parts, as the composition holds them (read-only: the cache builds its composition once)
    policy = property(lambda self: self.composition.policy, doc="The policy.")
    action = property(lambda self: self.composition.action, doc="The action, as the backend serves it.")
    backend = property(lambda self: self.composition.backend, doc="The backend (``auto``'s choice, or the one named).")
    transform = property(lambda self: self.composition.transform, doc="The transform of demoted tokens.")
    layout = property(lambda self: self.composition.layout, doc="The order of a materialised history.")
    attention = property(lambda self: self.composition.attention, doc="How decode steps read the history.")
    adapted = property(lambda self: self.composition.adapted, doc="The notes of the defaults replaced, in order.")

    @property
    def _config(self) -> Any:
        """The model's config, when given (the layers' transform binds with it; :meth:`save` records its identity)."""
        return self.composition.config

    @_config.setter
    def _config(self, config: Any) -> None:
        """Bind a config to a cache whose layers are not built yet (loading a file for a model)."""
        if self.layers:
            raise RuntimeError("CompressedCache: the model's config is given before any layer is built")
        self.composition = dataclasses.replace(self.composition, config=config)

    # transformers' state updates of non-attention layers (linear attention, state space, sparse indexers)
    def get_conv_state(self, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        self._check_state_layer(layer_idx, "convolution state")
        return super().get_conv_state(layer_idx, *args, **kwargs)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        self._check_state_layer(layer_idx, "convolution state")
        return super().update_conv_state(conv_states, layer_idx, *args, **kwargs)

    def get_recurrent_state(self, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        self._check_state_layer(layer_idx, "recurrent state")
        return super().get_recurrent_state(layer_idx, *args, **kwargs)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        self._check_state_layer(layer_idx, "recurrent state")
        return super().update_recurrent_state(recurrent_states, layer_idx, *args, **kwargs)

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> Any:
        self._check_state_layer(layer_idx, "sparse-attention indexer")
        return super().update_indexer(indexer_key_states, layer_idx)

    def _check_state_layer(self, layer_idx: int, what: str) -> None:
        """A hybrid model's non-attention layer asks for its state: only a cache built with ``config=``
        has such layers."""
        if self._layer_types is None:
            raise ConfigError(
                f"CompressedCache: layer {layer_idx} of this model is not an attention layer (it keeps a {what}); "
                "pass config=model.config so transformers' own layers serve it and only full-attention layers "
                "are compressed"
            )

    @classmethod
    def for_model(cls, model: Any, preset: str | None = None, **kwargs: Any) -> CompressedCache:
        """A cache built for ``model``: its config decides which layers are compressed and their head dims.

        Sliding-window and other non-full-attention layers (Gemma 2/3, hybrid models) are left to
        transformers' own layers, and defaults that cannot serve the model's head dim are replaced
        (``repr`` shows them as ``adapted=[...]``). The same as ``CompressedCache(config=model.config,
        ...)`` or ``from_preset(preset, config=model.config, ...)``, after checking that the model is one
        kvpolicy can compress. With ``action="none"`` a model without full-attention layers (every layer
        sliding-window, say) is served too: every layer is then transformers' own, as in ``DynamicCache``.

        Parameters
        ----------
        model : transformers.PreTrainedModel
            The model the cache will serve (only its ``config`` is read).
        preset : str or pathlib.Path, optional
            A registered preset (``"kvpolicy-3bit"``), a preset file shipped with kvpolicy
            (``"smollm2-8k-2.5bit"``), a model preset a plugin registers, or a preset file's path
            (:meth:`from_preset`); ``None`` for ``CompressedCache(**kwargs)``; or ``"auto"``: the model preset
            registered for this model when one suits it (:func:`kvpolicy.model_presets.choose`), else
            ``CompressedCache(**kwargs)``; ``repr`` then shows which and why. ``None`` never switches to a
            model preset.
        **kwargs
            Keywords of :class:`CompressedCache` (or the preset's overrides); not ``config``.

        Raises
        ------
        ConfigError
            If ``model`` has no transformers config, declares no full-attention layer while the action
            compresses, or has layers of a type transformers has no cache layer for (the error names the
            model class); for an unknown preset (with the closest known name) or a bad preset file; with
            ``"auto"``, when several model presets suit the model; or for bad keywords.
        """
        if "config" in kwargs:
            raise ConfigError(
                "for_model reads config from the model; drop config= (or build CompressedCache(config=...))"
            )
        config = model_check.check_model(model, compresses=False)
        source = None
        if isinstance(preset, str) and preset == "auto":
            from kvpolicy import model_presets

            source, _ = model_presets.choose(model)
        elif preset is not None:
            from kvpolicy import preset_source

            source = preset_source.resolve(preset)
        if source is None or source.kind == "default":
            spec = specs.CacheSpec.resolve(**kwargs)
        else:
            spec = specs.CacheSpec.from_source(source, **kwargs)
        if spec.action.compresses:
            model_check.check_model(model)
        cache = cls.from_spec(spec, config)
        if source is not None:
            cache.preset = source
        return cache

    @classmethod
    def from_config(cls, path: str | Path, **overrides: Any) -> CompressedCache:
        """A cache from a preset file: the ``[cache]`` table of a TOML file (what ``kvpolicy tune``
        writes) as keywords, ``overrides`` (e.g. ``config=model.config``) on top.

        ``path`` is a file's path, or the name of a preset file shipped with kvpolicy
        (:func:`kvpolicy.preset_files.names`: ``"gemma3-270m-3.5bit"``, ``"smollm2-3bit"``,
        ``"smollm2-8k-2.5bit"``), or any other name :meth:`from_preset` takes: the two share one resolver
        (:mod:`kvpolicy.preset_source`).

        Raises
        ------
        ConfigError
            If the file cannot be read or parsed, has no ``[cache]`` table, or its keywords are bad (the message
            names the file and the problem), or the name is unknown.
        """
        return cls.from_preset(path, **overrides)

    @classmethod
    def from_preset(cls, name: str | Path, **overrides: Any) -> CompressedCache:
        """A cache from a preset: a registered one (``"logquant"``, ``"kvpolicy-3bit"``...; ``kvpolicy list``
        shows them), a preset file shipped with kvpolicy (``"smollm2-8k-2.5bit"``) or a preset file's path.

        A bare name is a preset's even when a file of that name is in the working directory (a warning says
        so); write ``./name``, a ``.toml`` suffix or an absolute path to load a file. The cache's ``preset``
        attribute tells what was loaded (a :class:`~kvpolicy.preset_source.PresetSource`).

        ``overrides`` are a registered preset's own parameters (e.g. ``budget=128``) or cache keywords
        (e.g. ``layout="agnostic"``, ``backend="torch"``, ``config=model.config``).

        Raises
        ------
        ConfigError
            An unknown name (with the closest known one), a bad preset file, or bad overrides.
        """
        from kvpolicy import preset_source

        config = overrides.pop("config", None)
        source = preset_source.resolve(name)
        cache = cls.from_spec(specs.CacheSpec.from_source(source, **overrides), config)
        cache.preset = source
        return cache

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._outside()
        if layer_idx == 0 and self.layer_bits and self.layers and self.layers[0].is_initialized:
            # a second forward: every layer of the model has been seen, so the map can be checked
            missing = sorted(i for i in self.layer_bits if i >= len(self.layers))
            if missing:
                raise ConfigError(
                    f"layer_bits names layer(s) {missing}, but the model has {len(self.layers)} layers; the widths "
                    "given for them were never used"
                )
        if self._saved_layers is not None and layer_idx >= self._saved_layers:
            raise CacheFileError(
                f"this CompressedCache was loaded from a file of {self._saved_layers} layers, and the model updates "
                f"layer {layer_idx}: the model has more layers than the one the cache was saved from (pass model= to "
                "CompressedCache.load to check a model against the file)"
            )
        if not self.layers and self._layer_types is None:
            # the first update of a cache built without config=: the model's attention module is the caller
            config = _caller_config()
            self.check_model_config(config, f"{getattr(config, 'model_type', 'transformers')} model")
        while len(self.layers) <= layer_idx:
            self.layers.append(self._new_layer(len(self.layers)))
        compresses = self.composition.action.compresses
        if self._watched is None and compresses and isinstance(self.layers[layer_idx], CompressedLayer):
            self._watched = layer_idx
        layer = self.layers[layer_idx]
        step = None
        if self._mask is not None and compresses and isinstance(layer, CompressedLayer):
            step = kwargs[MASK_KWARG] = self._columns(layer.get_seq_length(), key_states)
        if layer_idx == self._watched:  # once per forward; padding columns are the layers' to judge
            real = None if step is None or not step.padded else step.columns
            self._continuation.step(_position_ids(kwargs), layer.get_seq_length(), real)
        if self._unreleased:
            self._release_before(layer_idx)
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if key_states.shape[-2] > 1 and isinstance(layer, CompressedLayer) and layer.engine.pending:
            self._unreleased.append(layer_idx)
        return out

    def note_attention_mask(self, attention_mask: torch.Tensor | None) -> None:
        """The 2-D attention mask ``(batch, past + n)`` of the forward about to run (1: a token, 0: padding), from
        which the compressed layers read which columns are padding in that forward (``None``: no mask; a 4-D
        mask is the model's own business and is not read). Without it, padding is read from the positions
        transformers passes to ``update``, which cannot tell every layout apart (see :mod:`kvpolicy.layer.padding`).

        The forward hook of :func:`kvpolicy.attention.enable_scores` and :func:`kvpolicy.fused.enable_fused` calls
        this before every forward, and :func:`kvpolicy.prefill.chunked_prefill` before every chunk; the mask is
        forgotten when the forward has returned (:meth:`release_forward`). A cache that does not compress
        (``action="none"``) serves any padding, as ``DynamicCache`` does, and reads no mask.

        Raises
        ------
        ConfigError
            If ``attention_mask`` is neither ``None`` nor a tensor.
        """
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
            raise ConfigError(
                f"note_attention_mask takes the forward's attention mask (a (batch, past + n) tensor) or None; got "
                f"{type(attention_mask).__name__}"
            )
        self._mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
        self._step_mask = None

    def demote_ahead(self, new_tokens: int) -> None:
        """The forward about to run appends ``new_tokens`` tokens to every layer: apply now the demotions those
        appends would apply, so that the forward itself changes no layout. Only a decode step (one token) of a
        policy that needs no scores is taken ahead (:meth:`kvpolicy.layer.held.HeldTokens.demote_ahead`); the
        logits are the same either way.

        The forward pre-hook that :func:`kvpolicy.fused.enable_fused` and :func:`kvpolicy.attention.enable_scores`
        install calls this before every forward, and :meth:`get_mask_sizes` calls it for a one-token forward
        (the model asks it before its layers run). Under ``torch.compile`` it keeps the eager demotion out of
        the layers: a step that demotes breaks the graph in the hook, before the model's forward, which then
        still compiles as one graph (see :attr:`compiles`). A layer that was not told ahead (no hook, and a
        model that asks no mask sizes) demotes in its update, as before.
        """
        self._outside()
        if new_tokens != 1 or not self.action.compresses:
            return
        for layer in self.layers:
            if isinstance(layer, CompressedLayer):
                layer.engine.demote_ahead(new_tokens)

    def _columns(self, past: int, key_states: torch.Tensor) -> StepMask:
        """This step's columns of the noted attention mask (computed once per forward: every compressed layer
        of it holds ``past`` tokens and adds ``n``)."""
        n = key_states.shape[-2]
        if self._step_mask is not None and self._step_mask[:2] == (past, n):
            return self._step_mask[2]
        mask = self._mask
        assert mask is not None
        if tuple(mask.shape) != (key_states.shape[0], past + n):
            raise ValueError(
                f"CompressedCache: the attention mask of this forward is {tuple(mask.shape)}, but the cache holds "
                f"{past} tokens of a batch of {key_states.shape[0]} and this step adds {n}: a mask for this forward "
                f"is ({key_states.shape[0]}, {past + n}), one column per token held and given"
            )
        columns = mask[:, past:].to(device=key_states.device, dtype=torch.bool)
        if torch.compiler.is_compiling():
            # a compiled step reads no tensor value into Python: padding that appears in it fails when it runs
            torch._assert_async(columns.all(), COMPILED_PADDING)
            step = StepMask(columns, False)
        else:
            step = StepMask(columns, not bool(columns.all()))
        self._step_mask = (past, n, step)
        return step

    def __iter__(self) -> Iterator[tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]]:
        """Each layer's history as ``DynamicCache`` iterates its own: ``(keys, values, sliding_window)``, keys and
        values ``(batch, kv_heads, tokens, head_dim)`` in position order, ``sliding_window`` a 0-d tensor for a
        sliding layer left to transformers (else ``None``); ``(None, None, None)`` for a layer that holds nothing
        (or no keys, such as a linear-attention layer). A compressed layer's history is materialised as attention
        reads it (its demoted tokens dequantized, a tensor of the whole length), so ``DynamicCache(iter(cache))``
        holds what this cache attends over (exactly its tokens with ``action="none"``).

        Raises
        ------
        ValueError
            For a layer that evicted tokens: its keys no longer stand for every position, and no history of the
            cache's length can be given (read ``cache.positions(i)`` and the layer instead).
        """
        self._outside()
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, CompressedLayer):
                keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
                yield keys, values, getattr(layer, "_sliding_window_tensor", None)
                continue
            if not layer.is_initialized:
                yield None, None, None
                continue
            keys, values = layer.attention_view("ordered")
            if keys.shape[-2] != layer.get_seq_length():
                raise ValueError(
                    f"CompressedCache: layer {i} holds {keys.shape[-2]} of its {layer.get_seq_length()} tokens "
                    f"(action {layer.engine.action.name!r} evicted the others), so its keys and values cannot stand "
                    "for the history DynamicCache would iterate; read cache.positions(i) and the layer's keys instead"
                )
            yield keys, values, None

    def _outside(self) -> None:
        """Before a call that may change what the cache holds: remember a call under ``torch.inference_mode()``, and
        on the first call outside it after one, turn every inference tensor held into an ordinary one
        (:func:`kvpolicy.inference_tensors.normalize`), so that the step can update it in place or autograd can
        record it. Both directions work: a prefill in inference mode then decoding outside it, and the reverse.
        A step ``torch.compile`` traces reads no mode (the compiler does not trace it): its tensors are ordinary
        ones after any call made outside inference mode, and a compiled step only appends to them."""
        if torch.compiler.is_compiling():
            return
        if torch.is_inference_mode_enabled():
            self._inference = True
        elif self._inference:
            inference_tensors.normalize(self.layers, self.composition.book, self._continuation)
            self._inference = False

    #: transformers' flag of a cache of static shapes: ``generate`` then builds 4-d masks in every run, eager ones
    #: included, and compiles its forward by default on CUDA with CUDA graphs (one per shape). A compressed
    #: history grows by a token a step, as ``DynamicCache``'s does, and kvpolicy reads padding from the 2-d mask
    #: (``note_attention_mask``), so it stays False; :attr:`compiles` says whether the steps trace.
    is_compileable = False

    @property
    def compiles(self) -> bool:
        """Whether ``torch.compile`` can trace this cache's steps (compile the model's forward yourself, see the
        how-to "Compile the decode step"): True unless the policy reads attention scores or the transform
        observes queries, which a traced step cannot report (the compiler runs such a step eagerly). A decode
        step traces with no graph break: the forward pre-hook of :func:`kvpolicy.fused.enable_fused` applies a
        step's demotions eagerly before the forward (:meth:`demote_ahead`). A compiled ``forward`` called
        without the module's hooks demotes at :meth:`get_mask_sizes`, before the layers, and later steps run in
        a few pieces, the layers in one of them (the how-to "Compile the decode step" says more)."""
        if not self.action.compresses:
            return True
        return not self.policy.needs_scores and not self.transform.needs_queries

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """``(keys, offset)`` the next update of ``layer_idx`` attends over. The model asks this before its layers
        run, so a forward of one token (a decode step) is announced here too (:meth:`demote_ahead`, which the
        forward pre-hook calls earlier still): the step then demotes before the layers, also when the compiled
        ``forward`` is called without the module's hooks."""
        self._outside()
        if query_length == 1:
            self.demote_ahead(1)
        if layer_idx < len(self.layers) and isinstance(self.layers[layer_idx], CompressedLayer):
            refuse_empty(query_length, self.layers[layer_idx].get_seq_length())
        return super().get_mask_sizes(query_length, layer_idx)

    # the cache-wide state of the rows moves with them (each layer moves its own)
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._outside()
        super().reorder_cache(beam_idx)
        self._continuation.map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._outside()
        super().batch_select_indices(indices)
        self._continuation.map_rows(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._outside()
        super().batch_repeat_interleave(repeats)
        self._continuation.map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        self._outside()
        super().crop(tokens_to_remove)
        if tokens_to_remove < 0:
            self._continuation.crop(-tokens_to_remove)

    def reset(self) -> None:
        self._outside()
        super().reset()
        self._continuation.reset()

    def _release_before(self, layer_idx: int) -> None:
        """Demote the multi-token updates of the layers before ``layer_idx`` in this forward: their
        attention has run (:meth:`CompressedLayer.release`)."""
        waiting = []
        for i in self._unreleased:
            if i < layer_idx:
                self.layers[i].release()
            else:
                waiting.append(i)
        self._unreleased = waiting if layer_idx > 0 else []

    def release_forward(self) -> None:
        """The model's forward has returned: every layer's attention has read its multi-token update,
        so demote what each may demote now (:meth:`CompressedLayer.release`; the last tokens a ``crop``
        could remove stay at full precision). :func:`kvpolicy.fused.enable_fused` and
        :func:`kvpolicy.attention.enable_scores` install a forward hook that calls this, so that the last
        layer's prompt is not left to the first decode step; without it that step demotes it. It also forgets
        the attention mask noted for the forward (:meth:`note_attention_mask`). Calling it at any other time
        changes nothing that the next call would not do."""
        self._mask = self._step_mask = None
        if self._unreleased:
            self._release_before(len(self.layers))

    def check_model_config(self, config: Any, model_name: str = "model") -> None:
        """Warn, once per cache, when the model it serves has sliding-window or other non-full-attention
        layers and the cache was built without ``config=``: it then keeps and compresses those layers'
        whole history, holding far more bytes than transformers' sliding layers would (the model's
        sliding mask still limits what attention reads). Called on the first update of a cache built
        without ``config=``, with the config of the attention module that called ``update`` (transformers'
        attention modules hold their model's config), and after each forward by the hook that
        :func:`~kvpolicy.fused.enable_fused` and :func:`~kvpolicy.attention.enable_scores` install. A
        cache is given no model, so build it with :meth:`for_model`."""
        if self._config is not None or self._model_warned or not is_hybrid(config):
            return
        self._model_warned = True
        text = config.get_text_config(decoder=True)
        kinds = sorted({k for k in text.layer_types if k != "full_attention"})
        warnings.warn(
            f"CompressedCache: this {model_name} has {kinds} layers, and the cache was built without config=, so "
            "it keeps and compresses their whole history (transformers' own sliding layers keep only the window: "
            "fewer bytes). Build it "
            "with CompressedCache.for_model(model, ...) or pass config=model.config",
            stacklevel=2,
        )

    def positions(self, layer_idx: int) -> dict[str, torch.Tensor]:
        """``{"full": ..., "compressed": ..., "staged_keys": ...}`` for one layer (see
        :meth:`CompressedLayer.positions`)."""
        self._outside()
        if layer_idx >= len(self.layers):
            raise IndexError(f"layer_idx={layer_idx} but the cache holds {len(self.layers)} layers so far")
        layer = self.layers[layer_idx]
        if not isinstance(layer, CompressedLayer):
            raise ValueError(f"layer {layer_idx} is a {type(layer).__name__} (left to transformers), not compressed")
        return layer.positions()

    def attention_paths(self) -> dict[int, str | None]:
        """How each compressed layer's attention read its history on the latest step, and with which
        backend: ``"fused (<backend>)"`` (e.g. ``"fused (cpu)"``), ``"materialized (<backend>): <reason>"``
        (the history dequantized by that backend), ``"full-precision"`` (nothing compressed held) or
        ``None`` (no step yet)."""
        return {i: _described(layer) for i, layer in enumerate(self.layers) if isinstance(layer, CompressedLayer)}

    def memory_report(self) -> MemoryReport:
        """Bytes held (from the tensors actually held) vs a 16-bit cache of the same tokens. Layers left to
        transformers (sliding windows, linear-attention and convolution states, indexers...) count every tensor
        they hold as full precision, against a baseline of the same elements at 16 bits: a ``DynamicCache`` would
        hold them too."""
        self._outside()
        seen: set[tuple[str, int]] = set()  # positions shared by layers count once
        return MemoryReport([_layer_memory(layer, i, seen) for i, layer in enumerate(self.layers)])

    def save(self, path: str | Path, model: Any = None, codec: str | None = None) -> int:
        """Write this cache to ``path`` (one safetensors file with a JSON header; no pickle).

        The file holds the composition, the model's identity (architecture, layers, kv heads, head
        dims, dtype) and every layer's state: what :meth:`load` needs to continue generation with
        the same logits. Nothing is written when a part cannot be saved (the error says which).

        Parameters
        ----------
        path : str or Path
            The file to write (replaced atomically).
        model : PreTrainedModel or PretrainedConfig, optional
            The model the cache belongs to, to record its architecture (``config=`` given at
            construction is used otherwise); :meth:`load` checks a model against it.
        codec : str, optional
            Store each tensor coded by the file codec registered under this name where that makes it
            smaller (:class:`kvpolicy.persist.Codec`, from a plugin: the research plugin registers a
            lossless one). The loaded cache is bit-identical; loading needs the codec's plugin
            (without it the error names the plugin). Such a file is format version 2.

        Returns
        -------
        int
            The file's size in bytes (without a codec: within a few kB of
            ``memory_report().total_bytes`` plus what the policy state holds, e.g. H2O's scores).

        Raises
        ------
        ConfigError
            ``codec`` names no registered codec (nothing is written).
        ImportError
            The codec's dependencies are missing (nothing is written).
        """
        from kvpolicy import cache_io

        self._outside()
        return cache_io.save(self, path, model, codec)

    @classmethod
    def load(cls, path: str | Path, device: Any = None, model: Any = None) -> CompressedCache:
        """Read a cache :meth:`save` wrote, ready to continue generation.

        Parameters
        ----------
        path : str or Path
            The file.
        device : str, torch.device or mapping of int to device, optional
            Where its tensors go (default: CPU), or a device per layer index (a model split across
            devices with ``device_map``: give each layer the device of that layer's attention). A
            cache saved with ``backend="auto"`` picks the backend for each layer's device again; one
            saved with a named backend keeps it (and refuses a device that backend does not run on).
        model : PreTrainedModel or PretrainedConfig, optional
            Checked against the identity the file records; any difference (architecture, layer
            count, kv heads, head dim, dtype) is a :class:`~kvpolicy.errors.CacheFileError` naming it.

        Raises
        ------
        CacheFileError
            The file is missing, truncated, corrupted, of another format version, names parts that
            are not installed, or does not fit ``model``. Nothing is returned half-loaded.
        """
        from kvpolicy import cache_io

        return cache_io.load(cls, path, device, model)

    def __repr__(self) -> str:
        widths = f", layer_bits={self.layer_bits!r}" if self.layer_bits else ""
        adapted = f", adapted={list(self.adapted)!r}" if self.adapted else ""
        chosen = getattr(self.preset, "reason", None)
        preset = f", preset={chosen!r}" if chosen else ""
        return (
            f"CompressedCache(policy={self.policy!r}, action={self.action!r}, "
            f"backend={self.backend!r}, layout={self.layout!r}, attention={self.attention!r}{_transform_repr(self)}"
            f"{widths}{adapted}{preset})"
        )


def is_hybrid(config: Any) -> bool:
    """Whether a model config has layers that are not full attention (sliding windows: Gemma 2/3,
    Mistral-style configs with ``layer_types``): build caches for such a model with ``config=`` so
    that those layers stay transformers' own and only full-attention layers are compressed."""
    if config is None:
        return False
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return any(kind != "full_attention" for kind in getattr(text, "layer_types", None) or [])


def _transform_repr(cache: CompressedCache) -> str:
    """``", transform=..."`` when a transform is set (with why it is idle, if it is); empty for none."""
    if cache.transform.identity:
        return ""
    idle = ""
    if not cache.action.compresses or not cache.action.keeps_demoted:
        idle = f" [idle: action {cache.action.name!r} keeps no demoted tokens to transform]"
    return f", transform={cache.transform!r}{idle}"


def _caller_config(depth: int = 2) -> Any:
    """The ``config`` of the object whose method called :meth:`CompressedCache.update` (transformers'
    attention modules hold their model's config), or None. ``depth``: frames up from here, through
    ``update``, to that caller. Used once per cache, to warn about sliding-window layers
    (:meth:`CompressedCache.check_model_config`)."""
    try:
        frame = sys._getframe(depth)
    except ValueError:  # a shallower stack than expected
        return None
    return getattr(frame.f_locals.get("self"), "config", None)


def _num_layers(config: Any) -> int | None:
    """The model's layer count from its config (None without one)."""
    if config is None or not hasattr(config, "get_text_config"):
        return None
    count = getattr(config.get_text_config(decoder=True), "num_hidden_layers", None)
    return count if isinstance(count, int) else None


def _served(
    policy: Policy, action: Action, backend: Backend, auto: bool, attention: str, config: Any, adapted: dict[str, None]
) -> Action:
    """``action`` with the defaults ``backend`` cannot serve replaced (recorded in ``adapted``); with a config, the
    notes its head dim will cause are recorded now too (each layer replaces those at its first update, from the head
    dims of its own tensors)."""
    decided = plan(policy, action, backend, auto=auto, attention=attention)
    adapted.update(dict.fromkeys(decided.notes))
    head_dim = model_check.head_dim(config)
    if head_dim is not None:  # the notes the layers' first updates will add: shown from the start
        preview = plan(policy, decided.action, backend, auto=False, attention=attention, key_dim=head_dim,
                       value_dim=head_dim)  # fmt: skip
        adapted.update(dict.fromkeys(preview.notes))
    return decided.action
