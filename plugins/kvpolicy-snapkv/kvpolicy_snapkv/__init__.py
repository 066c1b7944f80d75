"""SnapKV as a kvpolicy policy plugin: ``CompressedCache(policy="snapkv", ...)`` once installed."""

from __future__ import annotations

from kvpolicy_snapkv.policy import SnapKV, SnapKVState

__version__ = "0.1.0"
__all__ = ["SnapKV", "SnapKVState", "__version__"]
