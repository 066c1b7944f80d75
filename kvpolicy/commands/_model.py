"""The config of a model as the commands' ``--model`` flags name it (:func:`~kvpolicy.commands._types.model_name`),
read without its weights and without running any code of a model folder's own (:mod:`kvpolicy.model_folder`):
``kvpolicy presets --for`` and the lab's ``kvpolicy estimate`` read it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpolicy.errors import ConfigError


def model_config(name: str, online: bool = False) -> Any:
    """The transformers config of a model as ``kvpolicy ablate --model`` names it, without its weights.

    Parameters
    ----------
    name : str
        ``smollm2`` (SmolLM2-135M-Instruct) or ``gemma3-270m`` (configs built in),
        ``tiny-<family>[-LAYERS]`` (the tiny random models), a local model folder, a local ``.gguf`` file
        (its metadata) or a hub id (its ``config.json``, from the local Hugging Face cache).
    online : bool, optional
        Let a hub id's config be downloaded when it is not in the local cache.

    Returns
    -------
    transformers.PretrainedConfig

    Raises
    ------
    ConfigError
        One line naming the model and why its config cannot be read.
    """
    from kvpolicy.reference_models import GEMMA3_ALIASES as GEMMA3
    from kvpolicy.reference_models import GEMMA3_CONFIG, SMOLLM2_CONFIG
    from kvpolicy.reference_models import SMOLLM2_ALIASES as SMOLLM2
    from kvpolicy.tiny import parse_tiny, random_model

    key = name.strip().lower()
    if key in SMOLLM2:
        from transformers import LlamaConfig

        return LlamaConfig(**SMOLLM2_CONFIG)
    if key in GEMMA3:
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(**GEMMA3_CONFIG)
    tiny = parse_tiny(name)
    if tiny is not None:
        return random_model(tiny.family, tiny.layers, tiny.seed).config
    from transformers import AutoConfig

    from kvpolicy.model_folder import read_config

    path = Path(name).expanduser()
    try:
        if path.is_file() and path.suffix == ".gguf":
            return AutoConfig.from_pretrained(
                str(path.parent), gguf_file=path.name, local_files_only=True, trust_remote_code=False
            )
        if path.is_dir():
            read_config(path)  # a malformed config, or one that needs the folder's own code, is refused here
            return AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
            raise ConfigError(f"model {name!r}: not a model folder (with config.json), a .gguf file or a hub id")
        return AutoConfig.from_pretrained(name, local_files_only=not online, trust_remote_code=False)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        if isinstance(exc, ConfigError):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if "custom code" in first:
            first = "it needs the model's own code to be read, and kvpolicy never runs it (trust_remote_code=False)"
        remedy = "" if online or path.exists() else " (a hub id not in the local cache needs --online)"
        raise ConfigError(f"model {name!r}: cannot read its config: {first}{remedy}") from None
