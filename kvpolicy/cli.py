"""The ``kvpolicy`` command."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from kvpolicy.eval.demo import run_demo

    run_demo(
        max_new_tokens=args.max_new_tokens,
        context_tokens=args.context_tokens,
        continuation_tokens=args.continuation_tokens,
        threads=args.threads,
    )
    return 0


def _list(args: argparse.Namespace) -> int:
    from kvpolicy import registry

    for kind in registry.KINDS:
        print(f"{kind}: {', '.join(registry.names(kind))}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpolicy", description="Pluggable KV-cache compression for transformers.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="LogQuant on SmolLM2-135M-Instruct with a long prompt (CPU, ~2 min)")
    demo.add_argument("--max-new-tokens", type=int, default=40, help="answer length (default: 40)")
    demo.add_argument("--context-tokens", type=int, default=2048, help="fidelity context (default: 2048)")
    demo.add_argument(
        "--continuation-tokens", type=int, default=256, help="teacher-forced tokens scored (default: 256)"
    )
    demo.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    demo.set_defaults(func=_demo)

    lst = sub.add_parser("list", help="registered policies, actions, backends and presets")
    lst.set_defaults(func=_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
