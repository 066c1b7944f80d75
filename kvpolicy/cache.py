"""The transformers adapter: the only module that knows transformers' ``Cache`` API.

``CompressedCache`` is a ``transformers.Cache`` whose per-layer objects (``CompressedLayer``) hold
two segments: full-precision tokens (the policy's set) and demoted tokens (the action's store),
each with the logical positions of its tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvpolicy import registry
from kvpolicy.actions.base import Action, DemotedStore
from kvpolicy.backends.base import Backend
from kvpolicy.errors import ConfigError
from kvpolicy.memory import LayerBytes, MemoryReport
from kvpolicy.policies.base import Policy, PolicyState

LAYOUTS = ("ordered", "agnostic")


class CompressedLayer(CacheLayerMixin):
    """One layer of a :class:`CompressedCache`.

    Holds a full-precision segment (``keys``/``values``: ``(batch, kv_heads, n_full, head_dim)``,
    positions ``full_positions``) and the action's store of demoted tokens.

    Contract with transformers:

    - ``get_seq_length()`` is the logical length (tokens seen), never a physical count;
    - ``get_mask_sizes(q)`` is ``(length + q, 0)``: ``update`` returns every token held, in
      position order (``layout="ordered"``) or demoted-then-full-precision (``"agnostic"``);
    - a single-token update (decode) demotes before returning, so the query at position ``T - 1``
      attends over ``FP(T)``; a multi-token update (prefill) returns the full-precision tokens
      first and demotes afterwards, so prefill attention always sees the uncompressed prompt.
    """

    is_sliding = False
    is_croppable = False

    def __init__(self, policy: Policy, action: Action, backend: Backend, layout: str, layer_idx: int) -> None:
        super().__init__()
        self.policy = policy
        self.action = action
        self.backend = backend
        self.layout = layout
        self.layer_idx = layer_idx
        self.length = 0
        self.state: PolicyState | None = None
        self.store: DemotedStore | None = None
        self.full_positions: torch.Tensor | None = None

    # ------------------------------------------------------------------ transformers API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.keys = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[3]))
        self.values = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[3]))
        if self.action.compresses:
            self.action.check_head_dim(key_states.shape[-1], self.backend.capabilities.group_size_multiple)
            self.backend.check_tensor(key_states)
            self.state = self.policy.new_state()
            self.store = self.action.new_store(self.backend, self.layer_idx)
            self.store.positions = self.store.positions.to(self.device)
            self.full_positions = torch.empty(0, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` (``(batch, kv_heads, n, head_dim)``) and return
        the keys and values attention must use, ``(batch, kv_heads, length, head_dim)``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        start = self.length
        self.length += n
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        if not self.action.compresses:
            return self.keys, self.values
        new_positions = torch.arange(start, start + n, device=self.device)
        self.full_positions = torch.cat([self.full_positions, new_positions])
        if n == 1:
            self._demote(n)
            return self._attention_view()
        out = self._attention_view()
        self._demote(n)
        return out

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = None
        self.length = 0
        self.state = None
        self.store = None
        self.full_positions = None
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            idx = beam_idx.to(self.device)
            self._map_batch(lambda t: t.index_select(0, idx))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._map_batch(lambda t: t[indices, ...])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "CompressedCache cannot be cropped yet (assisted decoding / rollback): demoted tokens cannot be "
            "restored to full precision. Use DynamicCache for assisted generation."
        )

    # ------------------------------------------------------------------ internals
    def _map_batch(self, fn: Any) -> None:
        self.keys = fn(self.keys)
        self.values = fn(self.values)
        if self.store is not None:
            self.store.map_batch(fn)

    def _demote(self, n: int) -> None:
        assert self.state is not None and self.store is not None and self.full_positions is not None
        demoted = self.state.append(n)
        if not demoted:
            return
        pos = torch.tensor(demoted, dtype=torch.long, device=self.device)
        idx = torch.searchsorted(self.full_positions, pos)
        keep = torch.ones(self.full_positions.numel(), dtype=torch.bool, device=self.device)
        keep[idx] = False
        self.store.add(self.keys[:, :, idx], self.values[:, :, idx], pos)
        self.keys = self.keys[:, :, keep]
        self.values = self.values[:, :, keep]
        self.full_positions = self.full_positions[keep]

    def _attention_view(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.store is not None
        if len(self.store) == 0:
            return self.keys, self.values
        dk, dv = self.store.keys(), self.store.values()
        if self.layout == "agnostic":
            return torch.cat([dk, self.keys], dim=-2), torch.cat([dv, self.values], dim=-2)
        b, h, _, d = self.keys.shape
        out_k = self.keys.new_empty((b, h, self.length, d))
        out_v = self.values.new_empty((b, h, self.length, self.values.shape[-1]))
        out_k.index_copy_(2, self.store.positions, dk)
        out_k.index_copy_(2, self.full_positions, self.keys)
        out_v.index_copy_(2, self.store.positions, dv)
        out_v.index_copy_(2, self.full_positions, self.values)
        return out_k, out_v

    # ------------------------------------------------------------------ inspection
    def positions(self) -> dict[str, torch.Tensor]:
        """Logical positions held at full precision and in compressed form (sorted 1-D int64).

        ``"staged_keys"`` lists demoted positions whose keys still wait, at full precision, for a
        complete per-channel group (they are also in ``"compressed"``).
        """
        device = self.device if self.is_initialized else "cpu"
        empty = torch.empty(0, dtype=torch.long, device=device)
        if self.store is None or self.full_positions is None:
            return {"full": torch.arange(self.length, device=device), "compressed": empty, "staged_keys": empty}
        staged = getattr(self.store, "staged_key_positions", lambda: empty)()
        return {
            "full": self.full_positions.clone(),
            "compressed": torch.sort(self.store.positions).values,
            "staged_keys": torch.sort(staged).values,
        }

    def memory(self) -> LayerBytes:
        """Bytes of every tensor this layer holds, by segment."""
        segments = dict.fromkeys(("full_precision", "codes", "scales", "zeros", "staging", "positions"), 0)
        baseline = 0
        if self.is_initialized:
            segments["full_precision"] = _nbytes(self.keys) + _nbytes(self.values)
            b, h, _, d = self.keys.shape
            baseline = self.length * b * h * (d + self.values.shape[-1]) * 2
            if self.full_positions is not None:
                segments["positions"] += _nbytes(self.full_positions)
            if self.store is not None:
                for role, n in self.store.nbytes().items():
                    segments[role] = segments.get(role, 0) + n
        return LayerBytes(self.layer_idx, self.length, segments, baseline)

    def __repr__(self) -> str:
        return f"CompressedLayer(layer_idx={self.layer_idx}, length={self.length})"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _param_names(obj_or_cls: Any) -> set[str]:
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


class CompressedCache(Cache):
    """A transformers ``Cache`` that compresses keys and values by policy x action x backend.

    Parameters
    ----------
    policy : str or Policy
        Which tokens stay at full precision; a registered name (``"log"``) or a policy object.
    action : str or Action
        What happens to the others: ``"quantize"``, or ``"none"`` (keep everything; equals
        ``DynamicCache`` bit for bit).
    backend : str or Backend
        How bits are packed (``"torch"``).
    layout : {"ordered", "agnostic"}
        ``"ordered"`` returns keys in position order (correct with any mask). ``"agnostic"``
        returns ``[demoted tokens, full-precision tokens]`` without reordering (LogQuant's
        position-agnostic trick): valid because every past token precedes every new token, so
        the causal mask is unchanged; not valid with padded batches.
    **params
        Hyperparameters of the policy, action or backend given by name when those are strings,
        e.g. ``window=64``, ``bits=2``, ``group_size=64``. A keyword no part accepts is an error.

    Examples
    --------
    >>> cache = CompressedCache(policy="log", window=64, action="quantize", bits=2)
    >>> out = model.generate(**inputs, cache=cache, max_new_tokens=64)  # doctest: +SKIP
    >>> print(cache.memory_report())  # doctest: +SKIP
    """

    def __init__(
        self,
        policy: str | Policy = "log",
        action: str | Action = "quantize",
        backend: str | Backend = "torch",
        layout: str = "ordered",
        **params: Any,
    ) -> None:
        parts = _compose({"policy": policy, "action": action, "backend": backend}, params)
        self.policy: Policy = parts["policy"]
        self.action: Action = parts["action"]
        self.backend: Backend = parts["backend"]
        if layout not in LAYOUTS:
            raise ConfigError(f"layout must be one of {list(LAYOUTS)}; got layout={layout!r}")
        self.layout = layout
        if self.action.compresses:
            self.action.check_backend(self.backend)
        super().__init__(layers=[])

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> CompressedCache:
        """Build a published method by name (``"logquant"``, ``"logquant-4bit"``...).

        ``overrides`` are the preset's own parameters (e.g. ``budget=128``) or cache keywords
        (e.g. ``layout="agnostic"``, ``backend="torch"``).
        """
        from kvpolicy.presets import preset_kwargs

        return cls(**preset_kwargs(name, **overrides))

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self.layers) <= layer_idx:
            self.layers.append(CompressedLayer(self.policy, self.action, self.backend, self.layout, len(self.layers)))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def positions(self, layer_idx: int) -> dict[str, torch.Tensor]:
        """``{"full": ..., "compressed": ..., "staged_keys": ...}`` for one layer (see
        :meth:`CompressedLayer.positions`)."""
        if layer_idx >= len(self.layers):
            raise IndexError(f"layer_idx={layer_idx} but the cache holds {len(self.layers)} layers so far")
        return self.layers[layer_idx].positions()

    def memory_report(self) -> MemoryReport:
        """Bytes held (from the tensors actually held) vs a 16-bit cache of the same tokens."""
        return MemoryReport([layer.memory() for layer in self.layers])

    def __repr__(self) -> str:
        return (
            f"CompressedCache(policy={self.policy!r}, action={self.action!r}, "
            f"backend={self.backend!r}, layout={self.layout!r})"
        )


_PARTS = (("policy", "policies", Policy), ("action", "actions", Action), ("backend", "backends", Backend))


def _compose(specs: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """Turn names or objects into objects, giving each keyword of ``params`` to the named part that
    accepts it. A keyword accepted by two named parts, by no part, or also set inside a given object,
    is an error."""
    pool = dict(params)  # never mutate the caller's dict
    classes: dict[str, type] = {}
    for role, kind, base in _PARTS:
        spec = specs[role]
        if isinstance(spec, base):
            continue
        if not isinstance(spec, str):
            raise ConfigError(
                f"{role} must be a registered name or a {base.__name__} object; got {role}={spec!r} "
                f"(registered {kind}: {registry.names(kind)})"
            )
        classes[role] = registry.get(kind, spec)
    owners: dict[str, list[str]] = {}
    for role, cls in classes.items():
        for key in _param_names(cls) & set(pool):
            owners.setdefault(key, []).append(f"{role}={specs[role]!r}")
    for key, parts in sorted(owners.items()):
        if len(parts) > 1:
            raise ConfigError(
                f"keyword {key}={pool[key]!r} is a parameter of {' and '.join(parts)}; "
                "pass those parts as objects to say which one it belongs to"
            )
    built: dict[str, Any] = {}
    for role, cls in classes.items():
        mine = {k: pool.pop(k) for k in sorted(_param_names(cls) & set(pool))}
        try:
            built[role] = cls(**mine)
        except TypeError as exc:
            raise ConfigError(f"{role} {specs[role]!r}: {exc}") from exc
    for role, _, _ in _PARTS:
        if role in built:
            continue
        spec = specs[role]
        clash = sorted(_param_names(spec) & set(pool))
        if clash:
            raise ConfigError(f"{clash} given both as keyword(s) and inside {role}={spec!r}; give each parameter once")
        built[role] = spec
    if pool:
        accepted = {role: sorted(_param_names(obj)) for role, obj in built.items()}
        raise ConfigError(f"unknown keyword(s) {sorted(pool)} for this composition; accepted: {accepted}")
    return built
