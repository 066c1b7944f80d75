"""The ``"none"`` action: keep every token at full precision (the uncompressed baseline)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpolicy.actions.base import Action, DemotedStore
from kvpolicy.backends.base import Backend


@dataclass(frozen=True)
class NoCompression(Action):
    """Keep everything at full precision; the cache then behaves exactly like ``DynamicCache``.

    The policy is not run at all, so ``cache.positions(l)["full"]`` is every position.
    """

    name = "none"
    compresses = False

    def new_store(self, backend: Backend, layer_idx: int) -> DemotedStore:
        raise RuntimeError("the 'none' action demotes nothing and has no store")
