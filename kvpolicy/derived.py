"""A value derived from an object's state and kept beside it until that state is replaced.

A decode step reads the same store and the same blocks as the step before until a demotion (or a batch move,
a load) replaces them: what is derived from them (a store's parts, a block's checked kernel arguments) is
built once and read back while the objects it was built from are the very ones held.
"""

from __future__ import annotations

from typing import Any


class Derived:
    """``value``, derived from the objects ``sources`` (compared by identity: every change of a store or a
    block replaces the object changed, never mutates it).

    Slots only: the walks over an object's held state (the bytes a store holds, the tensors of each batch
    row, inference tensors) do not enter it, as it is no state of its owner: dropped, it is built again.
    """

    __slots__ = ("sources", "value")

    def __init__(self, sources: tuple[Any, ...], value: Any) -> None:
        self.sources = sources
        self.value = value
