"""The policy contract: which tokens stay at full precision.

A :class:`Policy` is an immutable, validated set of hyperparameters. ``policy.new_state(num_heads)``
gives the per-layer state machine (:class:`PolicyState`) that the cache drives: each step it is
told how many tokens arrived and answers with the positions that leave the full-precision set now.
Demotion is final. Policies are pure logic over integer positions (and, for score-based policies,
attention scores): they never import transformers.

Two shapes of answer exist:

- shared policies (``per_head = False``: log, recent, sink) select the same positions for every
  layer row, head and batch row: ``append`` returns a ``list[int]`` and ``full_positions`` a sorted
  ``list[int]``;
- per-head policies (``per_head = True``: H2O) select per kv-head, with the same count in every
  head: ``append`` returns a ``(num_heads, k)`` int64 tensor and ``full_positions`` a
  ``(num_heads, n)`` int64 tensor sorted along each row.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from kvpolicy.errors import ConfigError

if TYPE_CHECKING:
    import torch

#: the longest length a restored state may claim (positions are held as int32: :mod:`kvpolicy.positions`)
_MAX_LENGTH = 2**31 - 1


class PolicyState(ABC):
    """Per-layer selection state."""

    #: number of positions appended so far (the logical length ``T``)
    length: int = 0
    #: attributes set from the policy's parameters (and the head count) that appends never change:
    #: :meth:`load_state_dict` compares a saved state's values with them and never restores them
    fixed: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def append(self, n: int) -> list[int] | torch.Tensor:
        """Append ``n`` positions (``length .. length + n - 1``).

        For data-independent policies this behaves exactly as ``n`` single-position appends.
        The first call is the prompt (prefill); policies may treat it specially (``recent`` with
        ``variant="flush"``).

        Returns
        -------
        list of int or torch.Tensor
            Positions demoted by these appends, in demotion order (per-head policies: a
            ``(num_heads, k)`` tensor).
        """

    @abstractmethod
    def full_positions(self) -> list[int] | torch.Tensor:
        """Positions currently at full precision, sorted ascending (per head for per-head policies)."""

    def full_count_after(self, n: int) -> int:
        """How many positions will be at full precision after appending ``n`` more (per head).

        The cache uses it to announce the number of keys of the next step to transformers' mask
        code before the step runs. The default replays ``append`` on a copy of the state.
        """
        import copy

        probe = copy.deepcopy(self)
        probe.append(n)
        full = probe.full_positions()
        return len(full) if isinstance(full, list) else int(full.shape[-1])

    def state_dict(self) -> dict[str, Any]:
        """This state as JSON values and tensors, for :meth:`kvpolicy.CompressedCache.save`.

        The default takes the instance's attributes: ints, floats, bools, strings, ``None``, lists of
        those and tensors are saved; a :class:`Policy` or a function held as an attribute is not
        (``new_state`` gives it back). A state holding anything else must override this and :meth:`load_state_dict`.
        """
        out: dict[str, Any] = {}
        for name, value in vars(self).items():
            if isinstance(value, Policy) or callable(value):
                continue  # given back by new_state (a function set on the instance is behaviour, not state)
            if not _plain(value):
                raise TypeError(
                    f"{type(self).__name__}.{name} is a {type(value).__name__}; the default state_dict() saves "
                    "ints, floats, bools, strings, None, lists of those and tensors. Override state_dict() and "
                    "load_state_dict() to save this policy's state."
                )
            out[name] = list(value) if isinstance(value, (list, tuple)) else value
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned into a fresh state from ``policy.new_state``.

        A saved state is untrusted input. Only attributes the fresh state has are set; any other name
        is an error (a file of another policy or version). The attributes named in :attr:`fixed`
        come from the policy's parameters: a saved value must equal the fresh one and is never
        restored. Every other value must be of the fresh value's kind (an int for an int, a tensor of
        the same dtype and leading sizes for a tensor, ...). :meth:`validate` then checks the whole.
        """
        own = vars(self)
        if not isinstance(state, dict):
            raise ValueError(f"{type(self).__name__}: a saved state is a mapping; got a {type(state).__name__}")
        unknown = sorted(set(state) - set(own))
        if unknown:
            raise ValueError(f"{type(self).__name__} has no attribute(s) {unknown} to restore; it has {sorted(own)}")
        for name, value in state.items():
            current = own[name]
            if name in self.fixed:
                if type(value) is not type(current) or value != current:
                    raise ValueError(
                        f"{type(self).__name__}.{name}: the saved state says {value!r:.40}, but the policy's "
                        f"parameters give {current!r:.40} (a state of another policy)"
                    )
                continue
            if isinstance(current, Policy) or not _plain(value) or not _same_kind(value, current):
                raise ValueError(
                    f"{type(self).__name__}.{name}: cannot restore {_kind(value)} where it holds {_kind(current)}"
                )
            setattr(self, name, value)
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` unless the restored attributes form a state this policy's own appends
        could reach (called by :meth:`load_state_dict`). The default checks ``length``; a state with
        more attributes checks them too (in range, consistent with each other and with ``length``),
        so that a saved file can never make :meth:`append` loop, index out of range or hold more than
        the policy's budget."""
        length = self.length
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= _MAX_LENGTH:
            raise ValueError(f"{type(self).__name__}.length={length!r:.40} is not a length in [0, {_MAX_LENGTH}]")

    def observe(self, scores: torch.Tensor, positions: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """Receive attention scores (only called when the policy ``needs_scores``).

        Parameters
        ----------
        scores : torch.Tensor
            ``(num_heads, m)`` float (under tensor parallelism, a shared policy's rows are every kv
            head of the model, gathered from all ranks in rank order, while ``num_heads`` given to
            ``new_state`` is the rank's own count): the attention probability mass each key received from the
            queries of the latest forward (only its last ``policy.score_queries`` queries when that
            is set), summed over batch rows and the query heads of the group.
        positions : torch.Tensor
            ``(num_heads, m)`` or ``(1, m)`` int64: the logical position of each scored key. Keys
            not yet appended (the tokens of the current forward) may be among them.
        """


class Policy(ABC):
    """Base class of token-selection policies (dataclass hyperparameters, validated on construction)."""

    #: registry name, e.g. ``"log"``
    name: ClassVar[str] = ""
    #: True if the selection differs per kv-head (then positions are ``(kv_heads, n)`` tensors)
    per_head: ClassVar[bool] = False
    #: True if the policy needs attention scores (H2O-like): see ``kvpolicy.attention``
    needs_scores: ClassVar[bool] = False
    #: True if telling the state of ``a`` then ``b`` new tokens demotes exactly what telling it of
    #: ``a + b`` at once does, in the same order (a selection that depends only on the length). A layer
    #: then demotes a long multi-token update as soon as attention has read it, keeping only the last
    #: tokens a ``crop`` could still remove (see ``kvpolicy.layer.held.CROP_WINDOW``); other policies that
    #: need no scores keep the whole update until the layer's next call.
    splits_appends: ClassVar[bool] = False
    #: with ``needs_scores``: report only the attention of the last ``score_queries`` query positions
    #: of each forward (``None``: all of them). SnapKV's observation window sets it; a subclass may
    #: define it as a property of its parameters. The count is the same for every head.
    score_queries: int | None = None

    @abstractmethod
    def new_state(self, num_heads: int = 1) -> PolicyState:
        """A fresh state machine for one layer with ``num_heads`` kv-heads."""


def _plain(value: object) -> bool:
    """Whether ``value`` is data a saved cache may hold: JSON scalars, lists of them, or a tensor."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(v is None or isinstance(v, (bool, int, float, str)) for v in value)
    import torch

    return isinstance(value, torch.Tensor)


def _same_kind(value: object, current: object) -> bool:
    """Whether a saved ``value`` may replace ``current`` (see :meth:`PolicyState.load_state_dict`)."""
    import torch

    if current is None:
        return True  # an attribute that starts empty (e.g. scores not seen yet) takes any plain value
    if isinstance(current, bool) or isinstance(value, bool):
        return type(value) is type(current)
    if isinstance(current, float):
        return isinstance(value, (int, float))
    if isinstance(current, (int, str)):
        return type(value) is type(current)
    if isinstance(current, (list, tuple)):
        return isinstance(value, (list, tuple))
    if isinstance(current, torch.Tensor):
        return (
            isinstance(value, torch.Tensor) and value.dtype == current.dtype and value.dim() == current.dim()
            and tuple(value.shape[:-1]) == tuple(current.shape[:-1])
        )  # fmt: skip
    return False


def _kind(value: object) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def check_int(name: str, value: object, minimum: int, owner: str) -> None:
    """Raise :class:`ConfigError` unless ``value`` is an ``int`` (not bool) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{owner}: {name} must be an integer >= {minimum}; got {name}={value!r}")


def check_choice(name: str, value: object, choices: tuple[str, ...], owner: str) -> None:
    """Raise :class:`ConfigError` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ConfigError(f"{owner}: {name} must be one of {list(choices)}; got {name}={value!r}")
