"""The transform contract: an orthogonal change of basis of demoted keys and values.

A :class:`Transform` sits between the policy and the action. Tokens a policy demotes are
transformed (``forward``) before the action stores them, and whatever reads the store goes back
(``inverse``) or works in the transformed basis: attention scores are invariant under an orthogonal
map applied to both query and key (``q·k = (qR)·(kR)``), and an attention output over transformed
values is mapped back with ``inverse`` (``Σ p·v = (Σ p·vR) Rᵀ``). Backends never see a transform:
they quantize whatever they are given. Transforms know nothing about transformers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class Transform(ABC):
    """Base class of transforms (dataclass hyperparameters, validated on construction).

    A transform maps vectors of ``head_dim`` channels to vectors of the same size with an
    orthogonal map ``R`` (the same for every head, token and batch row of a layer):
    ``forward(x) = x R`` and ``inverse(y) = y Rᵀ``. The same parameters give the same ``R`` in
    every process (tensor-parallel ranks, saved caches). :func:`kvpolicy.testing.check_transform`
    checks this contract on any transform.
    """

    #: registry name, e.g. ``"hadamard"``
    name: ClassVar[str] = ""
    #: True for the ``"none"`` transform: the cache then skips the stage entirely
    identity: ClassVar[bool] = False
    #: whether the transform fits itself on the queries of the forwards before a layer's first demotion
    #: (reported by kvpolicy's attention wrapper, :func:`kvpolicy.attention.enable_scores`;
    #: :mod:`kvpolicy.transforms.query_weighted`). A transform that fits anything per layer (on those
    #: queries, or on the first demoted keys: :mod:`kvpolicy.transforms.lowrank`) also defines
    #: ``wrap_store(inner)``, which returns the store that holds the fit; ``forward`` alone is then not the
    #: whole transform
    needs_queries: ClassVar[bool] = False

    def check_head_dim(self, head_dim: int) -> None:  # noqa: B027 - optional hook
        """Raise :class:`~kvpolicy.errors.ConfigError` if vectors of ``head_dim`` channels cannot be
        transformed (checked on a layer's first update, for keys and for values)."""

    def check_key_head_dim(self, head_dim: int) -> None:  # noqa: B027 - optional hook
        """Raise :class:`~kvpolicy.errors.ConfigError` if keys of ``head_dim`` channels cannot be served
        (checked on a layer's first update, after :meth:`check_head_dim`; for what concerns keys alone)."""

    @abstractmethod
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x R``: ``(..., head_dim)`` in, the same shape and dtype out (computed in float32 or wider)."""

    @abstractmethod
    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """``y Rᵀ``, undoing :meth:`forward`: the same shape and dtype as ``y``."""

    def held(self, head_dim: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Tensors the transform keeps to serve ``head_dim`` on ``device`` (e.g. its matrix), by role.

        A cache's memory report counts each of them once, however many layers and caches share it.
        """
        return {}


@dataclass(frozen=True)
class NoTransform(Transform):
    """The identity (``transform="none"``, the default): demoted tokens are stored as they are."""

    name = "none"
    identity = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        return y
