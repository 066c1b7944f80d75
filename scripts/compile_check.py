"""Graph breaks of a compressed cache's decode step under ``torch.compile``, and compiled vs eager decode time.

For each cache (the one-liner ``CompressedCache.for_model(model)`` and ``kvpolicy-3bit``), after a prompt of
``--tokens`` tokens: ``torch._dynamo.explain`` of one decode step (graph breaks, with their reasons), then
``--steps`` decode steps timed on two caches filled alike, one stepped by the model's forward compiled with
``torch.compile`` (inductor, ``dynamic=True``) and one eagerly, interleaved step by step, after ``--warmup``
steps each (the compilations). Prints one Markdown table: median step times and their ratio, with the spread
of the ratio over the steps (25th-75th percentile).

Usage::

    python scripts/compile_check.py                      # SmolLM2-135M (the pinned wheel), 8k prompt
    python scripts/compile_check.py --tiny --tokens 600  # a tiny random Llama, quick
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._dynamo as dynamo

from kvpolicy import CompressedCache
from kvpolicy.fused import enable_fused

CACHES = {
    "one-liner": lambda model: CompressedCache.for_model(model),
    "kvpolicy-3bit": lambda model: CompressedCache.for_model(model, "kvpolicy-3bit"),
}


def _model(tiny: bool) -> torch.nn.Module:
    if tiny:
        from kvpolicy.tiny import random_model

        model = random_model("llama", layers=2, seed=0)
    else:
        from kvpolicy_lab.eval.models import load_smollm2

        model = load_smollm2()
        model = model[0] if isinstance(model, tuple) else model
    model.eval()
    enable_fused(model)
    return model


def _filled(model: torch.nn.Module, make, ids: torch.Tensor) -> CompressedCache:
    cache = make(model)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2-135M")
    parser.add_argument("--tokens", type=int, default=8192, help="prompt tokens (default 8192)")
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps per cache (default 30)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps first (default 4)")
    args = parser.parse_args()
    dynamo.config.recompile_limit = 64
    model = _model(args.tiny)
    vocab = model.config.vocab_size
    total = args.tokens + 1 + args.warmup + args.steps
    ids = torch.randint(3, min(vocab, 30000), (1, total), generator=torch.Generator().manual_seed(0))
    rows = []
    for name, make in CACHES.items():
        cache = _filled(model, make, ids[:, : args.tokens])
        with torch.no_grad():
            model(ids[:, args.tokens : args.tokens + 1], cache=cache, use_cache=True)
            explained = dynamo.explain(lambda x, c=cache: model(x, cache=c, use_cache=True).logits)(
                ids[:, args.tokens + 1 : args.tokens + 2]
            )
        print(f"{name}: {explained.graph_break_count} graph breaks in one decode step after {args.tokens} tokens")
        for reason in explained.break_reasons:
            print(f"    {reason.reason.splitlines()[0]}")
        dynamo.reset()
        eager_cache = _filled(model, make, ids[:, : args.tokens + 1])
        compiled_cache = _filled(model, make, ids[:, : args.tokens + 1])
        compiled = torch.compile(model.forward, dynamic=True)
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        with torch.no_grad():
            for i in range(args.tokens + 1, total):
                x = ids[:, i : i + 1]
                for mode, cache, call in (("eager", eager_cache, model), ("compiled", compiled_cache, compiled)):
                    start = time.perf_counter()
                    call(x, cache=cache, use_cache=True)
                    if i >= args.tokens + 1 + args.warmup:
                        times[mode].append(time.perf_counter() - start)
        ratios = sorted(c / e for c, e in zip(times["compiled"], times["eager"], strict=True))
        q = statistics.quantiles(ratios, n=4)
        rows.append(
            (
                name,
                statistics.median(times["eager"]),
                statistics.median(times["compiled"]),
                statistics.median(ratios),
                q,
            )
        )
        dynamo.reset()
    print()
    print(f"| cache | eager step (ms) | compiled step (ms) | compiled / eager (25-75 %) |  # {args.tokens} tokens")
    print("|---|---|---|---|")
    for name, eager, comp, ratio, q in rows:
        print(f"| {name} | {eager * 1e3:.2f} | {comp * 1e3:.2f} | {ratio:.2f} ({q[0]:.2f}-{q[2]:.2f}) |")


if __name__ == "__main__":
    main()
