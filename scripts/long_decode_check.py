"""Decode attention at long contexts on one random layer shaped like an 8B model's (GPU check).

One attention layer with ``--heads`` query heads, ``--kv-heads`` kv heads of ``--head-dim`` channels
(default 32 / 8 / 128: Llama-3-8B's) holds ``L`` random tokens in the one-liner's
``CompressedCache(policy="log", action="quantize", bits=2)`` (``backend="auto"``: ``triton`` on CUDA,
``cpu`` on CPU). For each length a decode step's attention is computed three ways:

- ``fused``: kvpolicy's fused decode attention over the store's parts (:func:`kvpolicy.fused.attend_parts`);
- ``dequantized``: the compressed history dequantized, then ``scaled_dot_product_attention`` (what a
  cache without a fused path does every step);
- ``dynamic``: ``scaled_dot_product_attention`` over the full-precision history (``DynamicCache``).

It checks that ``fused`` equals ``dequantized`` within float tolerance (both read the same codes) and
prints the median time of each over ``--steps`` calls, their ratios, the bytes held, and on CUDA the
peak of ``torch.cuda.max_memory_allocated`` of each path. Exits non-zero when the check fails.

Usage::

    python scripts/long_decode_check.py --device cuda --lengths 32768 131072
    python scripts/long_decode_check.py --device cpu --lengths 512 --heads 4 --kv-heads 2 --head-dim 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from kvpolicy import CompressedCache
from kvpolicy.fused import attend_parts
from kvpolicy.layer.parts import Part


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, steps: int, device: str) -> tuple[torch.Tensor, float, int]:
    """``fn()``'s result, its median seconds over ``steps`` calls and (CUDA) its peak allocation above
    what was allocated before."""
    out = fn()  # warm-up (compiles)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() - base if device.startswith("cuda") else 0
    return out, statistics.median(times), peak


@torch.inference_mode()
def check(args: argparse.Namespace, length: int) -> bool:
    dtype = getattr(torch, args.dtype)
    g = torch.Generator(device=args.device).manual_seed(length)
    shape = (1, args.kv_heads, length, args.head_dim)
    keys = torch.randn(shape, generator=g, device=args.device, dtype=dtype)
    values = torch.randn(shape, generator=g, device=args.device, dtype=dtype)
    cache = CompressedCache(policy="log", action="quantize", bits=2)
    cache.update(keys, values, 0)
    step = (1, args.kv_heads, 1, args.head_dim)
    k1 = torch.randn(step, generator=g, device=args.device, dtype=dtype)
    v1 = torch.randn(step, generator=g, device=args.device, dtype=dtype)
    cache.update(k1, v1, 0)  # a decode step's update: the prompt is demoted, FP(T) remains
    layer = cache.layers[0]
    query = torch.randn((1, args.heads, 1, args.head_dim), generator=g, device=args.device, dtype=dtype)
    scale = args.head_dim**-0.5
    full_k, full_v = torch.cat([keys, k1], dim=2), torch.cat([values, v1], dim=2)
    del keys, values

    def fused() -> torch.Tensor:
        engine = layer.engine
        return attend_parts(query, [*engine.store.parts(), Part(engine.keys, engine.values)], scale)

    def dequantized() -> torch.Tensor:
        k, v = layer.attention_view("ordered")
        return F.scaled_dot_product_attention(query, k, v, scale=scale, enable_gqa=True)

    def dynamic() -> torch.Tensor:
        return F.scaled_dot_product_attention(query, full_k, full_v, scale=scale, enable_gqa=True)

    got, t_fused, m_fused = _timed(fused, args.steps, args.device)
    ref, t_deq, m_deq = _timed(dequantized, args.steps, args.device)
    _, t_dyn, m_dyn = _timed(dynamic, args.steps, args.device)
    err = (got.float() - ref.float()).abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    ok = err <= tol
    held = cache.memory_report().total_bytes
    dyn_bytes = 2 * full_k.numel() * full_k.element_size()
    print(
        f"{length:>7} {args.dtype} {layer.engine.backend.name:<6} fused {t_fused * 1e3:8.3f} ms"
        f"  dequantized {t_deq * 1e3:8.3f} ms  dynamic {t_dyn * 1e3:8.3f} ms"
        f"  fused/dynamic {t_fused / t_dyn:5.2f}  fused/dequantized {t_fused / t_deq:5.2f}"
        f"  held {held / 2**20:8.1f} MiB (dynamic {dyn_bytes / 2**20:8.1f})"
        + (f"  peak MiB fused {m_fused / 2**20:.1f} dequantized {m_deq / 2**20:.1f} dynamic {m_dyn / 2**20:.1f}"
           if args.device.startswith("cuda") else "")
        + f"  max |fused - dequantized| {err:.2e} {'ok' if ok else f'FAILED (> {tol:g})'}",
        flush=True,
    )  # fmt: skip
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if any(n < 2 for n in args.lengths) or args.steps < 1:
        parser.error("--lengths must be >= 2 and --steps >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("long_decode_check: no CUDA device visible; pass --device cpu for the reduced CPU run")
        return 0
    results = [check(args, n) for n in args.lengths]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
