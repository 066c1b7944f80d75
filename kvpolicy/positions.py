"""Compact storage of the logical positions a cache layer holds.

Positions are held as ``int32`` (:data:`POSITION_DTYPE`; a context of 2**31 tokens is refused) and
widened to ``int64`` only where torch indexes with them. Shared policies (``per_head = False``:
log, recent, sink) demote the same positions in every layer, so a :class:`PositionBook` lets the
layers of one cache hold one tensor of demoted positions between them instead of one each; memory
reports count a storage once (:func:`storage_bytes`).
"""

from __future__ import annotations

import weakref

import torch

from kvpolicy.errors import ConfigError

#: dtype of held positions
POSITION_DTYPE = torch.int32
MAX_POSITION = torch.iinfo(POSITION_DTYPE).max


def check_length(length: int) -> None:
    """Refuse a logical length whose positions :data:`POSITION_DTYPE` cannot hold."""
    if length > MAX_POSITION:
        raise ConfigError(
            f"CompressedCache holds positions as {POSITION_DTYPE}: a context of {length} tokens exceeds {MAX_POSITION}"
        )


class PositionBook:
    """The demoted positions of one cache's layers, held once where they agree.

    :meth:`intern` is given a layer's positions after each demotion and answers an equal tensor:
    a view of the longest sequence seen so far when the layer's positions are a prefix of it (or
    extend it, which then becomes the longest). Layers whose positions differ keep their own, so
    sharing never changes what a layer holds; it only changes how many copies exist. The book
    itself holds no tensor alive (a weak reference): what it shares is held, and counted, by the
    layers.
    """

    def __init__(self) -> None:
        self._held: weakref.ref[torch.Tensor] | None = None

    # copies (deepcopy, pickle) start with an empty book: a weak reference does not travel, and the
    # copied layers' positions keep whatever storage sharing the copy preserved
    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._held = None

    @property
    def held(self) -> torch.Tensor | None:
        return None if self._held is None else self._held()

    @held.setter
    def held(self, positions: torch.Tensor) -> None:
        self._held = weakref.ref(positions)

    def intern(self, positions: torch.Tensor) -> torch.Tensor:
        """``positions`` (``(rows, n)``), or an equal view of the shared tensor."""
        held = self.held
        if (
            held is None
            or held.device != positions.device
            or held.dtype != positions.dtype
            or held.shape[0] != positions.shape[0]
        ):
            self.held = positions
            return positions
        n, m = positions.shape[1], held.shape[1]
        if n <= m:
            view = held[:, :n]
            return view if torch.equal(view, positions) else positions
        if torch.equal(positions[:, :m], held):
            self.held = positions
        return positions


def storage_bytes(t: torch.Tensor, seen: set[tuple[str, int]] | None = None) -> int:
    """Bytes of the storage behind ``t`` (all of it: a view keeps its whole storage alive).

    With ``seen``, a storage already in it counts 0, and the storage is added to it.
    """
    storage = t.untyped_storage()
    key = (str(t.device), storage.data_ptr())
    if seen is not None:
        if key in seen and storage.data_ptr() != 0:
            return 0
        seen.add(key)
    return storage.nbytes()
