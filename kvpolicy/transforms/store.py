"""A demoted-token store held in a transform's basis (the stage between policy and action)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvpolicy.actions.base import Action, DemotedStore
from kvpolicy.transforms.base import Transform


def wrap(store: DemotedStore, transform: Transform, action: Action) -> DemotedStore:
    """``store`` behind ``transform``; the store itself when there is nothing to transform (the
    identity, or an action that keeps no demoted tokens)."""
    if transform.identity or not action.keeps_demoted:
        return store
    return TransformedStore(store, transform)


class TransformedStore(DemotedStore):
    """Forwards demoted tokens to the action's store in the transform's basis.

    ``add`` stores ``forward(keys)`` and ``forward(values)``; ``keys()``/``values()`` come back
    through ``inverse`` (the materialised path). ``attention_parts()`` (the fused path) stays in the
    transformed basis, which :attr:`basis` names: the reader rotates its query with ``forward`` and
    maps the attention output back with ``inverse`` (:func:`kvpolicy.fused.decode_attention`).
    Everything else (bytes, batch operations, the action's own inspection methods) is the inner
    store's.
    """

    def __init__(self, inner: DemotedStore, transform: Transform) -> None:
        self.inner = inner
        self.transform = transform
        self._dims: tuple[int, int] | None = None  # (key head_dim, value head_dim), from the first add
        self._device: torch.device | None = None

    @property
    def basis(self) -> Transform:  # type: ignore[override]
        return self.transform

    @property
    def positions(self) -> torch.Tensor:  # type: ignore[override]
        return self.inner.positions

    @positions.setter
    def positions(self, value: torch.Tensor) -> None:
        self.inner.positions = value

    def add(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        self.inner.add(self.transform.forward(keys), self.transform.forward(values), positions)
        if self._dims is None:
            self._dims, self._device = (keys.shape[-1], values.shape[-1]), keys.device

    def keys(self) -> torch.Tensor:
        return self.transform.inverse(self.inner.keys())

    def values(self) -> torch.Tensor:
        return self.transform.inverse(self.inner.values())

    def attention_parts(self) -> tuple[Any, Any]:
        """The inner store's parts, in the transformed basis (see :attr:`basis`)."""
        return self.inner.attention_parts()  # type: ignore[attr-defined]

    def nbytes(self) -> dict[str, int]:
        return self.inner.nbytes()

    def shared(self) -> list[tuple[str, torch.Tensor]]:
        """The inner store's, and the tensors the transform holds for this store's head dims
        (segment ``"transform"``)."""
        out = list(self.inner.shared())
        if self._dims is not None:
            for head_dim in sorted(set(self._dims)):
                out += [("transform", t) for t in self.transform.held(head_dim, self._device).values()]
        return out

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.inner.map_batch(fn)

    def state_dict(self) -> dict[str, Any]:
        """The inner store's state (the transform itself is rebuilt from the cache's composition)."""
        return {"inner": self.inner.state_dict(), "dims": None if self._dims is None else list(self._dims)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        if state["dims"] is not None:
            self._dims = (int(state["dims"][0]), int(state["dims"][1]))
            self._device = self.inner.positions.device

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        # the action's own extras (e.g. staged_key_positions); only reached for names not found here
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
