"""Reconstruction error of the lattice and codebook schemes on Gaussian vectors (docs/explanation/quantization.md).

``--vectors`` vectors of ``--dim`` independent N(0, 1) coordinates (what a rotation makes of a head
vector), quantized by the ``lattice`` scheme (D4 table, norm-corrected scale) and the ``codebook``
scheme (Lloyd-Max, norm-corrected scale) at 2 and 3 bits per coordinate, float32 scales. Printed per
scheme: the mean squared error per coordinate, the same with the least-squares scale
``⟨x, c⟩ / ‖c‖²`` for the same codes (the least error those codes allow), and bits per element with a
16-bit scale; against the Gaussian rate-distortion bound ``2^(-2R)``.

Usage::

    python plugins/kvpolicy-research/scripts/lattice_mse.py --vectors 100000 --dim 64
"""

from __future__ import annotations

import argparse

import torch
from kvpolicy_research.lattice import Lattice

from kvpolicy.formats import Codebook


def _errors(fmt, x: torch.Tensor) -> tuple[float, float]:
    """(MSE per coordinate with the stored scale, with the least-squares scale for the same codes)."""
    q = fmt.quantize(x)
    mse = float((q.dequantize() - x).pow(2).mean())
    unit = q.unit_vectors()
    ls = (x * unit).sum(-1, keepdim=True) / unit.pow(2).sum(-1, keepdim=True).clamp_min(1e-30)
    return mse, float((ls * unit - x).pow(2).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vectors", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    x = torch.randn(1, 1, args.vectors, args.dim, generator=torch.Generator().manual_seed(args.seed))
    print(f"{args.vectors} vectors of {args.dim} N(0, 1) coordinates; MSE per coordinate")
    print(f"{'bits':>4}  {'scheme':<10} {'bits/el':>8} {'MSE':>9} {'MSE (LS scale)':>15}")
    for bits in (2, 3):
        for name, fmt in (("lattice", Lattice(bits, "float32")), ("codebook", Codebook(bits, "float32"))):
            mse, ls = _errors(fmt, x)
            print(f"{bits:>4}  {name:<10} {bits + 16 / args.dim:8.3f} {mse:9.5f} {ls:15.5f}")
        print(f"{bits:>4}  {'R(D) bound':<10} {bits:8.3f} {2.0 ** (-2 * bits):9.5f}")


if __name__ == "__main__":
    main()
