"""``kvpolicy analyze attention``: where the high-attention keys are, by distance from the query;
``kvpolicy analyze rotation``: whether a rotation helps this model's quantized keys."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from kvpolicy.commands._types import DTYPES, choice_of, dtype_name, model_name, positive_int, token_count
from kvpolicy_lab.commands._types import available_device, non_negative_int, out_dir, out_file


def _open(args: argparse.Namespace) -> tuple[Any, Any]:
    """The model and tokenizer the shared options name (offline unless ``--online``)."""
    if not args.online:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kvpolicy_lab.eval.runner import open_model

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return open_model(args.model, args.dtype, args.device, args.online)


def _attention(args: argparse.Namespace) -> int:
    from kvpolicy_lab.eval.attention_analysis import analyze_attention

    model, tok = _open(args)
    result = analyze_attention(
        model, tok, context=args.context, queries=args.queries, top_k=args.top_k, seed=args.seed,
        out=args.out, progress=not args.no_progress, name=args.model,
    )  # fmt: skip
    print(result.markdown())
    return 0


def _rotation(args: argparse.Namespace) -> int:
    import json

    from kvpolicy import registry
    from kvpolicy_lab.eval.rotation_analysis import analyze_rotation

    cls = registry.get("transforms", args.transform)
    takes_seed = "seed" in {f.name for f in dataclasses.fields(cls)}
    transform = cls(seed=args.seed_transform) if takes_seed else cls()
    model, tok = _open(args)
    result = analyze_rotation(
        model, tok, transform, bits=args.bits, group_size=args.group_size, context=args.context,
        queries=args.queries, seed=args.seed, name=args.model,
    )  # fmt: skip
    print(result.markdown())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.to_dict(), indent=1))
    return 0


def _transforms() -> list[str]:
    from kvpolicy import registry

    return registry.names("transforms")


def _model_options(p: argparse.ArgumentParser) -> None:
    """The options every analysis shares: which model, where, and the text's length."""
    p.add_argument("--model", type=model_name, default="smollm2",
                   help="smollm2, gemma3-270m, tiny-<llama|qwen2|mistral>[-LAYERS], a local path or a hub id "
                   "(a hub id not in the local cache needs --online)")  # fmt: skip
    p.add_argument("--dtype", type=dtype_name, choices=DTYPES, default="float32", help="model dtype")
    p.add_argument("--device", type=available_device, default="cpu", help="cpu, cuda, cuda:N or mps")
    p.add_argument("--context", type=token_count, default=2048, help="tokens of standard-library text (2048, 8k...)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="which text (the lm task's sample seed)")
    p.add_argument("--online", action="store_true", help="allow downloading from the Hugging Face hub")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's choice)")


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``kvpolicy analyze attention`` and ``kvpolicy analyze rotation`` to ``sub``."""
    p = sub.add_parser(
        "analyze", help="analyses of a model's attention (attention spikes by distance; does rotation help its keys)"
    )
    which = p.add_subparsers(dest="analysis", required=True, metavar="ANALYSIS", help="attention or rotation")
    a = which.add_parser(
        "attention",
        help="distribution of high-attention key positions by distance from the query, per layer, with a plot",
    )
    _model_options(a)
    a.add_argument("--queries", type=positive_int, default=16, help="decoding queries analysed at the end")
    a.add_argument("--top-k", type=positive_int, default=8, help="high-attention keys per query and head")
    a.add_argument("--out", type=out_dir, default="attention-analysis", metavar="DIR",
                   help="directory for the plot and JSON")  # fmt: skip
    a.add_argument("--no-progress", action="store_true", help="no progress bars")
    a.set_defaults(func=_attention)

    r = which.add_parser(
        "rotation",
        help="per layer, the error of quantized keys with and without a rotation, weighted by the model's queries",
    )
    _model_options(r)
    r.add_argument("--transform", type=choice_of("transform", _transforms), default="hadamard",
                   help="a registered transform (kvpolicy list shows them)")  # fmt: skip
    r.add_argument("--seed-transform", type=non_negative_int, default=0, help="the transform's seed")
    r.add_argument("--bits", type=int, choices=(2, 3, 4, 8), default=2, help="key bits")
    r.add_argument("--group-size", type=positive_int, default=64, help="tokens per key group")
    r.add_argument("--queries", type=positive_int, default=64, help="queries after the context")
    r.add_argument("--json", type=out_file, metavar="FILE", help="also write the result to this JSON file")
    r.set_defaults(func=_rotation)
