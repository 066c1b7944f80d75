"""What one layer's composition can do on its device: the backend, and whether decode runs fused.

Decided once, at the layer's first update (from its tensors' device, dtype and head dims), by
:func:`plan`; the engine (:mod:`kvpolicy.layer.engine`) reads the frozen :class:`Plan`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpolicy.actions.base import Action
from kvpolicy.backends import auto as auto_backend
from kvpolicy.backends.base import Backend
from kvpolicy.policies.base import Policy


@dataclass(frozen=True)
class Plan:
    """What a layer's first update decided.

    Parameters
    ----------
    backend : Backend
        The backend that packs and reads the layer's store.
    action : Action
        The action, with the defaults the backend or the head dims cannot serve replaced.
    fused_reason : str or None
        Why decode steps cannot run fused (``None``: they can).
    notes : tuple of str
        The defaults replaced (``Action.serving``), for ``repr(cache)``.
    """

    backend: Backend
    action: Action
    fused_reason: str | None
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.backend, Backend):
            raise TypeError(f"Plan: backend must be a Backend; got backend={self.backend!r}")
        if not isinstance(self.action, Action):
            raise TypeError(f"Plan: action must be an Action; got action={self.action!r}")


def unfusable(policy: Policy, action: Action, backend: Backend) -> str | None:
    """Why decode attention of this composition cannot run fused (None: it can)."""
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


def plan(
    policy: Policy, action: Action, backend: Backend, auto: bool, attention: str, device: torch.device,
    dtype: torch.dtype, head_dims: tuple[int, int],
) -> Plan:  # fmt: skip
    """The backend for ``device``/``dtype`` (chosen again when ``auto`` and the given one cannot run
    there), the action served by it at ``head_dims`` (key, value), and why decode cannot run fused."""
    caps = backend.capabilities
    if auto and (device.type not in caps.devices or dtype not in caps.dtypes):
        backend = auto_backend.choose(action, device.type, dtype)
    notes: tuple[str, ...] = ()
    if action.compresses:
        action, served = action.serving(backend, *head_dims)
        notes = tuple(served)
    reason = unfusable(policy, action, backend) if attention != "materialized" else "attention='materialized'"
    return Plan(backend, action, reason, notes)
