"""``kvpolicy analyze attention``: where the high-attention keys are, by distance from the query."""

from __future__ import annotations

import argparse
import os

from kvpolicy.commands._types import available_device, non_negative_int, out_dir, positive_int


def _attention(args: argparse.Namespace) -> int:
    if not args.online:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kvpolicy.eval.attention_analysis import analyze_attention
    from kvpolicy.eval.runner import open_model

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model, tok = open_model(args.model, args.dtype, args.device, args.online)
    result = analyze_attention(
        model, tok, context=args.context, queries=args.queries, top_k=args.top_k, seed=args.seed,
        out=args.out, progress=not args.no_progress, name=args.model,
    )  # fmt: skip
    print(result.markdown())
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``kvpolicy analyze attention`` to ``sub``."""
    p = sub.add_parser("analyze", help="analyses of a model's attention (attention spikes by distance)")
    which = p.add_subparsers(dest="analysis", required=True)
    a = which.add_parser(
        "attention",
        help="distribution of high-attention key positions by distance from the query, per layer, with a plot",
    )
    a.add_argument("--model", default="smollm2", help="smollm2, gemma3-270m, a path or hub id (default: smollm2)")
    a.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    a.add_argument("--device", type=available_device, default="cpu", help="cpu, cuda, cuda:N or mps")
    a.add_argument("--context", type=positive_int, default=2048, help="tokens of standard-library text (default: 2048)")
    a.add_argument(
        "--queries", type=positive_int, default=16, help="decoding queries analysed at the end (default: 16)"
    )
    a.add_argument("--top-k", type=positive_int, default=8, help="high-attention keys per query and head (default: 8)")
    a.add_argument("--seed", type=non_negative_int, default=0)
    a.add_argument("--out", type=out_dir, default="attention-analysis", help="directory for the plot and JSON")
    a.add_argument("--online", action="store_true", help="allow downloading from the Hugging Face hub")
    a.add_argument("--threads", type=positive_int)
    a.add_argument("--no-progress", action="store_true")
    a.set_defaults(func=_attention)
