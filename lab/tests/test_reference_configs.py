"""The library's built-in reference model configs (``kvpolicy estimate --model smollm2``) against the
checkpoints the lab fetches, where they are cached."""

from __future__ import annotations

import pytest


def test_built_in_configs_are_the_models_own():
    """The configs written in the command agree with the checkpoints' (checked where they are cached: the
    Gemma-3 folder's config.json, the SmolLM2 GGUF's metadata)."""
    from transformers import AutoConfig

    from kvpolicy.commands._model import model_config
    from kvpolicy_lab.eval.models import default_cache_dir

    gemma_json = default_cache_dir() / "gemma3-270m" / "float32" / "config.json"
    smol_gguf = default_cache_dir() / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gemma_json.is_file() and not smol_gguf.is_file():
        pytest.skip("neither built-in model is cached here")
    if gemma_json.is_file():
        real, mine = AutoConfig.from_pretrained(str(gemma_json.parent), local_files_only=True), model_config("gemma3")
        for key in ("num_hidden_layers", "num_key_value_heads", "num_attention_heads", "head_dim", "hidden_size",
                    "sliding_window", "layer_types", "vocab_size", "max_position_embeddings"):  # fmt: skip
            assert getattr(mine, key) == getattr(real, key), key
    if smol_gguf.is_file():
        from gguf import GGUFReader

        fields = {k: f.contents() for k, f in GGUFReader(smol_gguf).fields.items() if k.startswith("llama.")}
        mine = model_config("smollm2")
        assert (mine.num_hidden_layers, mine.num_key_value_heads, mine.num_attention_heads, mine.hidden_size) == (
            fields["llama.block_count"], fields["llama.attention.head_count_kv"], fields["llama.attention.head_count"],
            fields["llama.embedding_length"],
        )  # fmt: skip
        assert mine.head_dim == fields["llama.rope.dimension_count"] == mine.hidden_size // mine.num_attention_heads
        assert mine.max_position_embeddings == fields["llama.context_length"]
        assert mine.vocab_size == fields["llama.vocab_size"]
        assert getattr(mine, "layer_types", None) in (None, ["full_attention"] * 30)
