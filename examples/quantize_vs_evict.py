"""Quantize vs evict the same tokens: what do the demoted tokens still contribute?

One selection (a policy with its parameters) and two actions: the tokens the policy lets go are
either quantized to 2 bits or dropped. The LogQuant paper reports ~2.5x larger attention error for
eviction; here: attention-output relative error per layer, teacher-forced ΔNLL and bytes held.

    python examples/quantize_vs_evict.py                       # SmolLM2-135M, log W=42, 2k context
    python examples/quantize_vs_evict.py --policy sink --window 124
    python examples/quantize_vs_evict.py --smoke               # a tiny random model, seconds
"""

from __future__ import annotations

import torch

from kvpolicy_lab.eval.caches import CacheSpec
from kvpolicy_lab.eval.compare import TeacherForced, example_parser


def main(argv: list[str] | None = None) -> None:
    parser = example_parser(__doc__.splitlines()[0])
    parser.add_argument("--policy", default="log", help="a registered policy name")
    parser.add_argument("--bits", type=int, default=2)
    args = parser.parse_args(argv)

    run = TeacherForced.open(args)
    selection = {"policy": args.policy, "window": run.window}
    results = {}
    for action in ("quantize", "evict"):
        extra = {"bits": args.bits} if action == "quantize" else {}
        spec = CacheSpec("compressed", {**selection, "action": action, **extra})
        results[action] = run.measure(spec)
        print(spec.describe())
    q, e = results["quantize"], results["evict"]
    print(f"\n{'':<12}{'attn err':>10}{'ΔNLL nats':>20}{'bytes':>12}")
    for name, m in results.items():
        print(f"{name:<12}{m['attn_error'].value:>10.4f}{m['delta_nll'].value:>+11.4f} ± {m['delta_nll'].se:.4f}"
              f"{m['bytes_held'].value / 2**20:>8.2f} MiB")  # fmt: skip
    print(f"\nattention error, evict / quantize: {e['attn_error'].value / q['attn_error'].value:.2f}x (paper: ~2.5x)")
    per_q, per_e = q["attn_error"].extra["per_layer"], e["attn_error"].extra["per_layer"]
    print("per layer (quantize / evict): " + ", ".join(f"{a:.3f}/{b:.3f}" for a, b in zip(per_q, per_e, strict=True)))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
