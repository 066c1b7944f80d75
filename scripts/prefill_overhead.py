"""What compression adds to a real prefill: DynamicCache against the one-liner on SmolLM2-135M.

The one-liner (``CompressedCache(policy="log", action="quantize", bits=2)``, default backend) and the
``kvpolicy-3bit`` preset attend over the uncompressed prompt during prefill and demote each layer's
prompt once its attention has run (the last 64 tokens of each layer, which a ``crop`` could still
remove, at the first decode step), so the cost of compression shows in the prefill plus the first
decode step; the second step is the steady state. Interleaved rounds, medians.

Usage::

    python scripts/prefill_overhead.py --lengths 2048 8192 --threads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from kvpolicy import CompressedCache
from kvpolicy.fused import enable_fused
from kvpolicy_lab.eval.models import load_smollm2

CACHES = {
    "DynamicCache": DynamicCache,
    "one-liner (log, 2-bit)": lambda: CompressedCache(policy="log", action="quantize", bits=2),
    "kvpolicy-3bit": lambda: CompressedCache.from_preset("kvpolicy-3bit"),
}


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1; got {text!r}")
    return value


@torch.inference_mode()
def _times(model: torch.nn.Module, ids: torch.Tensor, n: int, make) -> tuple[float, float, float]:
    """Milliseconds of the prefill of ``n`` tokens, the first decode step and the second."""
    cache = make()
    t0 = time.perf_counter()
    model(ids[:, :n], cache=cache, use_cache=True)
    t1 = time.perf_counter()
    model(ids[:, n : n + 1], cache=cache, use_cache=True)
    t2 = time.perf_counter()
    model(ids[:, n + 1 : n + 2], cache=cache, use_cache=True)
    t3 = time.perf_counter()
    return 1e3 * (t1 - t0), 1e3 * (t2 - t1), 1e3 * (t3 - t2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=_positive, nargs="+", default=[2048, 8192], help="prompt lengths")
    parser.add_argument("--threads", type=_positive, default=2, help="torch.set_num_threads")
    parser.add_argument("--rounds", type=_positive, default=3, help="interleaved rounds per length (median)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_smollm2()
    enable_fused(model)
    print(f"{'length':>7} {'cache':<24}{'prefill ms':>11}{'1st step ms':>12}{'2nd step ms':>12}{'vs Dynamic':>11}")
    for n in args.lengths:
        ids = torch.randint(100, 40000, (1, n + 2), generator=torch.Generator().manual_seed(n))
        runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in CACHES}
        for _ in range(args.rounds):
            for name, make in CACHES.items():
                runs[name].append(_times(model, ids, n, make))
        medians = {name: [statistics.median(r[i] for r in rs) for i in range(3)] for name, rs in runs.items()}
        base = sum(medians["DynamicCache"][:2])
        for name, (pre, first, second) in medians.items():
            print(f"{n:>7} {name:<24}{pre:>11.0f}{first:>12.0f}{second:>12.1f}{(pre + first) / base:>10.3f}x")


if __name__ == "__main__":
    main()
