"""Cost of applying the Hadamard rotation: butterfly passes (fast Walsh-Hadamard) vs one matrix product.

One thread, float32, ``head_dim`` 64 by default; shapes of a decode query (batch 1 and 8, 3 KV heads,
3 query heads per KV head), one demoted token per head, and a 2k-token prompt demoted at once.

Usage::

    python scripts/rotation_cost.py [--head-dim 64]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvpolicy.transforms import Hadamard
from kvpolicy.transforms.hadamard import walsh_hadamard


def _us(fn, reps: int) -> float:
    for _ in range(max(3, reps // 20)):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    d = args.head_dim
    rot = Hadamard(0)
    m = rot.matrix(d)
    signs = torch.sign(m[:, 0]) if d & (d - 1) == 0 else None
    if signs is None:
        raise SystemExit("the butterfly comparison needs a power-of-two head_dim")
    print(f"{'shape':<22}{'butterfly µs':>14}{'matmul µs':>11}{'speed-up':>10}")
    for shape in ((1, 3, 3, d), (8, 3, 3, d), (1, 3, 1, d), (1, 3, 2048, d)):
        x = torch.randn(shape)
        reps = 200 if shape[2] > 100 else 2000
        fwht = _us(lambda x=x: walsh_hadamard(x * signs) / d**0.5, reps)
        mm = _us(lambda x=x: rot.forward(x), reps)
        assert torch.allclose(walsh_hadamard(x * signs) / d**0.5, rot.forward(x), atol=1e-5)
        print(f"{shape!s:<22}{fwht:>14.1f}{mm:>11.1f}{fwht / mm:>9.1f}×")


if __name__ == "__main__":
    main()
