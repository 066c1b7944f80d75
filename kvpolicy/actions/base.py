"""The action contract: what happens to the tokens a policy lets go.

An :class:`Action` is a validated set of hyperparameters. For each layer it creates a
:class:`DemotedStore` that receives demoted tokens (keys, values and their positions, in demotion
order) and can give them back for attention. Actions own their storage rules; they use a backend
for bit packing and know nothing about transformers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvpolicy.backends.base import Backend
from kvpolicy.errors import ConfigError
from kvpolicy.layer.parts import Part

if TYPE_CHECKING:
    from kvpolicy.transforms.base import Transform


class DemotedStore(ABC):
    """Per-layer storage of demoted tokens, kept in demotion order.

    ``keys()`` and ``values()`` return tensors whose token order matches ``positions`` (the
    position of each stored token), so a cache can either scatter them back to position order or
    concatenate them as they are.
    """

    #: ``(1, n)`` (shared policies) or ``(kv_heads, n)`` (per-head policies) int32 positions of the
    #: stored tokens, in demotion (= storage) order
    positions: torch.Tensor

    def awaits_first_block(self) -> bool:
        """Whether the first block this store receives sets a statistic its later blocks share (a centred
        stream's centre): the layer then hands its first demotion whole, or hands it first to a fresh store of
        the same action whose statistics this one takes (:meth:`take_first_block`). Default: False."""
        return False

    def take_first_block(self, probe: DemotedStore) -> None:  # noqa: B027 - optional hook
        """Take the statistics ``probe`` (a fresh store of the same action, given the block this store is
        about to receive first) set from its first block, for the streams that still wait for theirs."""

    @abstractmethod
    def add(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Take demoted tokens.

        Parameters
        ----------
        keys, values : torch.Tensor
            ``(batch, kv_heads, n, head_dim)``, full precision.
        positions : torch.Tensor
            ``(1, n)`` or ``(kv_heads, n)`` int32, their logical positions, in demotion order.
        """

    @abstractmethod
    def keys(self) -> torch.Tensor:
        """``(batch, kv_heads, n_stored, head_dim)`` as attention sees them (e.g. dequantized)."""

    @abstractmethod
    def values(self) -> torch.Tensor:
        """``(batch, kv_heads, n_stored, head_dim)`` as attention sees them."""

    @abstractmethod
    def nbytes(self) -> dict[str, int]:
        """Bytes held by role (e.g. ``codes``, ``scales``, ``zeros``, ``staging``, ``positions``)."""

    @abstractmethod
    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-axis (dim 0) operation (beam reorder, select, repeat) to everything held per batch row:
        codes, staging, and any state kept for later blocks (a centre set before the first block, a fit, its
        coefficients). ``fn`` maps a ``(batch, ...)`` tensor to ``(batch', ...)``; a store whose tensors with a
        batch axis are not all mapped serves the moved rows another row's state
        (:func:`kvpolicy.testing.check_batch_operations` finds such a tensor by name)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything held, as JSON values and tensors (:meth:`kvpolicy.CompressedCache.save`).

        Optional: a store without it cannot be saved (the cache says so before writing anything)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not implement state_dict(), so a cache holding it cannot be saved"
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned into a fresh store from ``action.new_store``.

        ``state`` comes from a file and is untrusted: check its keys and the kinds of its values
        (:mod:`kvpolicy.state_check`) and raise ``ValueError`` naming what is wrong."""
        raise NotImplementedError(f"{type(self).__name__} does not implement load_state_dict()")

    def validate(self, keys: torch.Tensor, values: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """After :meth:`load_state_dict`: raise ``ValueError`` unless every tensor held fits the layer
        whose full-precision segment is ``keys``/``values`` (``(batch, kv_heads, n, head_dim)``: the
        batch, heads, head dims and dtype to match) and the counts agree (each stream holds
        ``len(self)`` tokens). ``positions`` themselves are checked by the caller (range, uniqueness,
        disjointness from the full-precision positions)."""

    def parts(self) -> list[Part]:
        """The stored tokens as parts for fused decode attention (:mod:`kvpolicy.layer.parts`), each with its
        tokens' positions, without materialising them where the store can avoid it.

        Default: the tokens of :meth:`keys` and :meth:`values` as one full-precision part (correct,
        not cheaper than materialising); a store with packed blocks returns them as they lie.
        """
        return [Part(self.keys(), self.values(), None, self.positions)]

    def staged_key_positions(self) -> torch.Tensor:
        """``(rows, k)`` positions whose keys wait at full precision inside the store (a quantizer's
        staging buffer); default: none."""
        return self.positions[:, :0]

    def staged_value_positions(self) -> torch.Tensor:
        """``(rows, k)`` positions whose values wait at full precision inside the store; default: none."""
        return self.positions[:, :0]

    def shared(self) -> list[tuple[str, torch.Tensor]]:
        """``(segment, tensor)`` for tensors other layers may hold too (counted once per memory
        report, by storage): the positions."""
        return [("positions", self.positions)]

    def __len__(self) -> int:
        return int(self.positions.shape[-1])


class Action(ABC):
    """Base class of actions (dataclass hyperparameters, validated on construction)."""

    #: registry name, e.g. ``"quantize"``
    name: ClassVar[str] = ""
    #: parameters that hold parts of their own, as parameter name -> registry kind: ``CacheSpec.resolve``
    #: builds the ``{"name": ..., **params}`` dicts given for them (a part never looks a name up itself)
    part_parameters: ClassVar[Mapping[str, str]] = {}
    #: parameters that take the name of a registered part, as parameter name -> registry kind:
    #: ``CacheSpec.resolve`` passes the class registered under the name (the part never imports the registry)
    name_parameters: ClassVar[Mapping[str, str]] = {}
    #: False for the ``"none"`` baseline: the cache then never runs the policy
    compresses: ClassVar[bool] = True
    #: False when demoted tokens leave the cache (eviction): attention sees fewer keys
    keeps_demoted: ClassVar[bool] = True

    def check_backend(self, backend: Backend) -> None:  # noqa: B027 - optional hook
        """Raise :class:`~kvpolicy.errors.ConfigError` if ``backend`` cannot serve this action."""

    def check_transform(self, transform: Transform) -> None:  # noqa: B027 - optional hook
        """Raise :class:`~kvpolicy.errors.ConfigError` if this action cannot store tokens in the basis
        ``transform`` gives them (e.g. a codebook built for rotated data, without a rotation)."""

    def check_head_dim(self, head_dim: int, multiple: int = 1, role: str | None = None) -> None:  # noqa: B027
        """Raise :class:`~kvpolicy.errors.ConfigError` if tensors with ``head_dim`` channels cannot be
        stored (checked on a layer's first update); ``multiple`` is the backend's group granularity,
        ``role`` ``"key"`` or ``"value"`` (``None``: both) the tensor kind. Optional hook."""

    def with_widths(self, key_bits: int, value_bits: int) -> Action:
        """This action with keys stored in ``key_bits`` and values in ``value_bits`` bits (a layer's own widths,
        ``layer_bits=``). Optional: an action without code widths refuses.

        Raises
        ------
        ConfigError
            If this action has no code widths.
        """
        raise ConfigError(f"layer_bits sets code widths; action {self.name!r} has none (use action='quantize')")

    def serving(
        self, backend: Backend, key_dim: int | None = None, value_dim: int | None = None
    ) -> tuple[Action, tuple[str, ...]]:
        """This action with each *default* that ``backend`` or the head dims cannot serve replaced by one
        that can, and a note per replacement (shown in ``repr(cache)`` as ``adapted=[...]``).

        Parameters given explicitly are never replaced: a value that cannot serve stays, and the
        ``check_*`` hooks refuse it. The base action has no such defaults.

        Parameters
        ----------
        backend : Backend
            The backend that will store the demoted tokens.
        key_dim, value_dim : int, optional
            The head dims of keys and values (``None``: not known yet).

        Returns
        -------
        action : Action
            ``self``, or a copy with the replaced defaults set explicitly.
        notes : tuple of str
            One line per replacement, naming the parameter, its new value and why.
        """
        return self, ()

    @abstractmethod
    def new_store(self, backend: Backend, layer_idx: int) -> DemotedStore:
        """A fresh store for one layer."""
