"""Check every shipped preset against the tail rule, from the rows of a run of
``examples/configs/frontier-tail.toml``.

The rule: a preset is not shipped if its relative tail (the 99.9th percentile of the per-token KL over its
mean) is more than 3× the one-liner's at the same bits per element; the target beside it: the 99.9th
percentile at most 10× the mean (:mod:`kvpolicy_lab.eval.tail` defines both)::

    kvpolicy ablate --config examples/configs/frontier-tail.toml --out results/frontier-tail --threads 2
    python scripts/check_tail.py results/frontier-tail

Prints one line per shipped preset; exits 1 when one breaks the rule or has no row in the run, 0 when
every shipped preset was measured and passes, and 2 on a bad argument.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvpolicy_lab.eval.tail import check_run, verdict_line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="check_tail.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="the run directory (kvpolicy ablate --out DIR)")
    parser.add_argument("--context", type=int, default=2048, help="the context whose cells are checked")
    parser.add_argument("--model", default="smollm2", help="the model whose shipped presets are checked")
    args = parser.parse_args(argv)
    if not (args.run / "config.json").is_file() or not (args.run / "results.jsonl").is_file():
        parser.error(f"run: {str(args.run)!r} holds no config.json and results.jsonl; run kvpolicy ablate first")
    verdicts = check_run(args.run, args.context, args.model)
    for v in verdicts:
        print(verdict_line(v))
    broken = [v.preset for v in verdicts if not v.passes_rule]
    print(f"{len(verdicts) - len(broken)} of {len(verdicts)} shipped presets measured and within the rule"
          + (f"; not: {', '.join(broken)}" if broken else ""))  # fmt: skip
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
