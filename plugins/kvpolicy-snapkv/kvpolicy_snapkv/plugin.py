"""The entry point (``[project.entry-points."kvpolicy"] snapkv = "kvpolicy_snapkv.plugin"``).

kvpolicy imports this module on its first registry lookup and calls the hooks below; the policy
module is imported only when the hook runs.
"""

from __future__ import annotations

from typing import Any

from kvpolicy.hookspecs import hookimpl


@hookimpl
def kvpolicy_register_policies() -> dict[str, type]:
    from kvpolicy_snapkv.policy import SnapKV

    return {"snapkv": SnapKV}


@hookimpl
def kvpolicy_register_presets() -> dict[str, object]:
    return {"snapkv": snapkv_preset}


def snapkv_preset(capacity: int = 2016, window: int = 32, kernel_size: int = 5, pooling: str = "avg") -> dict[str, Any]:
    """SnapKV as released (Li et al., "SnapKV: LLM Knows What You are Looking for Before
    Generation", NeurIPS 2024, arXiv 2404.14469): ``capacity + window = 2048`` prompt tokens kept
    per head (the authors' default ``max_capacity_prompt``), the rest of the prompt evicted,
    generated tokens all kept. Needs attention scores: call
    :func:`kvpolicy.attention.enable_scores` on the model first.
    """
    from kvpolicy.actions.evict import Evict
    from kvpolicy_snapkv.policy import SnapKV

    return {
        "policy": SnapKV(capacity=capacity, window=window, kernel_size=kernel_size, pooling=pooling),
        "action": Evict(),
    }
