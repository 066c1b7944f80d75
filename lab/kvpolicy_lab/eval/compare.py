"""Shared set-up of the ablation examples: one model, teacher-forced samples, and caches measured on them.

The scripts in ``examples/`` compare a few caches on the same teacher-forced language-modelling
samples; this module holds what they have in common (the command-line options, loading the model
and the uncompressed references, measuring a :class:`~kvpolicy_lab.eval.caches.CacheSpec`, and the
quality columns they print) so that each script shows only its own comparison.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from kvpolicy_lab.eval import measure
from kvpolicy_lab.eval.caches import CacheSpec
from kvpolicy_lab.eval.measure import Metric
from kvpolicy_lab.eval.runner import open_model
from kvpolicy_lab.eval.tasks import LanguageModeling

#: model, tokens scored and window of ``--smoke`` (a tiny random model, seconds)
SMOKE_MODEL, SMOKE_TOKENS, SMOKE_WINDOW = "tiny-llama", 8, 8


def example_parser(description: str, window_help: str | None = None) -> argparse.ArgumentParser:
    """A parser with the options every example takes: ``--smoke``, ``--context``, ``--tokens``, ``--window``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--smoke", action="store_true", help="tiny random model, tiny sizes (for CI)")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--window", type=int, default=42, help=window_help)
    return parser


@dataclass
class TeacherForced:
    """A model with teacher-forced samples and their uncompressed references.

    Attributes
    ----------
    model, tokenizer
        What :func:`~kvpolicy_lab.eval.runner.open_model` returned.
    context, tokens, window
        Prefill length, tokens scored after it, and the policy window the example uses.
    samples, refs
        One :class:`~kvpolicy_lab.eval.tasks.LanguageModeling` sample (seed 0) and its reference run.
    """

    model: Any
    tokenizer: Any
    context: int
    tokens: int
    window: int
    samples: list
    refs: list

    @classmethod
    def open(cls, args: argparse.Namespace, smoke_context: int = 128) -> TeacherForced:
        """SmolLM2 with ``args``' sizes, or with ``--smoke`` a tiny random model with tiny sizes."""
        name, context, tokens, window = "smollm2", args.context, args.tokens, args.window
        if args.smoke:
            name, context, tokens, window = SMOKE_MODEL, smoke_context, SMOKE_TOKENS, SMOKE_WINDOW
        model, tok = open_model(name)
        samples = LanguageModeling(samples_per_context=1, tokens=tokens).samples(tok, context, seed=0)
        refs = [measure.reference(model, s) for s in samples]
        return cls(model, tok, context, tokens, window, samples, refs)

    def measure(self, spec: CacheSpec) -> dict[str, Metric]:
        """ΔNLL, KL, top-1, attention error, bytes held... of ``spec``'s cache, by metric name."""
        metrics = measure.teacher_forced(self.model, self.samples, self.refs, lambda: spec.build(self.model))
        return {m.name: m for m in metrics}


def quality_header(nll_width: int = 11) -> str:
    """Column titles of :func:`quality_cells` with the same ``nll_width``."""
    return f"{'ΔNLL nats':>{nll_width + 9}}{'KL nats':>10}{'top-1':>8}{'attn err':>10}"


def quality_cells(m: dict[str, Metric], nll_width: int = 11) -> str:
    """ΔNLL ± its standard error, KL, top-1 agreement and attention error of :meth:`TeacherForced.measure`."""
    d = m["delta_nll"]
    kl, top1, attn = m["kl"].value, m["top1"].value, m["attn_error"].value
    return f"{d.value:>+{nll_width}.4f} ± {d.se:.4f}{kl:>10.4f}{top1:>8.1%}{attn:>10.4f}"
