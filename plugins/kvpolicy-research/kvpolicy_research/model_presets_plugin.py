"""The entry point ``research-model-presets = "kvpolicy_research.model_presets_plugin"``.

The preset files in ``kvpolicy_research/model_presets/`` that won clearly on one model, registered for the
models they suit (``CompressedCache.for_model(model, "auto")``, ``kvpolicy presets --for MODEL``).
"""

from __future__ import annotations

from kvpolicy.hookspecs import hookimpl
from kvpolicy.model_presets import ModelPreset

#: the model presets this plugin ships, by name
MODEL_PRESETS = {
    "gemma3-3bit-qh": ModelPreset(
        model_types=("gemma3", "gemma3_text"),
        package="kvpolicy_research",
        file="model_presets/gemma3-3bit-qh.toml",
        evidence=(
            "Gemma-3-270M, 2k context, frontier texts: KL 0.0176 (top-1 96.3 %) at 3.32 bits per element, against "
            "0.0686 (91.6 %) at 3.31 for kvpolicy-3bit"
        ),
    ),
}


@hookimpl
def kvpolicy_register_model_presets() -> dict[str, ModelPreset]:
    return dict(MODEL_PRESETS)
