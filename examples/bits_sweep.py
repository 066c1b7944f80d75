"""A bits sweep: how much does each bit of the demoted tokens buy? (log policy, one selection)

python examples/bits_sweep.py                   # SmolLM2-135M, 2k context, bits 2, 4, 8
python examples/bits_sweep.py --bits 2 3 4
python examples/bits_sweep.py --smoke           # a tiny random model, seconds
"""

from __future__ import annotations

import torch

from kvpolicy_lab.eval.caches import CacheSpec
from kvpolicy_lab.eval.compare import TeacherForced, example_parser, quality_cells, quality_header


def main(argv: list[str] | None = None) -> None:
    parser = example_parser(__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 4, 8], help="bit widths, space-separated")
    parser.add_argument("--policy", default="log")
    args = parser.parse_args(argv)

    run = TeacherForced.open(args)
    print(f"{'bits':<6}{quality_header()}{'vs 16-bit':>11}")
    for bits in args.bits:
        m = run.measure(CacheSpec("compressed", {"policy": args.policy, "window": run.window, "action": "quantize",
                                                 "bits": bits}))  # fmt: skip
        print(f"{bits:<6}{quality_cells(m)}{m['ratio'].value:>10.2f}x")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
