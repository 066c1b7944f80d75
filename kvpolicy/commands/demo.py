"""``kvpolicy demo``: LogQuant on SmolLM2-135M-Instruct."""

from __future__ import annotations

import argparse

from kvpolicy.commands._types import positive_int


def _run(args: argparse.Namespace) -> int:
    from kvpolicy.eval.demo import run_demo

    run_demo(
        model_name=args.model,
        max_new_tokens=args.max_new_tokens,
        context_tokens=args.context_tokens,
        continuation_tokens=args.continuation_tokens,
        threads=args.threads,
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``kvpolicy demo`` to ``sub``."""
    demo = sub.add_parser("demo", help="LogQuant on SmolLM2-135M-Instruct with a long prompt (CPU, ~4-5 min)")
    demo.add_argument(
        "--model", default="smollm2", choices=("smollm2", "gemma3-270m"),
        help="smollm2 (SmolLM2-135M-Instruct, default) or gemma3-270m (Gemma-3-270M, a base model)",
    )  # fmt: skip
    demo.add_argument("--max-new-tokens", type=positive_int, default=40, help="answer length (default: 40)")
    demo.add_argument("--context-tokens", type=positive_int, default=2048, help="fidelity context (default: 2048)")
    demo.add_argument(
        "--continuation-tokens", type=positive_int, default=256, help="teacher-forced tokens scored (default: 256)"
    )
    demo.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    demo.set_defaults(func=_run)
