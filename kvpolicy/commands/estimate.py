"""``kvpolicy estimate``: the bytes a cache will hold after a prompt, from the model's config alone.

Prints, per preset and prompt length, the bits per element, the bytes held, the bytes of a 16-bit
``DynamicCache`` and their ratio (:func:`kvpolicy.estimate`). Only the model's config is
read: the built-in models' configs are written here (nothing is fetched), a local model folder's
``config.json`` or a ``.gguf`` file's metadata is read, and a hub id's config comes from the local
Hugging Face cache (``--online``: or the hub). No weights are loaded and no model runs.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from kvpolicy.commands._parser import add_list
from kvpolicy.commands._types import DTYPES, dtype_name, model_name, positive_int
from kvpolicy.errors import ConfigError, did_you_mean


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

    path = Path(name).expanduser()
    try:
        if path.is_file() and path.suffix == ".gguf":
            return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        if path.is_dir():
            return AutoConfig.from_pretrained(str(path), local_files_only=True)
        if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
            raise ConfigError(f"model {name!r}: not a model folder (with config.json), a .gguf file or a hub id")
        return AutoConfig.from_pretrained(name, local_files_only=not online)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        if isinstance(exc, ConfigError):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        remedy = "" if online or path.exists() else " (a hub id not in the local cache needs --online)"
        raise ConfigError(f"model {name!r}: cannot read its config: {first}{remedy}") from None


def preset_name(text: str) -> str:
    """A registered preset (``kvpolicy list``); another name is refused with the closest one."""
    from kvpolicy import registry

    known = registry.names("presets")
    if text in known:
        return text
    hint = did_you_mean(text, known)
    raise argparse.ArgumentTypeError(f"unknown preset {text!r}{hint} (presets: {', '.join(known)})")


def token_count(text: str) -> int:
    """A prompt length in ``[1, MAX_TOKENS]``."""
    from kvpolicy.estimation import MAX_TOKENS

    value = positive_int(text)
    if value > MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"must be an integer in [1, {MAX_TOKENS}]; got {text!r}")
    return value


def table(rows: list[tuple[str, Any]], markdown: bool = False) -> str:
    """The table of ``rows`` (``(preset, Estimate)``): one line per preset and length.

    Columns are added for the bits per element with full-precision tensors counted at 16 bits (a
    float32 model) and for the compressed layers' own bits (when some layers are left uncompressed:
    sliding-window layers).
    """
    from kvpolicy.memory import _human

    hybrid = any(0 < len(e.compressed_layers) < e.layers for _, e in rows)
    wide = any(e.bits_per_element_16bit != e.bits_per_element for _, e in rows)
    head = ["preset", "tokens", "bits/element", "bytes held", "16-bit bytes", "ratio"]
    extra = (["bits at 16-bit"] if wide else []) + (["compressed layers' bits"] if hybrid else [])
    head[3:3] = extra
    lines = []
    for preset, e in rows:
        cells = [preset, str(e.tokens), f"{e.bits_per_element:.2f}", _human(e.total_bytes), _human(e.baseline_bytes),
                 f"{e.ratio:.2f}x"]  # fmt: skip
        more = ([f"{e.bits_per_element_16bit:.2f}"] if wide else []) + (
            [f"{e.compressed_bits_per_element:.2f}"] if hybrid else []
        )
        cells[3:3] = more
        lines.append(cells)
    if markdown:
        out = [
            "| " + " | ".join(head) + " |",
            "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|",
        ]
        return "\n".join(out + ["| " + " | ".join(cells) + " |" for cells in lines])
    widths = [max(len(c[i]) for c in [head, *lines]) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
        for cells in [head, *lines]
    )


def _run(args: argparse.Namespace) -> int:
    if not args.online:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a missing model fails in seconds, not after retries
    from kvpolicy import registry
    from kvpolicy.estimation import _count, estimate

    config = model_config(args.model, args.online)
    presets = args.preset or registry.names("presets")
    rows = [(p, e) for p in presets for e in estimate(config, args.tokens, p, batch=args.batch,
                                                      dtype=args.dtype)]  # fmt: skip
    first = rows[0][1]
    compressed = len(first.compressed_layers)
    print(
        f"{args.model}: {first.layers} layers ({compressed} compressed), {_count(first.kv_heads, 'kv head')}, head_dim "
        f"{first.head_dim}; {args.dtype}, batch {args.batch}; after a prompt of each length (no decode tokens)"
    )
    print()
    print(table(rows, args.markdown))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``kvpolicy estimate`` to ``sub``."""
    p = sub.add_parser(
        "estimate",
        help="bytes and bits per element a preset will hold for a model and prompt length (no model run)",
        description="Estimate, from the model's config alone, what a cache of each preset holds after a prompt of "
        "each length: bits per element (every byte held, metadata and positions included, as memory_report "
        "counts them), bytes held, the bytes of a 16-bit DynamicCache and their ratio. Built-in models' configs "
        "are built in (nothing is fetched); no weights are loaded and no model runs.",
    )  # fmt: skip
    p.add_argument("--model", type=model_name, required=True,
                   help="smollm2, gemma3-270m, tiny-<llama|qwen2|mistral>[-LAYERS], a local model folder or .gguf "
                   "file, or a hub id (its config, from the local Hugging Face cache unless --online)")  # fmt: skip
    add_list(p, "--tokens", token_count, required=True, metavar="N", help="prompt lengths")
    add_list(p, "--preset", preset_name, default=None, metavar="NAME",
             help="presets (CompressedCache.from_preset names; default: every registered preset)")  # fmt: skip
    p.add_argument("--dtype", type=dtype_name, default="bfloat16", metavar="{" + ",".join(DTYPES) + "}",
                   help="dtype of the model's keys and values")  # fmt: skip
    p.add_argument("--batch", type=positive_int, default=1, help="batch rows, each holding the whole prompt")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--online", action="store_true", help="allow downloading a hub model's config")
    p.set_defaults(func=_run)
