"""Tiny random models and a byte tokenizer, for smoke runs and tests (no hub, no download).

Random weights make generated text meaningless; what a smoke run checks is that every code path
runs and that the fidelity metrics compare a compressed cache with the uncompressed one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpolicy.errors import ConfigError

#: model names the ablation runner resolves to a tiny random model: ``tiny-<family>``
FAMILIES = ("llama", "qwen2", "mistral")
PREFIX = "tiny-"
#: families :func:`random_model` builds (the tests use phi3 too: its fused ``qkv_proj``)
MODEL_FAMILIES = ("llama", "qwen2", "phi3", "mistral")


class ByteTokenizer:
    """Text <-> ids through UTF-8 bytes folded into a small vocabulary (lossy, deterministic).

    Ids ``0, 1, 2`` are pad, bos and eos; byte ``b`` maps to ``3 + b % (vocab_size - 3)``. It has no
    chat template, so task prompts fall back to a plain ``User:``/``Assistant:`` layout.
    """

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    chat_template = None

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 4:
            raise ConfigError(f"ByteTokenizer: vocab_size must be >= 4; got vocab_size={vocab_size!r}")
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [3 + b % (self.vocab_size - 3) for b in text.encode("utf-8")]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            if i >= 3:
                out.append((i - 3) % 256)
            elif not skip_special_tokens:
                out.append(ord("?"))
        return out.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class TinySpec:
    """A tiny random model: ``family`` (llama, qwen2, mistral), ``layers``, ``seed``."""

    family: str = "llama"
    layers: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"tiny model: family must be one of {list(FAMILIES)}; got family={self.family!r}")
        if isinstance(self.layers, bool) or not isinstance(self.layers, int) or self.layers < 1:
            raise ConfigError(f"tiny model: layers must be an integer >= 1; got layers={self.layers!r}")


def random_model(family: str = "llama", layers: int = 2, seed: int = 0, attn: str = "sdpa") -> torch.nn.Module:
    """A tiny random causal LM of ``family`` (llama, qwen2, phi3, mistral): head_dim 64 (so default
    group sizes fit), vocabulary 96, ``layers`` layers, weights drawn after ``torch.manual_seed(seed)``.

    Query/key projections are scaled up (x4) so attention is peaked and compression errors are visible.
    """
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
    else:
        raise ConfigError(f"tiny model: family must be one of {list(MODEL_FAMILIES)}; got family={family!r}")
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                p.mul_(4.0)
    return model


def tiny_model(spec: TinySpec = TinySpec(), attn: str = "sdpa") -> tuple[torch.nn.Module, ByteTokenizer]:
    """:func:`random_model` of ``spec`` and a matching :class:`ByteTokenizer`."""
    model = random_model(spec.family, spec.layers, spec.seed, attn)
    return model, ByteTokenizer(model.config.vocab_size)


def parse_tiny(name: str) -> TinySpec | None:
    """``"tiny-llama"`` / ``"tiny-llama-4"`` (4 layers) -> :class:`TinySpec`; other names -> None."""
    if not name.startswith(PREFIX):
        return None
    parts = name[len(PREFIX) :].split("-")
    layers = 2
    if len(parts) == 2 and parts[1].isdigit():
        layers = int(parts[1])
    elif len(parts) != 1:
        raise ConfigError(f"tiny model name must look like 'tiny-llama' or 'tiny-llama-4'; got {name!r}")
    return TinySpec(family=parts[0], layers=layers)


def tiny_gemma3(layer_types: list[str] | None = None) -> torch.nn.Module:
    """Gemma-3's layout in miniature: 6 layers, 5 sliding (window 8) + 1 global (layer 5) unless
    ``layer_types`` says otherwise, 1 kv head of head_dim 64, QK-norm; seeded weights."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=6, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, sliding_window=8, max_position_embeddings=4096, query_pre_attn_scalar=64,
        layer_types=layer_types,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Gemma3ForCausalLM(cfg).eval()
