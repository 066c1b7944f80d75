"""The policy contract: which tokens stay at full precision.

A :class:`Policy` is an immutable, validated set of hyperparameters. ``policy.new_state()`` gives the
per-layer state machine (:class:`PolicyState`) that the cache drives: each step it is told how many
tokens arrived and answers with the positions that leave the full-precision set now. Demotion is
final. Policies are pure logic over integer positions: they never import transformers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from kvpolicy.errors import ConfigError


class PolicyState(ABC):
    """Per-layer selection state for one sequence layout (shared by all rows and heads)."""

    #: number of positions appended so far (the logical length ``T``)
    length: int = 0

    @abstractmethod
    def append(self, n: int) -> list[int]:
        """Append ``n`` positions (``length .. length + n - 1``).

        Behaves exactly as ``n`` single-position appends.

        Returns
        -------
        list of int
            Positions demoted by these appends, in demotion order.
        """

    @abstractmethod
    def full_positions(self) -> list[int]:
        """Positions currently at full precision, sorted ascending."""


class Policy(ABC):
    """Base class of token-selection policies (dataclass hyperparameters, validated on construction)."""

    #: registry name, e.g. ``"log"``
    name: ClassVar[str] = ""
    #: True if the selection differs per kv-head (then positions are ``(batch, kv_heads, n)``)
    per_head: ClassVar[bool] = False
    #: True if the policy needs attention scores (H2O-like)
    needs_scores: ClassVar[bool] = False

    @abstractmethod
    def new_state(self) -> PolicyState:
        """A fresh state machine for one layer."""


def check_int(name: str, value: object, minimum: int, owner: str) -> None:
    """Raise :class:`ConfigError` unless ``value`` is an ``int`` (not bool) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{owner}: {name} must be an integer >= {minimum}; got {name}={value!r}")
