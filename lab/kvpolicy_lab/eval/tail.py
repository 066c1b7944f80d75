"""The tail of the per-token KL in an ablation run, and the shipping rule that bounds it.

A cache that is fine on average and wrong on one token in a thousand derails a long generation, so beside
the mean KL of the ``lm`` task the runner records ``kl_p99`` and ``kl_p999``: the 99th and 99.9th
percentiles of the per-token KL over every scored token of every text, by linear interpolation between
order statistics (:func:`kvpolicy_lab.quality.token_percentile`). The *relative tail* of a cache is its
``kl_p999`` over its mean KL.

The shipping rule: a preset is not shipped if its relative tail is more than :data:`RULE_FACTOR` times the
one-liner's at the same bits. The one-liner is ``CompressedCache(policy="log", bits=b)`` (the grid labels
of :data:`ONE_LINERS`, ``b`` = 2, 3, 4); its relative tail *at the same bits* as a preset is interpolated
linearly in bits per element between the two one-liner cells whose bits bracket the preset's, and is the
nearest one-liner cell's outside their range (:func:`one_liner_relative_tail`). A second, absolute target
asks every shipped preset for ``kl_p999 <= TARGET_FACTOR × mean``.

:func:`check` gives one :class:`Verdict` per shipped preset (:func:`shipped_presets`); a preset the run
has no row for is reported as not measured, never as passing. ``scripts/check_tail.py`` prints them and
exits 1 when a preset breaks the rule or was not measured.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpolicy.presets import BUILTIN_PRESETS
from kvpolicy_lab.eval.markdown import md_table
from kvpolicy_lab.eval.runner import current_rows

#: the one-liner ``CompressedCache(policy="log", bits=b)`` by ``b``: its grid labels (W=42, keys fitted for
#: the least squared error in groups of 128 tokens, the defaults)
ONE_LINERS = {2: "log42-k2v2-kg128-kmse", 3: "log42-k3v3-kg128-kmse", 4: "log42-k4v4-kg128-kmse"}
#: a shipped preset's relative tail may be at most this multiple of the one-liner's at the same bits
RULE_FACTOR = 3.0
#: the target: at every shipped preset, ``kl_p999`` at most this multiple of the mean KL
TARGET_FACTOR = 10.0
#: the bits column (full-precision tensors counted at 16 bits, as on the frontier page)
BITS = "bits_per_element_16"


@dataclass(frozen=True)
class Tail:
    """One cache's KL and its tail at one context (values in nats; ``bits`` per element at 16 bits)."""

    cache: str
    bits: float
    kl: float
    kl_worst: float
    kl_p99: float
    kl_p999: float
    kl_max: float
    #: scored tokens over all texts (what the percentiles pool)
    tokens: int

    @property
    def relative(self) -> float:
        """The relative tail, ``kl_p999 / kl`` (NaN when the mean is 0 or missing)."""
        return self.kl_p999 / self.kl if self.kl > 0 else math.nan


@dataclass(frozen=True)
class Verdict:
    """A shipped preset against the rule and the target (see the module's docstring)."""

    preset: str
    #: the preset's measurements, or None when the run has no row for it
    tail: Tail | None
    #: the one-liner's relative tail at the preset's bits, and how it was found (None when not measured)
    reference: float | None = None
    reference_from: str = ""

    @property
    def measured(self) -> bool:
        return self.tail is not None and self.reference is not None

    @property
    def ratio(self) -> float:
        """The preset's relative tail over the one-liner's at the same bits (NaN when not measured)."""
        if self.tail is None or not self.reference:
            return math.nan
        return self.tail.relative / self.reference

    @property
    def passes_rule(self) -> bool:
        """Within :data:`RULE_FACTOR` of the one-liner's relative tail (False when not measured)."""
        return self.measured and self.ratio <= RULE_FACTOR

    @property
    def meets_target(self) -> bool:
        """``kl_p999 <= TARGET_FACTOR × kl`` (False when not measured)."""
        return self.tail is not None and self.tail.kl_p999 <= TARGET_FACTOR * self.tail.kl


def shipped_presets(model: str) -> list[str]:
    """The presets kvpolicy ships that serve ``model``: the ``kvpolicy-*`` presets (every model) and the
    shipped preset files named for it (``<model>-*``), in that order."""
    from kvpolicy import preset_files

    builtin = [name for name in BUILTIN_PRESETS if name.startswith("kvpolicy-")]
    return builtin + sorted(name for name in preset_files.names() if name.startswith(f"{model}-"))


def tails(rows: list[dict[str, Any]], context: int, model: str) -> dict[str, Tail]:
    """The caches of ``rows`` whose ``lm`` cell at ``context`` on ``model`` recorded the tail, by label."""
    mine: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r["task"] == "lm" and r["context"] == context and r["model"] == model:
            mine.setdefault(r["cache"], {})[r["metric"]] = r
    out = {}
    for cache, m in mine.items():
        if not all(k in m for k in (BITS, "kl", "kl_worst", "kl_p99", "kl_p999")):
            continue
        out[cache] = Tail(cache, m[BITS]["value"], m["kl"]["value"], m["kl_worst"]["value"], m["kl_p99"]["value"],
                          m["kl_p999"]["value"], m["kl_p999"]["extra"]["max"], m["kl_p999"]["n"])  # fmt: skip
    return out


def one_liner_relative_tail(measured: dict[str, Tail], bits: float) -> tuple[float, str] | None:
    """The one-liner's relative tail at ``bits`` per element, and a few words on where it comes from.

    Linear in bits per element between the two one-liner cells (:data:`ONE_LINERS`) whose bits bracket
    ``bits``; below or above all of them, the nearest one's. None when the run measured no one-liner."""
    points = sorted((t.bits, t.relative, t.cache) for t in measured.values() if t.cache in ONE_LINERS.values())
    points = [p for p in points if not math.isnan(p[1])]
    if not points:
        return None
    if bits <= points[0][0]:
        return points[0][1], f"the nearest, `{points[0][2]}` at {points[0][0]:.2f} bits, the fewest measured"
    if bits >= points[-1][0]:
        return points[-1][1], f"the nearest, `{points[-1][2]}` at {points[-1][0]:.2f} bits, the most measured"
    for (b0, r0, c0), (b1, r1, c1) in itertools.pairwise(points):
        if b0 <= bits <= b1:
            w = (bits - b0) / (b1 - b0)
            return r0 + w * (r1 - r0), f"interpolated between `{c0}` at {b0:.2f} bits and `{c1}` at {b1:.2f}"
    raise AssertionError("unreachable: the bits lie within the measured range")


def check(rows: list[dict[str, Any]], context: int = 2048, model: str = "smollm2") -> list[Verdict]:
    """Every shipped preset of ``model`` (:func:`shipped_presets`) against the rule and the target, from the
    rows of a run whose preset cells are labelled by the presets' names."""
    measured = tails(rows, context, model)
    out = []
    for name in shipped_presets(model):
        mine = measured.get(name)
        ref = None if mine is None else one_liner_relative_tail(measured, mine.bits)
        out.append(Verdict(name, mine, *(ref or (None, ""))))
    return out


def check_run(run_dir: str | Path, context: int = 2048, model: str = "smollm2") -> list[Verdict]:
    """:func:`check` on the current rows of a run directory (``kvpolicy ablate --out``)."""
    _, rows = current_rows(Path(run_dir))
    return check(rows, context, model)


def verdict_line(v: Verdict) -> str:
    """One line of the page and the script: the preset, its tail, and both verdicts."""
    if v.tail is None:
        return f"- `{v.preset}`: not measured (the run has no row for it): neither the rule nor the target checked."
    t = v.tail
    head = (f"- `{v.preset}`: {t.bits:.2f} bits, KL {t.kl:.4f}, p99.9 {t.kl_p999:.4f} = {t.relative:.1f}× the "
            "mean")  # fmt: skip
    if v.reference is None:
        rule = "rule: no one-liner measured"
    else:
        word = "passes" if v.passes_rule else "**fails**"
        rule = (f"the one-liner's relative tail there {v.reference:.1f}× ({v.reference_from}), so {v.ratio:.2f}× "
                f"it: {word} the rule (≤ {RULE_FACTOR:g}×)")  # fmt: skip
    target = "reached" if v.meets_target else "**not reached**"
    return f"{head}; {rule}; target p99.9 ≤ {TARGET_FACTOR:g}× the mean: {target}."


#: how the page names the one-liner's cells
ONE_LINER_NAMES = {label: f"one-liner, `bits={b}`" for b, label in ONE_LINERS.items()}


def tail_section(run_dir: str | Path, command: str, hardware: str, title: Callable[[str], str]) -> list[str]:
    """The frontier page's section on the tail, as lines of Markdown: a table of the run's caches (the
    shipped presets and the one-liner) with their mean, worst-text and tail KLs, one verdict line per shipped
    preset (:func:`verdict_line`), and how the rows were measured (``command`` run on ``hardware``).

    The run's first model and context are the ones reported; ``title`` names a model in the heading."""
    config, rows = current_rows(Path(run_dir))
    model, context = config.get("models", ["smollm2"])[0], config.get("contexts", [2048])[0]
    measured = tails(rows, context, model)
    lm = config.get("tasks", {}).get("lm", {})
    head = ["cache", "bits/el", "KL (nats)", "worst text", "p99", "p99.9", "largest", "p99.9 / mean"]
    body = [[ONE_LINER_NAMES.get(t.cache, f"`{t.cache}`"), f"{t.bits:.2f}", f"{t.kl:.4f}", f"{t.kl_worst:.4f}",
             f"{t.kl_p99:.4f}", f"{t.kl_p999:.4f}", f"{t.kl_max:.4f}", f"{t.relative:.1f}×"]
            for t in sorted(measured.values(), key=lambda t: t.bits)]  # fmt: skip
    verdicts = check(rows, context, model)
    tokens = {t.tokens for t in measured.values()}
    planned = [c["label"] for c in config.get("caches", [])]
    missing = [label for label in planned if label not in measured]
    out = [
        "## The tail of the per-token KL",
        "",
        f"{title(model)} at context {context}. A cache that is fine on average and wrong on one token in a "
        "thousand derails a long generation, so beside the mean KL each cache's tail: the 99th and 99.9th "
        "percentiles (p99, p99.9) of the per-token KL "
        f"pooled over every scored token of every text ({' or '.join(str(n) for n in sorted(tokens)) or '?'} "
        f"tokens: {lm.get('samples_per_context', '?')} texts × {lm.get('tokens', '?')}), by linear "
        "interpolation between the sorted values (numpy's and torch's default), and the largest. The same "
        "texts and settings as the sections above; measured in a run of its own, so the means can differ from "
        f"theirs in the last digit.{_few(tokens)}",
        "",
        md_table(head, body, ["left"] + ["right"] * (len(head) - 1)),
        "",
        f"The rule: a preset is not shipped if its relative tail (p99.9 / mean) is more than {RULE_FACTOR:g}× the "
        'one-liner\'s (`CompressedCache(policy="log", bits=b)`) at the same bits per element, interpolated '
        "linearly between the one-liner's cells around the preset's bits (the nearest one outside them). The "
        f"target: p99.9 at most {TARGET_FACTOR:g}× the mean.",
        "",
        *[verdict_line(v) for v in verdicts],
        "",
    ]
    if missing:
        out += [f"Not measured yet: {', '.join(f'`{c}`' for c in missing)} (the command below runs them and "
                "skips the rest).", ""]  # fmt: skip
    out += [f"Reproduce with `{command}`; measured on {hardware}; `python scripts/check_tail.py {run_dir}` "
            "checks the rule and exits 1 when a shipped preset breaks it or has no row.", ""]  # fmt: skip
    return out


def _few(tokens: set[int]) -> str:
    """A sentence on which order statistics the 99.9th percentile of ``n`` values lies between (one ``n``)."""
    if len(tokens) != 1:
        return ""
    n = next(iter(tokens))
    h = (n - 1) * 0.999
    top = n - math.floor(h)  # the rank from the top of the lower one (1: the largest)
    if top <= 1:
        return " p99.9 is then the largest token KL."
    if top == 2:
        return f" With {n} tokens p99.9 lies between the two largest token KLs, so one or two tokens decide it."
    return (f" With {n} tokens p99.9 lies between the {_nth(top)} and the {_nth(top - 1)} largest token KL, so a "
            "handful of tokens decide it.")  # fmt: skip


def _nth(k: int) -> str:
    """``2`` -> ``"2nd"``, ``1`` -> ``"1st"`` (the largest is ``"1st"``)."""
    return f"{k}{'th' if 10 <= k % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')}"
