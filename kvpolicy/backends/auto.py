"""``backend="auto"``: the fastest built-in backend that serves a composition on a device.

- CUDA: ``triton`` (fused decode attention in a kernel) when Triton is installed and the composition
  fits its capabilities, else ``torch``;
- CPU: ``cpu`` (the C++ fused decode-attention kernel) when the composition fits it (keys per
  channel, values per token, 2, 3 or 4 bits) and the kernel builds — the first time in an environment
  it compiles (under a minute, announced on stderr); if it cannot build (no compiler, no
  ``ninja``, a failed build), ``torch`` with one warning saying why;
- anything else: ``torch``.

A composition the fast backend does not serve (8 bits, keys per token...) simply gets ``torch``:
that is the choice ``auto`` stands for, and ``repr(cache)`` shows it. The choice is made when the
cache is built, for the device torch would use (CUDA when available), and made again for a layer
whose tensors turn out to be on another device or of a dtype the chosen backend does not take.
"""

from __future__ import annotations

import warnings

import torch

from kvpolicy import registry
from kvpolicy.actions.base import Action
from kvpolicy.backends.base import Backend
from kvpolicy.errors import ConfigError

AUTO = "auto"

_failed: dict[str, str] = {}  # backend name -> why it could not be built in this process (warned once)


def serves(backend: Backend, action: Action, dtype: torch.dtype | None = None) -> bool:
    """Whether ``backend`` serves ``action`` (and tensors of ``dtype``, when given)."""
    return _serves(backend, action, dtype)


def _serves(backend: Backend, action: Action, dtype: torch.dtype | None) -> bool:
    try:
        action.check_backend(backend)
    except ConfigError:
        return False
    return dtype is None or dtype in backend.capabilities.dtypes


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
            stacklevel=4,
        )
        return None


def choose(action: Action, device_type: str | None = None, dtype: torch.dtype | None = None) -> Backend:
    """The backend ``backend="auto"`` stands for.

    Parameters
    ----------
    action : Action
        The composition's action (its bits, axes and metadata dtype must fit the backend).
    device_type : str, optional
        ``"cuda"``, ``"cpu"``...; default: ``"cuda"`` when CUDA is available, else ``"cpu"``.
    dtype : torch.dtype, optional
        The tensors' dtype, when known.

    Returns
    -------
    Backend
        ``triton`` or ``cpu`` where they serve, else ``torch``.
    """
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    fast = {"cuda": "triton", "cpu": "cpu"}.get(device_type)
    if action.compresses and action.keeps_demoted and fast is not None:  # eviction quantizes nothing
        cls = registry.get("backends", fast)
        if device_type in cls.capabilities.devices and _serves(cls.__new__(cls), action, dtype):
            built = _build(fast)
            if built is not None and device_type in built.capabilities.devices:
                return built
    return registry.get("backends", "torch")()
