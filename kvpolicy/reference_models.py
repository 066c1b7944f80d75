"""The two reference models kvpolicy is measured on, by name and config, without their weights.

SmolLM2-135M-Instruct and Gemma-3-270M: the names every ``--model`` flag (``kvpolicy presets --for`` and the lab's
commands) accepts for them, and their configs as transformers builds them from their checkpoints.
Loading their weights is the lab's business (``kvpolicy_lab.eval.models``).
"""

from __future__ import annotations

from typing import Any

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_ALIASES = frozenset({SMOLLM2_NAME, "smollm2-135m-instruct", "smollm2"})
GEMMA3_NAME = "gemma3-270m"
GEMMA3_ALIASES = frozenset({GEMMA3_NAME, "gemma-3-270m", "gemma3"})

#: the built-in models' configs as transformers builds them from their checkpoints, keyword by keyword
#: (what a cache needs: layers, layer types, kv heads, head dims; the rest for a faithful config)
SMOLLM2_CONFIG: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)  # fmt: skip
GEMMA3_CONFIG: dict[str, Any] = dict(
    vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
    num_key_value_heads=1, head_dim=256, sliding_window=512, max_position_embeddings=32768, query_pre_attn_scalar=256,
    layer_types=[("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(18)],
    rope_parameters={
        "full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    },
    rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0,
)  # fmt: skip
