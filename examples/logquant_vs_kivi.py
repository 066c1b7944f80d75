"""LogQuant vs KIVI-style at equal bytes: which 2-bit cache loses less, holding the same memory?

Both quantize demoted tokens to 2 bits (the library's quantizer: keys per channel, values per token);
they differ in which tokens stay at full precision: a log-spaced set (LogQuant, W = 42, i.e. the
paper's 128 reserved tokens) or the most recent tokens flushed R at a time (KIVI). KIVI's residual R
is chosen so that both caches hold the same bytes after the last token (kvpolicy_lab.eval.equal_bytes).

    python examples/logquant_vs_kivi.py            # SmolLM2-135M, 2k context (~3 min on 2 CPU cores)
    python examples/logquant_vs_kivi.py --smoke    # a tiny random model, seconds
"""

from __future__ import annotations

import torch

from kvpolicy_lab.eval.caches import CacheSpec
from kvpolicy_lab.eval.compare import TeacherForced, example_parser, quality_cells, quality_header
from kvpolicy_lab.eval.equal_bytes import equalize


def main(argv: list[str] | None = None) -> None:
    args = example_parser(__doc__.splitlines()[0], window_help="LogQuant window W").parse_args(argv)
    run = TeacherForced.open(args, smoke_context=160)

    logquant = CacheSpec("compressed", {"policy": "log", "window": run.window, "action": "quantize", "bits": 2},
                         label=f"LogQuant 2-bit (W={run.window})")  # fmt: skip
    kivi = CacheSpec("compressed", {"policy": "recent", "variant": "flush", "prompt": "keep_tail", "window": 128,
                                    "action": "quantize", "bits": 2}, label="KIVI-style 2-bit")  # fmt: skip
    specs, sizing = equalize(run.model, logquant, [logquant, kivi], run.context, run.tokens)
    for s in sizing:
        print(f"equal bytes: {s.label} -> residual {s.value}: {s.bytes} bytes/layer (LogQuant: {s.target})")

    print(f"{'cache':<34}{quality_header(nll_width=9)}{'bytes':>12}")
    for spec in specs:
        m = run.measure(spec)
        print(f"{spec.label:<34}{quality_cells(m, nll_width=9)}{m['bytes_held'].value / 2**20:>8.2f} MiB")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
