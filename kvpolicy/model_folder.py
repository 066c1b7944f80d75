"""A local model folder read as untrusted input, without running any of its code.

A model folder's ``config.json`` may name Python files of its own (``auto_map``) that transformers imports when
asked to trust them. kvpolicy never does: every config, model and tokenizer it loads is loaded with
``trust_remote_code=False``, and :func:`read_config` refuses, naming the code, a folder whose config cannot be
read without it (its ``model_type`` is not one transformers knows).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpolicy.errors import ConfigError

#: the largest config.json read (real ones are a few KiB)
MAX_CONFIG_BYTES = 4 << 20


def read_config(folder: str | Path) -> dict[str, Any]:
    """The ``config.json`` of ``folder`` as a dict, checked to be readable without the folder's own code.

    Parameters
    ----------
    folder : str or Path
        A local model folder.

    Returns
    -------
    dict

    Raises
    ------
    ConfigError
        The file is missing or malformed (:func:`kvpolicy.textfile.load_json`), is not a JSON object, or needs code
        of the folder's own to be read (:func:`custom_code`).
    """
    from kvpolicy import textfile

    path = Path(folder) / "config.json"
    data = textfile.load_json(path, "model config", MAX_CONFIG_BYTES)
    if not isinstance(data, dict):
        raise ConfigError(f"model config {str(path)!r} holds a JSON {type(data).__name__}, not an object of settings")
    code = custom_code(data)
    if code is not None:
        raise ConfigError(
            f"model {str(folder)!r}: its config.json needs the model's own code to be read ({code}); kvpolicy never "
            "runs code from a model folder (trust_remote_code=False): use a model whose model_type transformers knows"
        )
    return data


def custom_code(config: dict[str, Any]) -> str | None:
    """What code of its own a ``config.json`` asks transformers to run (``"auto_map AutoConfig ->
    'configuration_x.XConfig'"``), or ``None`` when transformers reads it with its own classes (no ``auto_map``,
    or a ``model_type`` transformers knows, whose classes it then uses)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    auto_map = config.get("auto_map")
    if not auto_map:
        return None
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return None
    if not isinstance(auto_map, dict):
        return f"auto_map {auto_map!r:.80}"
    name, ref = next(iter(auto_map.items()))
    ref = ref[0] if isinstance(ref, (list, tuple)) and ref else ref
    return f"auto_map {name} -> {ref!r:.80}"
