"""Checkpoint files loaded into a transformers model: a local GGUF file, de-quantised.

Shared by the SmolLM2 loader (:mod:`kvpolicy_lab.eval.models`) and the Gemma-3 loader (:mod:`kvpolicy_lab.eval.gemma`);
both hand it a checked, staged copy of their pinned file.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


def load_gguf_model(gguf_path: Path, dtype: torch.dtype, attn_implementation: str) -> PreTrainedModel:
    """Load a causal LM from a local GGUF file, de-quantised to ``dtype``.

    transformers' GGUF loading needs ``accelerate`` (the ``demo``/``eval``/``test`` extras).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import is_accelerate_available

    if not is_accelerate_available():
        raise ImportError("loading a GGUF checkpoint needs `accelerate` and `gguf`: pip install kvpolicy-lab")
    return AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent),
        gguf_file=gguf_path.name,
        dtype=dtype,
        attn_implementation=attn_implementation,
        local_files_only=True,
    )


__all__ = ["load_gguf_model"]
