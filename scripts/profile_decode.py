"""Where a decode step's time goes: ``torch.profiler`` over SmolLM2-135M decode steps, per cache.

Fills each cache synthetically to ``--length`` tokens (as ``kvpolicy bench decode --fill synthetic``),
runs one untimed step, then profiles ``--steps`` steps and prints the operators with the most self
CPU time. Used for the bf16 explanation in lab/notebook/performance.md.

Usage::

    python scripts/profile_decode.py --dtype bfloat16 --length 8192 --threads 1
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache, QuantizedCache

from kvpolicy import CompressedCache
from kvpolicy.fused import disable_fused, enable_fused
from kvpolicy_lab.bench.decode import DTYPES, _fill, load

CACHES = {
    "DynamicCache": (lambda config: DynamicCache(), False),
    "QuantizedCache(quanto, 2)": (lambda config: QuantizedCache("quanto", config, nbits=2), False),
    "one-liner (log, 2-bit)": (lambda config: CompressedCache(policy="log", action="quantize", bits=2), True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    model = load("smollm2", dtype, "cpu")
    for name, (make, fused) in CACHES.items():
        (enable_fused if fused else disable_fused)(model)
        cache = make(model.config)
        _fill(model, cache, 1, args.length, "cpu", dtype)
        token = torch.randint(3, model.config.vocab_size, (1, 1))
        with torch.inference_mode():
            model(token, cache=cache, use_cache=True)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.steps):
                    model(token, cache=cache, use_cache=True)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events) / args.steps / 1e3
        print(f"\n{name}, {args.dtype}, {args.length} tokens: {total:.1f} ms of operator self time per step")
        print(f"  {'operator':<40}{'ms/step':>9}{'share':>8}{'calls/step':>12}")
        for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[: args.top]:
            ms = e.self_cpu_time_total / args.steps / 1e3
            print(f"  {e.key[:40]:<40}{ms:>9.1f}{ms / total:>8.0%}{e.count / args.steps:>12.0f}")
    disable_fused(model)


if __name__ == "__main__":
    main()
