"""Graph breaks of a compressed cache's decode step under ``torch.compile``, and compiled vs eager decode time.

For each cache (``--caches``: the one-liner ``CompressedCache.for_model(model)`` and ``kvpolicy-3bit``),
after a prompt of ``--tokens`` tokens and one eager step: ``torch._dynamo.explain`` of the next decode step
(graph breaks, with their reasons; ``--no-explain`` skips it), then ``--steps`` decode steps timed on two
caches filled alike, one stepped by the model compiled with ``torch.compile`` (inductor, ``dynamic=True``;
``--call forward`` compiles ``model.forward`` and calls it directly, which skips the module's forward hooks,
kvpolicy's pre-hook among them) and one eagerly, interleaved step by step, after ``--warmup`` steps each (the
compilations). Each step's times are printed as they come (so a run cut short still shows what it
measured), then one Markdown table: median step times and their ratio, with the spread of the ratio over
the steps (25th-75th percentile), and the number of graphs dynamo compiled over the whole run (a count
that grows with the steps means recompilation).

On a small machine the compilation dominates. ``--threads`` sets torch's threads for the timed steps and
inductor's compile workers alike; inductor's FX graph cache (on by default) serves the layers' identical
graphs after the first. Run one cache per process (``--caches one-liner``) to bound each run.

Usage::

    python scripts/compile_check.py                      # SmolLM2-135M (the pinned wheel), 8k prompt
    python scripts/compile_check.py --caches one-liner --threads 1 --steps 12 --warmup 4
    python scripts/compile_check.py --tiny --tokens 600  # a tiny random Llama, quick
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._dynamo as dynamo
from torch._dynamo.utils import counters

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


def _log(start: float, text: str) -> None:
    print(f"[{time.perf_counter() - start:8.1f} s] {text}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2-135M")
    parser.add_argument("--tokens", type=int, default=8192, help="prompt tokens (default 8192)")
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps per cache (default 30)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps first (default 4)")
    parser.add_argument("--caches", nargs="+", choices=list(CACHES), default=list(CACHES), help="caches to run")
    parser.add_argument(
        "--call",
        choices=("module", "forward"),
        default="module",
        help="compile the model with its forward hooks (default) or call its compiled forward directly",
    )
    parser.add_argument("--no-explain", action="store_true", help="skip torch._dynamo.explain of one step")
    parser.add_argument("--threads", type=int, default=None, help="torch threads and inductor compile workers")
    args = parser.parse_args()
    clock = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
        torch._inductor.config.compile_threads = args.threads
    dynamo.config.recompile_limit = 64
    model = _model(args.tiny)
    vocab = model.config.vocab_size
    total = args.tokens + 2 + args.warmup + args.steps
    ids = torch.randint(3, min(vocab, 30000), (1, total), generator=torch.Generator().manual_seed(0))
    rows = []
    for name in args.caches:
        make = CACHES[name]
        _log(clock, f"{name}: prefilling two caches of {args.tokens} tokens, then one eager step each")
        eager_cache = _filled(model, make, ids[:, : args.tokens])
        compiled_cache = _filled(model, make, ids[:, : args.tokens])
        with torch.no_grad():
            for cache in (eager_cache, compiled_cache):  # the step after the prompt settles the prompt's demotions
                model(ids[:, args.tokens : args.tokens + 1], cache=cache, use_cache=True)
            model(ids[:, args.tokens + 1 : args.tokens + 2], cache=eager_cache, use_cache=True)
            x = ids[:, args.tokens + 1 : args.tokens + 2]
            if args.no_explain:
                model(x, cache=compiled_cache, use_cache=True)
            else:  # the explained step is the compiled cache's second step: both caches end alike
                explained = dynamo.explain(lambda x, c=compiled_cache: model(x, cache=c, use_cache=True).logits)(x)
                _log(clock, f"{name}: {explained.graph_break_count} graph breaks in one decode step after "
                     f"{args.tokens + 1} tokens")  # fmt: skip
                for reason in explained.break_reasons:
                    print(f"    {reason.reason.splitlines()[0]}")
        dynamo.reset()
        counters.clear()
        # "module": the model compiled whole, its forward hooks included (kvpolicy's pre-hook demotes ahead of the
        # forward); "forward": the compiled forward called directly, without the hooks
        compiled = torch.compile(model if args.call == "module" else model.forward, dynamic=True)
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        with torch.no_grad():
            for i in range(args.tokens + 2, total):
                x = ids[:, i : i + 1]
                step: dict[str, float] = {}
                for mode, cache, call in (("eager", eager_cache, model), ("compiled", compiled_cache, compiled)):
                    start = time.perf_counter()
                    call(x, cache=cache, use_cache=True)
                    step[mode] = time.perf_counter() - start
                    if i >= args.tokens + 2 + args.warmup:
                        times[mode].append(step[mode])
                graphs = counters["stats"]["unique_graphs"]
                _log(clock, f"{name}: step {i}: eager {step['eager'] * 1e3:.1f} ms, compiled "
                     f"{step['compiled'] * 1e3:.1f} ms, {graphs} graphs compiled so far")  # fmt: skip
        ratios = sorted(c / e for c, e in zip(times["compiled"], times["eager"], strict=True))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        rows.append(
            (
                name,
                statistics.median(times["eager"]),
                statistics.median(times["compiled"]),
                statistics.median(ratios),
                q,
                counters["stats"]["unique_graphs"],
            )
        )
        dynamo.reset()
    print()
    print(
        f"| cache | eager step (ms) | compiled step (ms) | compiled / eager (25-75 %) | graphs compiled |"
        f"  # {args.tokens} tokens, {args.steps} steps after {args.warmup}, --call {args.call}"
    )
    print("|---|---|---|---|---|")
    for name, eager, comp, ratio, q, graphs in rows:
        print(f"| {name} | {eager * 1e3:.2f} | {comp * 1e3:.2f} | {ratio:.2f} ({q[0]:.2f}-{q[2]:.2f}) | {graphs} |")


if __name__ == "__main__":
    main()
