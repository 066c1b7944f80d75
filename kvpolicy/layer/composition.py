"""What one layer is made of, held once, and how its first step resolves it.

- :class:`Composition` is a cache's parts (policy, action and its per-layer widths, backend, transform,
  layout, attention mode) with what its layers share (the position book, the notes of adapted defaults,
  the model's config). The cache builds it once; every layer's engine and held tokens read it by reference.
- :class:`Plan` is one layer's resolution of it, decided by :func:`plan` at the layer's first step: the
  backend for the tensors' device and dtype (chosen again under ``backend="auto"``), the action that backend
  and the head dims serve, and whether decode attention can run fused (or why not).
- :func:`choose_backend` is what ``backend="auto"`` stands for.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpolicy import registry
from kvpolicy.actions.base import Action
from kvpolicy.backends.base import Backend
from kvpolicy.errors import ConfigError
from kvpolicy.policies.base import Policy
from kvpolicy.positions import PositionBook
from kvpolicy.transforms.base import Transform


@dataclass(frozen=True, eq=False)
class Composition:
    """A cache's parts and what its layers share, built once by the cache and read by reference.

    Parameters
    ----------
    policy, action, backend, transform
        The parts (``action`` served by ``backend``; ``backend`` is ``"auto"``'s choice when ``auto``).
    layout : {"ordered", "agnostic"}
        The order of a materialised history (see ``CompressedCache``).
    attention : {"auto", "fused", "materialized"}
        How decode steps read the compressed history (see ``CompressedCache``).
    auto : bool
        The backend was chosen by ``backend="auto"``: a layer chooses again if its tensors need another.
    layer_actions : mapping of int to Action
        The actions of the layers whose widths differ from ``action``'s.
    config : object, optional
        The model's config the cache was given (the transform's bind context reads it).
    book : PositionBook
        Where a shared policy's demoted positions are held once for the cache's layers.
    adapted : dict
        The ordered set of notes of defaults replaced (:meth:`Action.serving`), filled by each layer's first step.
    """

    policy: Policy
    action: Action
    backend: Backend
    transform: Transform
    layout: str = "ordered"
    attention: str = "auto"
    auto: bool = False
    layer_actions: Mapping[int, Action] = field(default_factory=dict)
    config: Any = None
    book: PositionBook = field(default_factory=PositionBook)
    adapted: dict[str, None] = field(default_factory=dict)

    def action_at(self, layer_idx: int) -> Action:
        """The action of layer ``layer_idx`` (its own widths, else the cache's)."""
        return self.layer_actions.get(layer_idx, self.action)

    def plan(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> Plan:
        """Layer ``layer_idx``'s :class:`Plan` for its first tensors (``(batch, kv_heads, n, head_dim)``), its notes
        added to :attr:`adapted`."""
        decided = plan(
            self.policy, self.action_at(layer_idx), self.backend, auto=self.auto, attention=self.attention,
            device_type=key_states.device.type, dtype=key_states.dtype,
            key_dim=key_states.shape[-1], value_dim=value_states.shape[-1],
        )  # fmt: skip
        self.adapted.update(dict.fromkeys(decided.notes))
        return decided


class Composed:
    """What a layer's engines answer about its parts, read from the one :class:`Composition` and the layer's
    :class:`Plan` (never copied): ``policy``, and ``action`` and ``backend`` as planned (before the first step,
    the composition's for the layer). Reads for inspection and error messages; the step reads its plan directly.
    """

    composition: Composition
    plan: Plan | None
    layer_idx: int

    @property
    def policy(self) -> Policy:
        """The policy."""
        return self.composition.policy

    @property
    def action(self) -> Action:
        """The layer's action, as its backend and head dims serve it once planned."""
        return self.composition.action_at(self.layer_idx) if self.plan is None else self.plan.action

    @property
    def backend(self) -> Backend:
        """The layer's backend (under ``backend="auto"``, chosen again for its tensors once planned)."""
        return self.composition.backend if self.plan is None else self.plan.backend


@dataclass(frozen=True)
class Plan:
    """What one layer runs with, decided by :func:`plan`.

    Attributes
    ----------
    backend : Backend
        The backend that stores its demoted tokens.
    action : Action
        The layer's action with the defaults ``backend`` or the head dims cannot serve replaced.
    notes : tuple of str
        One note per replaced default (``repr(cache)`` shows them as ``adapted=[...]``).
    fused_reason : str or None
        Why a decode step cannot run fused (``None``: it can); see :mod:`kvpolicy.fused`.
    """

    backend: Backend
    action: Action
    notes: tuple[str, ...] = ()
    fused_reason: str | None = None


def plan(
    policy: Policy,
    action: Action,
    backend: Backend,
    *,
    auto: bool,
    attention: str,
    device_type: str | None = None,
    dtype: torch.dtype | None = None,
    key_dim: int | None = None,
    value_dim: int | None = None,
) -> Plan:
    """Decide, once, how a layer runs: the backend (chosen again where ``backend="auto"`` picked one that
    cannot take the layer's device or dtype), the action that backend and the head dims serve, and
    whether decode attention can run fused.

    Parameters
    ----------
    policy, action : Policy, Action
        The layer's parts (its action may be a per-layer width of the cache's).
    backend : Backend
        The backend chosen so far (at construction: :func:`choose_backend`'s, or the one named).
    auto : bool
        Whether ``backend`` was chosen by ``"auto"`` (only then is it chosen again).
    attention : {"auto", "fused", "materialized"}
        The cache's attention setting.
    device_type, dtype : str and torch.dtype, optional
        Where the layer's tensors are and their dtype (unknown before the first update).
    key_dim, value_dim : int, optional
        The layer's key and value head dims (unknown before the first update).
    """
    caps = backend.capabilities
    if auto and device_type is not None and (device_type not in caps.devices or dtype not in caps.dtypes):
        backend = choose_backend([action], device_type, dtype)
    notes: tuple[str, ...] = ()
    if action.compresses:
        action, notes = action.serving(backend, key_dim, value_dim)
    reason = "attention='materialized'" if attention == "materialized" else unfusable_reason(policy, action, backend)
    return Plan(backend, action, tuple(notes), reason)


def unfusable_reason(policy: Policy, action: Action, backend: Backend) -> str | None:
    """Why decode attention of this composition cannot run fused (``None``: it can)."""
    if not action.compresses:
        return f"action {action.name!r} does not compress"
    if not action.keeps_demoted:
        return None  # nothing is held besides the full-precision segment: the plain view is already cheap
    if not backend.capabilities.fused:
        return f"backend {backend.name!r} cannot attend over its blocks without dequantizing them"
    if policy.per_head:
        return f"policy {policy.name!r} selects per head"
    if policy.needs_scores:
        return f"policy {policy.name!r} needs attention scores over every key"
    return None


_failed: dict[str, str] = {}  # backend name -> why it could not be built in this process (warned once)


def serves(backend: Backend, action: Action, dtype: torch.dtype | None = None) -> bool:
    """Whether ``backend`` serves ``action`` (and tensors of ``dtype``, when given)."""
    try:
        action.check_backend(backend)
    except ConfigError:
        return False
    return dtype is None or dtype in backend.capabilities.dtypes


def choose_backend(
    actions: Sequence[Action], device_type: str | None = None, dtype: torch.dtype | None = None
) -> Backend:
    """The backend ``backend="auto"`` stands for: the fastest built-in backend that serves every action
    on the device.

    - CUDA: ``triton`` (fused decode attention in a kernel) when Triton is installed and the
      composition fits its capabilities, else ``torch``;
    - CPU: ``cpu`` (the C++ fused decode-attention kernel) when the composition fits it (keys per
      channel, values per token, 2, 3 or 4 bits) and the kernel builds. The first time in an
      environment it compiles (under a minute, announced on stderr); if it cannot build (no
      compiler, no ``ninja``, a failed build), ``torch`` with one warning saying why;
    - anything else: ``torch``.

    A composition the fast backend does not serve (8 bits, keys per token...) simply gets ``torch``:
    that is the choice ``auto`` stands for, and ``repr(cache)`` shows it.

    Parameters
    ----------
    actions : sequence of Action
        The cache's action first, then its per-layer widths' (each must fit the backend).
    device_type : str, optional
        ``"cuda"``, ``"cpu"``...; default: ``"cuda"`` when CUDA is available, else ``"cpu"``.
    dtype : torch.dtype, optional
        The tensors' dtype, when known.
    """
    action = actions[0]
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    fast = {"cuda": "triton", "cpu": "cpu"}.get(device_type)
    if action.compresses and action.keeps_demoted and fast is not None:  # eviction quantizes nothing
        cls = registry.get("backends", fast)
        unbuilt = cls.__new__(cls)
        if device_type in cls.capabilities.devices and all(serves(unbuilt, a, dtype) for a in actions):
            built = _build(fast)
            if built is not None and device_type in built.capabilities.devices:
                return built
    return registry.get("backends", "torch")()


def _build(name: str) -> Backend | None:
    """An instance of backend ``name``, or None (warning once) if it cannot be built here."""
    if name in _failed:
        return None
    try:
        return registry.get("backends", name)()
    except (ConfigError, ImportError, OSError) as exc:
        _failed[name] = str(exc).splitlines()[0]
        warnings.warn(
            f"backend='auto': the {name!r} backend is not available ({_failed[name]}); using 'torch' "
            "(pass backend='torch' to choose it explicitly and silence this)",
            stacklevel=5,
        )
        return None
