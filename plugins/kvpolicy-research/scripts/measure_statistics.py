"""Measure SmolLM2-135M-Instruct's attention statistics over calibration texts into a file.

The texts are the lab's ``CALIBRATION_FILES`` (disjoint from the frontier's held-out texts), ``--texts`` of
them at ``--context`` tokens; the file (:func:`kvpolicy_research.calibration.save`) serves
``CalibratedRotation(statistics=...)``. Needs the lab (``pip install -e lab``)::

    python plugins/kvpolicy-research/scripts/measure_statistics.py --texts 3 --out smollm2.stats.safetensors
"""

from __future__ import annotations

import argparse

import torch
from kvpolicy_research import calibration

from kvpolicy_lab.eval.models import load_smollm2
from kvpolicy_lab.eval.tasks import CALIBRATION_FILES, LanguageModeling


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--texts", type=int, default=3)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    calib = LanguageModeling(samples_per_context=args.texts, tokens=1, files=CALIBRATION_FILES)
    texts = [torch.tensor([s.ids[: args.context]]) for s in calib.samples(tokenizer, args.context, 0)]
    path = calibration.save(calibration.measure(model, texts), args.out)
    print(f"{path}: {sum(t.numel() for t in texts)} tokens from {len(texts)} texts")


if __name__ == "__main__":
    main()
