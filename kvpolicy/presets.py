"""Published methods as named compositions: ``CompressedCache.from_preset(name, **overrides)``.

A preset is a function returning the keyword arguments of :class:`~kvpolicy.cache.CompressedCache`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpolicy.actions.quantize import Quantize
from kvpolicy.errors import ConfigError
from kvpolicy.policies.base import check_int
from kvpolicy.policies.log import LogWindow


def logquant(budget: int = 128, bits: int = 2, group_size: int = 64) -> dict[str, Any]:
    """LogQuant as run in its paper (Chen et al., "LogQuant: Log-Distributed 2-Bit Quantization
    of KV Cache with Superior Accuracy Preservation", arXiv 2503.19950, ICLR 2025 SLLM workshop).

    ``budget`` reserved full-precision tokens give the window ``W = budget // 3`` (128 -> 42,
    192 -> 64, 256 -> 85); demoted keys and values are quantized to 2 bits with per-token groups
    of 64 channels (the paper's setting for both K and V; the library default instead groups keys
    per channel, which is more accurate).
    """
    check_int("budget", budget, 3, "preset 'logquant'")
    return {
        "policy": LogWindow(window=budget // 3),
        "action": Quantize(bits=bits, group_size=group_size, key_axis="token", value_axis="token"),
    }


def logquant_4bit(budget: int = 128, group_size: int = 64) -> dict[str, Any]:
    """LogQuant at 4 bits (same paper, arXiv 2503.19950): ``W = budget // 3``, per-token groups
    of 64 for K and V. The paper reports 4-bit KV caches as essentially lossless for both LogQuant
    and its KiVi baseline.
    """
    return logquant(budget=budget, bits=4, group_size=group_size)


BUILTIN_PRESETS: dict[str, Callable[..., dict[str, Any]]] = {
    "logquant": logquant,
    "logquant-4bit": logquant_4bit,
}


def preset_kwargs(name: str, **overrides: Any) -> dict[str, Any]:
    """Resolve a preset and apply ``overrides`` (preset parameters or cache keywords).

    Overrides that are parameters of the preset function go to it; the rest (e.g. ``backend``,
    ``layout``) are passed on to the cache and override what the preset returns.
    """
    import inspect

    from kvpolicy import registry

    fn = registry.get("presets", name)
    params = set(inspect.signature(fn).parameters)
    own = {k: v for k, v in overrides.items() if k in params}
    rest = {k: v for k, v in overrides.items() if k not in params}
    try:
        kwargs = fn(**own)
    except TypeError as exc:  # pragma: no cover - defensive
        raise ConfigError(f"preset {name!r}: {exc}") from exc
    kwargs.update(rest)
    return kwargs
