"""``kvpolicy estimate``: the bytes a cache will hold after a prompt, from the model's config alone.

Prints, per preset and prompt length, the bits per element, the bytes held, the bytes of a 16-bit
``DynamicCache`` and their ratio (:func:`kvpolicy_lab.estimate`); with ``--memory``, the longest prompt each
preset and ``DynamicCache`` hold within a budget (:func:`kvpolicy_lab.capacity.longest_prompt`); with ``--plot``,
a drawing of bytes against prompt length. Only the model's config is read, as ``kvpolicy presets --for``
reads it (:func:`kvpolicy.commands._model.model_config`): the built-in models' configs are written in kvpolicy
(nothing is fetched), a local model folder's ``config.json`` or a ``.gguf`` file's metadata is read, and a hub
id's config comes from the local Hugging Face cache (``--online``: or the hub). No weights are loaded, no model
runs, and no code of a model folder's own runs (:mod:`kvpolicy.model_folder`).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from kvpolicy.commands._model import model_config
from kvpolicy.commands._parser import add_list
from kvpolicy.commands._types import DTYPES, dtype_name, model_name, positive_int, tokens
from kvpolicy.errors import ConfigError
from kvpolicy_lab.commands._types import memory_size, preset_name


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
    return _format(head, lines, markdown)


def prompt_length(text: str) -> int:
    """A token count (:func:`~kvpolicy.commands._types.tokens`) the estimate takes: 1 to
    :data:`kvpolicy_lab.estimation.MAX_TOKENS`."""
    from kvpolicy_lab.estimation import MAX_TOKENS

    return tokens(1, MAX_TOKENS)(text)


def fits_table(rows: list[tuple[str, Any]], dynamic: Any, markdown: bool = False) -> str:
    """The table of ``rows`` (``(cache, Fit)``): the longest prompt each cache holds within the budget, its
    ratio to ``dynamic`` (the DynamicCache's :class:`~kvpolicy_lab.capacity.Fit`) and the bytes held then."""
    from kvpolicy.memory import _human

    head = ["cache", "tokens", "x DynamicCache", "bytes held"]
    lines = []
    for name, fit in rows:
        if fit.unbounded:
            cells = [name, "any", "-", f"{_human(fit.bytes_held)} at most (stops growing)"]
        else:
            ratio = f"{fit.tokens / dynamic.tokens:.2f}x" if dynamic.tokens else "-"
            mark = "~" if fit.extrapolated else ""
            cells = [name, f"{mark}{fit.tokens:,}", ratio, _human(fit.bytes_held)]
        lines.append(cells)
    return _format(head, lines, markdown)


def _format(head: list[str], lines: list[list[str]], markdown: bool) -> str:
    """``head`` and ``lines`` as aligned text (numbers right-aligned) or a Markdown table."""
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
    ).rstrip()


def _run(args: argparse.Namespace) -> int:
    if args.tokens is None and args.memory is None:
        raise ConfigError(
            "give --tokens N [N...] (the bytes held after prompts of those lengths), --memory SIZE (the longest "
            "prompt that fits in SIZE), or both"
        )
    if args.plot is not None:
        from kvpolicy_lab.commands._bytes_plot import check_plot_file

        check_plot_file(args.plot)  # before any work: matplotlib installed, a file that can be written
    if not args.online:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a missing model fails in seconds, not after retries
    from kvpolicy import registry
    from kvpolicy.commands._progress import Progress
    from kvpolicy_lab.capacity import DYNAMIC, STEP, Curve, longest_prompt
    from kvpolicy_lab.estimation import _count, estimate

    config = model_config(args.model, args.online)
    presets = args.preset or registry.names("presets")
    shape = estimate(config, 1, presets[0], batch=args.batch, dtype=args.dtype)
    print(
        f"{args.model}: {shape.layers} layers ({len(shape.compressed_layers)} compressed), "
        f"{_count(shape.kv_heads, 'kv head')}, head_dim {shape.head_dim}; {args.dtype}, batch {args.batch}; after a "
        "prompt of each length (no decode tokens)"
    )
    total = len(presets) * len(args.tokens or []) + (len(presets) + 1 if args.memory else 0)
    progress = Progress(total or None, "estimating", enabled=not args.no_progress)
    try:
        curves = {name: Curve(config, name, batch=args.batch, dtype=args.dtype, on_probe=_probing(progress, name))
                  for name in [DYNAMIC, *presets]}  # fmt: skip
        rows = []
        for name in presets:
            for n in args.tokens or []:
                _probing(progress, name)(n)
                rows.append((name, estimate(config, n, name, batch=args.batch, dtype=args.dtype)))
                progress.advance()
        fits = {}
        if args.memory is not None:
            for name, curve in curves.items():
                fits[name] = longest_prompt(config, args.memory, curve)
                progress.advance()
    finally:
        progress.close()
    if rows:
        print()
        print(table(rows, args.markdown))
    if fits:
        from kvpolicy.memory import _human

        print(f"\nthe longest prompt whose cache fits in {_human(args.memory)} ({args.memory:,} bytes):\n")
        print(fits_table(list(fits.items()), fits[DYNAMIC], args.markdown))
        if any(f.extrapolated for f in fits.values()):
            print(f"\n~: past {3 * STEP:,} tokens, from exact estimates at every {STEP:,} tokens and the bytes "
                  "each step adds (kvpolicy_lab.capacity)")  # fmt: skip
    if args.plot is not None:
        from kvpolicy_lab.commands._bytes_plot import plot_bytes

        longest = max([*(args.tokens or []), *(f.tokens for f in fits.values() if not f.unbounded)], default=0)
        plot_bytes(curves, args.plot, max(longest, 2 * STEP), args.memory, f"{args.model}, {args.dtype}")
        print(f"\nplot written to {args.plot}")
    return 0


def _probing(progress: Any, name: str) -> Any:
    """The callback that shows the cache and the prompt length an estimate is made for."""
    return lambda n: progress.working_on(f"{name} at {n:,} tokens")


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``kvpolicy estimate`` to ``sub``."""
    p = sub.add_parser(
        "estimate",
        help="bytes a preset will hold for a model and prompt length, or the longest prompt that fits a memory "
        "budget (no model run)",
        description="Estimate, from the model's config alone, what a cache of each preset holds after a prompt of "
        "each length (--tokens): bits per element (every byte held, metadata and positions included, as "
        "memory_report counts them), bytes held, the bytes of a 16-bit DynamicCache and their ratio; or the "
        "longest prompt each preset and DynamicCache hold within a memory budget (--memory). Built-in models' "
        "configs are built in (nothing is fetched); no weights are loaded, no model runs, and no code from a model "
        "folder runs (a config that needs its own code is refused).",
    )  # fmt: skip
    p.add_argument("--model", type=model_name, required=True,
                   help="smollm2, gemma3-270m, tiny-<llama|qwen2|phi3|mistral>[-LAYERS], a local model folder or "
                   ".gguf file, or a hub id (its config, from the local Hugging Face cache unless "
                   "--online)")  # fmt: skip
    add_list(p, "--tokens", prompt_length, metavar="N",
             help="prompt lengths: 512, 2k, 8k, 128k (k = 1024)")  # fmt: skip
    p.add_argument("--memory", type=memory_size, metavar="SIZE",
                   help="a KV-cache budget (4GiB, 512MiB, 4GB): print the longest prompt each preset and "
                   "DynamicCache hold within it")  # fmt: skip
    add_list(p, "--preset", preset_name, default=None, metavar="NAME",
             help="presets, preset files shipped with kvpolicy or preset file paths (as CompressedCache.from_preset "
             "takes them; default: every registered preset)")  # fmt: skip
    p.add_argument("--dtype", type=dtype_name, default="float32", metavar="{" + ",".join(DTYPES) + "}",
                   help="dtype of the model's keys and values (float32, like every kvpolicy command; bfloat16 for "
                   "a model served in bfloat16)")  # fmt: skip
    p.add_argument("--batch", type=positive_int, default=1, help="batch rows, each holding the whole prompt")
    p.add_argument("--plot", type=Path, metavar="FILE",
                   help="also draw bytes held against prompt length for each preset and DynamicCache, on log axes, "
                   "to this image file (.png, .svg, .pdf)")  # fmt: skip
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    p.add_argument(
        "--no-progress", action="store_true", help="no progress bar (it shows when a run takes over a second)"
    )
    p.add_argument("--online", action="store_true", help="allow downloading a hub model's config")
    p.set_defaults(func=_run)
