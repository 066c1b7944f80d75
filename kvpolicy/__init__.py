"""kvpolicy: pluggable KV-cache compression for Hugging Face transformers.

Token-selection *policies* (which tokens matter), precision *actions* (quantize or keep the rest)
and *backends* (how bits are packed) are separate parts composed by :class:`CompressedCache`::

    from kvpolicy import CompressedCache
    cache = CompressedCache(policy="log", action="quantize", bits=2)   # LogQuant
    out = model.generate(**inputs, cache=cache, max_new_tokens=256)
    print(cache.memory_report())

The public names are imported lazily, so ``import kvpolicy.policies`` (pure logic) does not import
transformers; only :mod:`kvpolicy.cache` does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "CacheSpec": "kvpolicy.spec",
    "Codebook": "kvpolicy.formats.codebook",
    "MinMax": "kvpolicy.formats.packed",
    "CompressedCache": "kvpolicy.cache",
    "CompressedLayer": "kvpolicy.cache",
    "ConfigError": "kvpolicy.errors",
    "NonFiniteError": "kvpolicy.errors",
    "MetadataOverflowError": "kvpolicy.errors",
    "MissingDependencyError": "kvpolicy.errors",
    "PaddingError": "kvpolicy.errors",
    "LogWindow": "kvpolicy.policies.log",
    "MemoryReport": "kvpolicy.memory",
    "NoCompression": "kvpolicy.actions.none",
    "Evict": "kvpolicy.actions.evict",
    "RecentWindow": "kvpolicy.policies.recent",
    "SinkWindow": "kvpolicy.policies.sink",
    "Sinks": "kvpolicy.policies.sinks",
    "Tiered": "kvpolicy.actions.tiered",
    "boundary": "kvpolicy.layer_bits",
    "decode_mode": "kvpolicy.modes",
    "HeavyHitters": "kvpolicy.policies.h2o",
    "Quantize": "kvpolicy.actions.quantize",
    "TorchBackend": "kvpolicy.backends.torch_backend",
    "Hadamard": "kvpolicy.transforms.hadamard",
}

__all__ = [
    "CacheSpec",
    "Codebook",
    "CompressedCache",
    "CompressedLayer",
    "ConfigError",
    "Evict",
    "Hadamard",
    "HeavyHitters",
    "LogWindow",
    "MemoryReport",
    "MetadataOverflowError",
    "MinMax",
    "MissingDependencyError",
    "NoCompression",
    "NonFiniteError",
    "PaddingError",
    "Quantize",
    "RecentWindow",
    "SinkWindow",
    "Sinks",
    "Tiered",
    "TorchBackend",
    "__version__",
    "boundary",
    "decode_mode",
]

#: the evaluation and planning tools that moved to the kvpolicy-lab distribution: reading one here raises an
#: AttributeError saying where it is now (so ``hasattr(kvpolicy, "compare")`` is False, as for any other name)
_MOVED_TO_LAB = ("compare", "estimate")

if TYPE_CHECKING:
    from kvpolicy.actions.evict import Evict
    from kvpolicy.actions.none import NoCompression
    from kvpolicy.actions.quantize import Quantize
    from kvpolicy.actions.tiered import Tiered
    from kvpolicy.backends.torch_backend import TorchBackend
    from kvpolicy.cache import CompressedCache, CompressedLayer
    from kvpolicy.errors import (
        ConfigError,
        MetadataOverflowError,
        MissingDependencyError,
        NonFiniteError,
        PaddingError,
    )
    from kvpolicy.formats.codebook import Codebook
    from kvpolicy.formats.packed import MinMax
    from kvpolicy.layer_bits import boundary
    from kvpolicy.memory import MemoryReport
    from kvpolicy.modes import decode_mode
    from kvpolicy.policies.h2o import HeavyHitters
    from kvpolicy.policies.log import LogWindow
    from kvpolicy.policies.recent import RecentWindow
    from kvpolicy.policies.sink import SinkWindow
    from kvpolicy.policies.sinks import Sinks
    from kvpolicy.spec import CacheSpec
    from kvpolicy.transforms.hadamard import Hadamard


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _MOVED_TO_LAB:
        from kvpolicy.errors import LAB_INSTALL, LAB_PACKAGE

        raise AttributeError(
            f"kvpolicy.{name} moved to the {LAB_PACKAGE} package: from kvpolicy_lab import {name}, after {LAB_INSTALL}"
        )
    raise AttributeError(f"module 'kvpolicy' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public API only (:data:`__all__`): not the module's own imports (``importlib``, ``Any``...)."""
    return sorted(set(__all__) | set(_EXPORTS))
