"""``kvpolicy demo``: LogQuant and kvpolicy's presets on a real model (SmolLM2-135M-Instruct by default)."""

from __future__ import annotations

import argparse
import os

from kvpolicy.commands._types import model_name, positive_int, token_count


def _run(args: argparse.Namespace) -> int:
    if not args.online:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a missing model fails in seconds, not after retries
    from kvpolicy_lab.eval.demo import run_demo
    from kvpolicy_lab.eval.grid import check_model_available

    check_model_available(args.model, args.online)  # before anything is printed or loaded

    run_demo(
        model_name=args.model,
        max_new_tokens=args.max_new_tokens,
        context_tokens=args.context_tokens,
        continuation_tokens=args.continuation_tokens,
        threads=args.threads,
        online=args.online,
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``kvpolicy demo`` to ``sub``."""
    demo = sub.add_parser(
        "demo",
        help="LogQuant on SmolLM2-135M-Instruct with a long prompt (CPU: about 6 min on 2 cores)",
        description="Answer a question about a standard-library source file with each cache (uncompressed, "
        "LogQuant 4- and 2-bit, the kvpolicy-3.5bit preset) and print the bytes held, the decode speed and the "
        "fidelity against the uncompressed cache.",
    )  # fmt: skip
    demo.add_argument(
        "--model", type=model_name, default="smollm2",
        help="smollm2 (SmolLM2-135M-Instruct), gemma3-270m (Gemma-3-270M, a base model), "
        "tiny-<llama|qwen2|mistral>[-LAYERS] (random weights, for a quick check), a local path or a hub id",
    )  # fmt: skip
    demo.add_argument("--max-new-tokens", type=token_count, default=40, help="answer length")
    demo.add_argument("--context-tokens", type=token_count, default=2048, help="fidelity context (2048, 2k...)")
    demo.add_argument("--continuation-tokens", type=token_count, default=256, help="teacher-forced tokens scored")
    demo.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    demo.add_argument("--online", action="store_true", help="allow downloading a hub model")
    demo.set_defaults(func=_run)
