"""Shared fixtures: tiny randomly initialised models built in code, and teacher-forced decoding."""

from __future__ import annotations

import os

import pytest
import torch

from kvpolicy.eval.metrics import teacher_forced_logits  # noqa: F401 - re-exported for tests

os.environ.setdefault("KVPOLICY_DISABLE_PLUGIN_AUTOLOAD", "1")

FAMILIES = ("llama", "qwen2", "phi3", "mistral")
ATTN = ("sdpa", "eager")


def tiny_model(family: str, attn: str = "sdpa", layers: int = 2, seed: int = 0) -> torch.nn.Module:
    """A tiny random causal LM of ``family`` with head_dim 64 (so default group sizes fit)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = dict(
        vocab_size=96,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=layers,
        max_position_embeddings=32768,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "llama":
        cfg, cls = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=64, **common), LlamaForCausalLM
    elif family == "qwen2":
        cfg, cls = Qwen2Config(num_attention_heads=2, num_key_value_heads=1, **common), Qwen2ForCausalLM
    elif family == "phi3":
        cfg, cls = Phi3Config(num_attention_heads=2, num_key_value_heads=2, **common), Phi3ForCausalLM
    elif family == "mistral":
        cfg = MistralConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=None, **common)
        cls = MistralForCausalLM
    else:  # pragma: no cover
        raise ValueError(family)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    # random init gives near-uniform attention; sharpen it so compression errors are visible
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                p.mul_(4.0)
    return model


@pytest.fixture(scope="session")
def models():
    """Cache of tiny models by (family, attn)."""
    built: dict[tuple[str, str], torch.nn.Module] = {}

    def get(family: str, attn: str = "sdpa") -> torch.nn.Module:
        if (family, attn) not in built:
            built[(family, attn)] = tiny_model(family, attn)
        return built[(family, attn)]

    return get
