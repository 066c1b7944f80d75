"""Torch device names given by users (``--device``, ``device = ...``): checked before any model loads."""

from __future__ import annotations

from kvpolicy.errors import ConfigError, did_you_mean

#: device types the commands run on
DEVICE_TYPES = ("cpu", "cuda", "mps")
_ALLOWED = "cpu, cuda, cuda:N or mps"


def parse_device(name: str) -> str:
    """Check that ``name`` is a device of a supported type; whether it exists here is not checked.

    Parameters
    ----------
    name : str
        A torch device string such as ``"cpu"``, ``"cuda"`` or ``"cuda:1"``.

    Returns
    -------
    str
        ``name`` unchanged.

    Raises
    ------
    ConfigError
        ``name`` is not a torch device string, or not of a type in :data:`DEVICE_TYPES`.
    """
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        hint = did_you_mean(str(name).split(":")[0], DEVICE_TYPES)
        raise ConfigError(f"{name!r} is not a device{hint} (use {_ALLOWED})") from None
    if device.type not in DEVICE_TYPES:
        hint = did_you_mean(device.type, DEVICE_TYPES)
        raise ConfigError(f"device type {device.type!r} of {name!r} is not supported{hint} (use {_ALLOWED})")
    return name


def check_device(name: str) -> str:
    """:func:`parse_device`, and ``name`` exists on this machine (else a :class:`ConfigError` saying why)."""
    import torch

    device = torch.device(parse_device(name))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{name!r} is not available: torch.cuda.is_available() is False on this machine "
                f"(torch {torch.__version__}); use cpu"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(f"{name!r} does not exist: this machine has {count} CUDA device(s), cuda:0..{count - 1}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{name!r} is not available: torch.backends.mps.is_available() is False; use cpu")
    return name
