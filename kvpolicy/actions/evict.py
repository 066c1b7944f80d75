"""The ``"evict"`` action: demoted tokens leave the cache (their bytes are freed)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvpolicy import state_check
from kvpolicy.actions.base import Action, DemotedStore
from kvpolicy.backends.base import Backend
from kvpolicy.positions import POSITION_DTYPE


@dataclass(frozen=True)
class Evict(Action):
    """Drop demoted tokens. Attention then sees only the policy's full-precision set.

    With eviction the number of keys attention sees is not the logical length: the cache reports
    the logical length through ``get_seq_length()`` (so RoPE positions of new tokens stay
    logical) and the number and offset of the keys it returns through ``get_mask_sizes()``.
    """

    name = "evict"
    keeps_demoted = False

    def new_store(self, backend: Backend, layer_idx: int) -> DemotedStore:
        return EvictedStore()


class EvictedStore(DemotedStore):
    """Holds nothing; counts what was evicted."""

    def __init__(self) -> None:
        self.positions = torch.empty(1, 0, dtype=POSITION_DTYPE)
        self.evicted = 0

    def add(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        self.evicted += positions.shape[-1]

    def keys(self) -> torch.Tensor:  # pragma: no cover - never read: nothing is kept
        raise RuntimeError("evicted tokens are not kept")

    def values(self) -> torch.Tensor:  # pragma: no cover
        raise RuntimeError("evicted tokens are not kept")

    def nbytes(self) -> dict[str, int]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"positions": self.positions, "evicted": self.evicted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state_check.entries(state, "evicted store", ("positions", "evicted"))
        self.positions = state_check.tensor(state["positions"], "evicted store positions", POSITION_DTYPE, (None, 0))
        self.evicted = state_check.integer(state["evicted"], "evicted")

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        return None
