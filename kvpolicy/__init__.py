"""kvpolicy: pluggable KV-cache compression for Hugging Face transformers.

Token-selection *policies* (which tokens matter), precision *actions* (quantize or keep the rest)
and *backends* (how bits are packed) are separate parts composed by :class:`CompressedCache`::

    from kvpolicy import CompressedCache
    cache = CompressedCache(policy="log", action="quantize", bits=2)   # LogQuant
    out = model.generate(**inputs, cache=cache, max_new_tokens=256)
    print(cache.memory_report())
"""

from kvpolicy.actions.none import NoCompression
from kvpolicy.actions.quantize import Quantize
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.cache import CompressedCache, CompressedLayer
from kvpolicy.errors import ConfigError, NonFiniteError
from kvpolicy.memory import MemoryReport
from kvpolicy.policies.log import LogWindow

__version__ = "0.1.0"

__all__ = [
    "CompressedCache",
    "CompressedLayer",
    "ConfigError",
    "LogWindow",
    "MemoryReport",
    "NoCompression",
    "NonFiniteError",
    "Quantize",
    "TorchBackend",
    "__version__",
]
