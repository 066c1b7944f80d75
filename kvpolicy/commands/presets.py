"""``kvpolicy presets``: the model presets the installed distributions register, or with ``--for MODEL`` those
that suit one model (what ``CompressedCache.for_model(model, "auto")`` would build), each with its provider and
the measurement behind it."""

from __future__ import annotations

import argparse

from kvpolicy.commands._types import model_name

HELP = "the preset files registered for particular models, or (--for MODEL) the ones that suit a model"
DESCRIPTION = (
    "Lists the model presets: preset files that a distribution (kvpolicy or a plugin) registers for the models "
    "they won clearly on, with the distribution, the models (config model_type) and the measurement. With --for "
    "MODEL, only those that suit that model, read from its config alone (no weights, no model code), and what "
    "CompressedCache.for_model(model, 'auto') builds for it."
)


def _run(args: argparse.Namespace) -> int:
    from kvpolicy import model_presets, registry

    if args.model is None:
        found = [
            model_presets.Suggestion(name, entry, source) for name, entry, source in registry.entries("model_presets")
        ]
        if not found:
            print("no model presets are registered (plugins register them: pip install ./plugins/kvpolicy-research)")
        for suggestion in found:
            print(suggestion)
        return 0
    from kvpolicy.commands._model import model_config

    config = model_config(args.model, args.online)
    for suggestion in model_presets.suggest(config):
        print(suggestion)
    _, reason = model_presets.choose(config)
    print(f"for_model(model, 'auto') builds: {reason}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``kvpolicy presets`` to ``sub``."""
    p = sub.add_parser("presets", help=HELP, description=DESCRIPTION)
    p.add_argument(
        "--for", dest="model", metavar="MODEL", type=model_name,
        help="smollm2, gemma3-270m, tiny-<llama|qwen2|phi3|mistral>[-LAYERS], a model folder (its config.json), "
        "a .gguf file, or a hub id (its config, from the local Hugging Face cache unless --online)",
    )  # fmt: skip
    p.add_argument("--online", action="store_true", help="allow downloading a hub model's config")
    p.set_defaults(func=_run)
