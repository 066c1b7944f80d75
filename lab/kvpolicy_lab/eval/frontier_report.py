"""``docs/frontier.md`` from an ablation run of ``examples/configs/frontier.toml``: quality per byte.

Every cache of the run is one point per model: bits per element (every byte held, full-precision
tensors counted at 16 bits: ``bits_per_element_16``; on a hybrid model such as Gemma-3 the same over
its full-attention layers, ``bits_per_element_16_global``, the layers a cache compresses) against
the teacher-forced next-token KL of the ``lm`` task. A point is on the *frontier* when no other
point holds as few or fewer bits with a lower KL. The first model of the grid carries the issues'
targets; every further model gets its own table and plot and a comparison of its ordering of the
shared caches with the first model's. The page is generated, never edited by hand: the tables, the
Pareto plots and each verdict are computed from ``results.jsonl``.

The page puts each section's plot first, then the caches the plot names (the frontier, the presets and the
published anchors) under readable names, with the grid's label last; how the page was made, the naming
scheme of the labels and the targets of the grid come after the sections. The table of every cache
measured, with all its metrics, goes to ``caches.md`` in the run directory, beside the rows it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpolicy_lab.eval.cache_names import PRESET_CELLS, PRESET_NAMES, composition_names
from kvpolicy_lab.eval.markdown import md_table
from kvpolicy_lab.eval.plots import _pyplot, _save
from kvpolicy_lab.eval.runner import current_rows, read_rows, report_rows
from kvpolicy_lab.eval.stats import spearman
from kvpolicy_lab.eval.summary import PASS_RATE_NOTE, fmt
from kvpolicy_lab.eval.tail import tail_section

#: where the page's plots go, relative to the page's directory (the links in the page use it as written)
IMAGE_DIR = "img/frontier"

#: the file, in the run directory, that holds the table of every cache measured (the page names it)
TABLES = "caches.md"
#: the first line of a generated page's note, above the commands that regenerate it
GENERATED = ("This page is generated from the rows of an ablation run; do not edit it by hand. Regenerate it with "
             "(the first command runs the cells the directory lacks, the second writes the page):")  # fmt: skip
#: the quality metrics of the table, in order: (task, metric)
COLUMNS = (
    ("lm", "delta_nll"), ("lm", "kl"), ("lm", "kl_worst"), ("lm", "top1"), ("passkey", "accuracy"),
    ("greedy", "identical"), ("greedy", "first_divergence"),
)  # fmt: skip
#: the bits column: full-precision tensors at 16 bits (the model runs in float32 on CPU)
BITS = "bits_per_element_16"
#: the bits of a hybrid model's full-attention layers (recorded for hybrid models only)
GLOBAL_BITS = "bits_per_element_16_global"
#: how the page introduces the built-in models (others by their name)
MODEL_TITLES = {
    "smollm2": "SmolLM2-135M-Instruct",
    "gemma3-270m": "Gemma-3-270M",
}
MODEL_SHORT = {"smollm2": "SmolLM2", "gemma3-270m": "Gemma-3"}
#: measurements of a model that another grid makes, named in its section of the page (links relative to docs/)
ELSEWHERE = {
    "gemma3-270m": "Needles in a haystack at 4k and 8k tokens, which reach the answer only through the full-attention "
    "layers, are measured by another grid (`examples/configs/gemma-niah.toml`): the lab notebook's "
    "`lab/notebook/results-gemma3.md`, section *Needles at 4k and 8k*.",
}
MODEL_NOTES = {
    "smollm2": "30 layers, 3 KV heads, head_dim 64; every layer full attention",
    "gemma3-270m": "the base model; 18 layers, 1 KV head, head_dim 256, QK-norm; 15 sliding-window layers (512 "
                   "tokens) stay transformers' own and the 3 full-attention layers (5, 11, 17) are the ones every "
                   "cache compresses",
}  # fmt: skip
#: where the tail run (``examples/configs/frontier-tail.toml``) was measured
TAIL_HARDWARE = ("2 CPU cores (AMD EPYC, shared with other jobs), as two shards (`--shard 0/2` and `1/2`, "
                 "`--threads 1`) merged with `--merge`, float32")  # fmt: skip
#: caches drawn as anchors (labels of the committed config)
ANCHORS = ("hf-quanto-2b", "hf-quanto-4b", "hf-hqq-2b", "hf-hqq-4b", "logquant", "kivi")


@dataclass(frozen=True)
class Point:
    """One cache at one context: its bits per element and its quality metrics."""

    cache: str
    bits: float
    #: (task, metric) -> (value, standard error, samples)
    values: dict[tuple[str, str], tuple[float, float | None, int | None]]
    #: the whole cache's bits per element where :attr:`bits` counts a hybrid model's global layers only
    whole_bits: float | None = None

    @property
    def kl(self) -> float:
        return self.values.get(("lm", "kl"), (float("nan"), None))[0]

    @property
    def kl_se(self) -> float:
        """The standard error of :attr:`kl` over tokens (0 when not recorded)."""
        se = self.values.get(("lm", "kl"), (float("nan"), None))[1]
        return 0.0 if se is None or se != se else se

    @property
    def kl_worst(self) -> float:
        """The largest per-text mean KL (NaN when the cell did not record it)."""
        return self.values.get(("lm", "kl_worst"), (float("nan"), None))[0]

    @property
    def top1(self) -> float:
        return self.values.get(("lm", "top1"), (float("nan"), None))[0]


def points(rows: list[dict[str, Any]], context: int, model: str | None = None) -> list[Point]:
    """The caches measured on ``lm`` at ``context`` (of ``model``, if given), sorted by bits per element.

    A hybrid model's point counts its full-attention layers (``bits_per_element_16_global``), with the
    whole cache's figure in :attr:`Point.whole_bits`."""
    out = []
    mine_rows = [r for r in rows if r["context"] == context and (model is None or r["model"] == model)]
    caches = dict.fromkeys(r["cache"] for r in mine_rows if r["task"] == "lm")
    for cache in caches:
        mine = {(r["task"], r["metric"]): r for r in mine_rows if r["cache"] == cache}
        if ("lm", BITS) not in mine or ("lm", "kl") not in mine:
            continue
        values = {key: (mine[key]["value"], mine[key].get("se"), mine[key].get("n")) for key in COLUMNS if key in mine}
        if ("lm", GLOBAL_BITS) in mine:
            out.append(Point(cache, mine[("lm", GLOBAL_BITS)]["value"], values, mine[("lm", BITS)]["value"]))
        else:
            out.append(Point(cache, mine[("lm", BITS)]["value"], values))
    return sorted(out, key=lambda p: (p.bits, p.kl))


def errors(rows: list[dict[str, Any]], context: int, model: str) -> dict[str, str]:
    """Caches whose ``lm`` cell at ``context`` recorded an error instead of measurements: label -> message
    (``rows``: :func:`~kvpolicy_lab.eval.runner.report_rows`, which keep a failed cell's error row)."""
    return {r["cache"]: r["extra"].get("error", "")
            for r in rows if r["context"] == context and r["model"] == model and r["task"] == "lm"
            and r["metric"] == "error"}  # fmt: skip


def frontier(pts: list[Point]) -> list[Point]:
    """The Pareto-optimal points (fewest bits for their KL), by increasing bits."""
    best = float("inf")
    out = []
    for p in sorted(pts, key=lambda p: (p.bits, p.kl)):
        if p.kl < best:
            out.append(p)
            best = p.kl
    return out


def best_within(pts: list[Point], bits: float, exclude: tuple[str, ...] = ()) -> Point | None:
    """The lowest-KL point at or under ``bits`` bits per element."""
    inside = [p for p in pts if p.bits <= bits + 1e-9 and p.cache not in exclude and p.kl == p.kl]
    return min(inside, key=lambda p: p.kl) if inside else None


def plot_labels(pts: list[Point], names: dict[str, str] | None = None) -> dict[str, str]:
    """The caches the plot names: the frontier, the anchors and the presets' cells (under the preset's name;
    the others under ``names``, readable composition names by label, or else their label).

    With a hundred caches on one axis every other name would overlap its neighbours; they stay grey dots,
    and the table beside the plot names them."""
    named = {p.cache for p in frontier(pts)} | set(ANCHORS) | set(PRESET_NAMES)
    names = names or {}
    return {p.cache: PRESET_NAMES.get(p.cache) or names.get(p.cache, p.cache) for p in pts if p.cache in named}


#: how each kind of point is drawn, and what the legend calls it
STYLES = {
    "anchor": ({"marker": "s", "color": "tab:red"}, "transformers' caches, published presets"),
    "preset": ({"marker": "D", "color": "tab:green"}, "kvpolicy's presets"),
    "frontier": ({"marker": "o", "color": "tab:blue"}, "on the frontier"),
    "other": ({"marker": "o", "color": "silver"}, "other caches (in the table of every cache)"),
}


def _kind(cache: str, on: set[str]) -> str:
    if cache in ANCHORS:
        return "anchor"
    if cache in PRESET_NAMES:
        return "preset"
    return "frontier" if cache in on else "other"


def frontier_figure(pts: list[Point], context: int, title: str = "SmolLM2-135M", hybrid: bool = False,
                    names: dict[str, str] | None = None, numbered: bool = False) -> Any:  # fmt: skip
    """Bits per element (log x) against KL (log y): the frontier joined in blue, anchors as red squares, the
    presets as green diamonds; only those are named (:func:`plot_labels`), beside their points or, past
    :data:`~kvpolicy_lab.eval.plots.INLINE_MAX` of them (or, ``numbered``, where names beside them would need
    leader lines: :func:`~kvpolicy_lab.eval.plots.crowded`), by number with a key beside the axes (the presets
    keep their names beside them).

    Returns
    -------
    matplotlib Figure
        Drawn and laid out (the caller saves or closes it).
    """
    from kvpolicy_lab.eval.label_placement import LabelSpec, artist_box, numbered_key, place_labels
    from kvpolicy_lab.eval.plot_style import log_axis
    from kvpolicy_lab.eval.plots import DPI, INLINE_MAX, crowded

    plt = _pyplot()
    front = frontier(pts)
    on = {p.cache for p in front}
    labels = plot_labels(pts, names)
    drawn = [p for p in pts if p.kl > 0]  # the uncompressed cache (KL 0) has no place on a log axis
    named = sorted((p for p in drawn if p.cache in labels), key=lambda p: (p.bits, p.kl))
    presets = frozenset(i for i, p in enumerate(named) if p.cache in PRESET_NAMES)  # named beside them always
    texts, key = numbered_key([labels[p.cache] for p in named], 0 if numbered else INLINE_MAX, keep=presets)
    fig, ax = plt.subplots(figsize=(11, 5.6) if key else (8.5, 5.2), dpi=DPI)
    for p in drawn:
        if p.cache not in labels:
            ax.scatter([p.bits], [p.kl], zorder=2, s=24, **STYLES[_kind(p.cache, on)][0])
    marks = [ax.scatter([p.bits], [p.kl], zorder=3, s=30, edgecolors="black", linewidths=0.4,
                        **STYLES[_kind(p.cache, on)][0]) for p in named]  # fmt: skip
    key_handles = [m for i, m in enumerate(marks) if i not in presets]
    line = [p for p in front if p.kl > 0]
    (front_line,) = ax.plot([p.bits for p in line], [p.kl for p in line], color="tab:blue", alpha=0.6, zorder=1)
    if drawn:  # a log axis needs positive data (a run of uncompressed caches only has none)
        ax.set_yscale("log")
        log_axis(ax, "x")
    where = "the full-attention layers" if hybrid else "everything held"
    ax.set_xlabel(f"bits per element ({where}; full-precision tensors at 16 bits; log scale)")
    ax.set_ylabel("next-token KL vs uncompressed (nats, log)")
    ax.set_title(f"{title} · context {context}", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    kinds = [k for k in STYLES if any(_kind(p.cache, on) == k for p in drawn)]
    handles = [front_line] + [plt.Line2D([], [], ls="", ms=6, **_marker(STYLES[k][0])) for k in kinds]
    texts_legend = ["frontier"] + [STYLES[k][1] for k in kinds]
    if key:
        legend = fig.legend(handles, texts_legend, loc="upper right", bbox_to_anchor=(0.995, 0.95), fontsize=7,
                            frameon=False)  # fmt: skip
        key_legend = fig.legend(key_handles, key, loc="lower right", bbox_to_anchor=(0.995, 0.03), fontsize=7,
                                frameon=False, title="numbered points (fewest bits first)",
                                title_fontsize=7)  # fmt: skip
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        width = max(b[2] - b[0] for b in (artist_box(legend, r), artist_box(key_legend, r)))
        fig.tight_layout(rect=(0, 0, 1 - width / fig.bbox.width - 0.01, 1))
        obstacles = []
    else:
        legend = ax.legend(handles, texts_legend, fontsize=7, loc="upper right")
        fig.tight_layout()
        fig.canvas.draw()
        obstacles = [artist_box(legend, fig.canvas.get_renderer())]
    placed = place_labels(ax, [p.bits for p in named], [p.kl for p in named], texts, spec=LabelSpec(fontsize=7),
                          colors=[STYLES[_kind(p.cache, on)][0]["color"] for p in named],
                          points=[(p.bits, p.kl) for p in drawn], obstacles=obstacles)  # fmt: skip
    if key is None and crowded(placed):
        plt.close(fig)
        return frontier_figure(pts, context, title, hybrid, names, numbered=True)
    return fig


def _marker(style: dict[str, str]) -> dict[str, str]:
    return {"marker": style["marker"], "color": style["color"]}


def plot(path: Path, pts: list[Point], context: int, title: str = "SmolLM2-135M", hybrid: bool = False,
         names: dict[str, str] | None = None) -> Path:  # fmt: skip
    """Write :func:`frontier_figure` to ``path`` (PNG); returns ``path``."""
    return _save(_pyplot(), frontier_figure(pts, context, title, hybrid, names), path, layout=False)


def _table(pts: list[Point]) -> str:
    on = {p.cache for p in frontier(pts)}
    present = [key for key in COLUMNS if any(key in p.values for p in pts)]
    names = {"delta_nll": "ΔNLL (nats)", "kl": "KL (nats)", "kl_worst": "KL, worst text", "top1": "top-1",
             "accuracy": "passkey",
             "identical": "greedy identical", "first_divergence": "first divergence"}  # fmt: skip
    whole = any(p.whole_bits is not None for p in pts)
    head = ["cache", "bits/el, global layers" if whole else "bits/el", *(["bits/el, whole cache"] if whole else []),
            *[names[m] for _, m in present]]  # fmt: skip
    body = []
    for p in pts:
        label = f"**`{p.cache}`** ★" if p.cache in on else f"`{p.cache}`"
        if p.cache in PRESET_NAMES:
            label += f" (`{PRESET_NAMES[p.cache]}`)"
        cells = [label, f"{p.bits:.2f}"]
        if whole:
            cells.append("–" if p.whole_bits is None else f"{p.whole_bits:.2f}")
        for key in present:
            value, se, n = p.values.get(key, (None, None, None))
            cells.append(fmt(key[1], value, se if key[1] not in ("kl", "kl_worst") else None, n))
        body.append(cells)
    return md_table(head, body)


def _named_table(pts: list[Point], names: dict[str, str]) -> str:
    """The caches the plot names (:func:`plot_labels`: the frontier, the presets, the anchors), fewest bits
    first, under their readable names (a preset by its name), with KL, top-1 and the grid's label last."""
    on = {p.cache for p in frontier(pts)}
    labels = plot_labels(pts, names)
    whole = any(p.whole_bits is not None for p in pts)
    head = ["cache", "bits/el, global layers" if whole else "bits/el", *(["bits/el, whole cache"] if whole else []),
            "KL (nats)", "top-1", "grid label"]  # fmt: skip
    body = []
    for p in pts:
        if p.cache not in labels:
            continue
        name = f"`{labels[p.cache]}`" if p.cache in PRESET_NAMES else labels[p.cache]
        cells = [f"**{name}** ★" if p.cache in on else name, f"{p.bits:.2f}"]
        if whole:
            cells.append("–" if p.whole_bits is None else f"{p.whole_bits:.2f}")
        cells += [fmt("kl", p.kl, None, None), fmt("top1", p.top1, None, None), f"`{p.cache}`"]
        body.append(cells)
    return md_table(head, body)


#: issue 11's quality targets by context: (bits per element, KL at most, top-1 at least or None)
TARGETS = {2048: ((3.5, 0.08, 0.88), (4.5, 0.015, 0.96)), 8192: ((2.9, 0.1, None),)}
#: issue 14's target at 2k ("2-bit memory at 4-bit quality")
PART2_TARGET = (3.0, 0.02, 0.95)
#: the stretch targets by context (below 2.5 bits; 2-bit memory at better than transformers' 4-bit quality)
PART3_TARGETS = {2048: ((2.5, 0.04, None), (3.0, 0.015, 0.95)), 8192: ((2.0, 0.06, None),)}
#: the largest worst-text KL a shipped preset may have, as a multiple of its mean KL
WORST_TEXT_FACTOR = 2.0


def _target_line(pts: list[Point], bits: float, kl_max: float, top_min: float | None, prefix: str = "") -> str:
    """Whether a cache at or under ``bits`` meets the target: the one with the fewest bits that does, or
    else the lowest-KL cache within the budget, with "not met"."""
    want = f"KL ≤ {kl_max}" + ("" if top_min is None else f", top-1 ≥ {top_min:.0%}")
    inside = [p for p in pts if p.bits <= bits + 1e-9 and p.kl == p.kl]
    meets = [p for p in inside if p.kl <= kl_max and (top_min is None or p.top1 >= top_min)]
    if not inside:
        return f"- {prefix}At ≤ {bits} bits per element: no cache measured."
    if meets:
        p, how, verdict = min(meets, key=lambda p: (p.bits, p.kl)), "Fewest bits meeting it", "met"
    else:
        p, how, verdict = min(inside, key=lambda p: p.kl), "Best", "not met"
    return (f"- {prefix}{how} at ≤ {bits} bits per element: `{p.cache}` ({p.bits:.2f} bits), KL {p.kl:.3f}, "
            f"top-1 {p.top1:.1%} (target {want}: {verdict}).")  # fmt: skip


def _verdicts(pts: list[Point], context: int = 2048) -> list[str]:
    """Each target of issues 11 and 14 at ``context`` and each shipped preset, with the number reached and
    the cache reaching it (a target at a budget is met when any cache within the budget meets all of it)."""
    by = {p.cache: p for p in pts}
    out = []
    a, b = by.get("log42-k2v2"), by.get("log42-k2v2-rot")
    if a and b and b.kl > 0:
        factor = a.kl / b.kl
        verdict = "met" if factor >= 2.5 else "not met"
        out.append(f"- Rotation at equal bits (log, W=42, K2V2: {a.bits:.2f} vs {b.bits:.2f} bits): KL {a.kl:.3f} → "
                   f"{b.kl:.3f}, **{factor:.2f}× lower** (target ≥ 2.5×: {verdict}).")  # fmt: skip
    fits = (("mse", 'fit="mse"'), ("kmse", 'key_fit="mse"'),
            ("kg128-kmse", 'key_fit="mse", key_group_size=128: the defaults'))  # fmt: skip
    for base, suffix, how in [(b, s, h) for b in ("log42-k2v2", "log42-k2v2-rot") for s, h in fits]:
        plain, fitted = by.get(base), by.get(f"{base}-{suffix}")
        if plain and fitted and fitted.kl > 0:
            change = plain.kl / fitted.kl
            word = f"**{change:.2f}× lower**" if change >= 1 else f"**{1 / change:.2f}× higher**"
            equal = " at equal bits" if abs(plain.bits - fitted.bits) < 0.005 else ""
            out.append(f"- Fitted ranges{equal} (`{base}` vs `{base}-{suffix}`, `{how}`: {plain.bits:.2f} vs "
                       f"{fitted.bits:.2f} bits): KL {plain.kl:.3f} → {fitted.kl:.3f}, {word}.")  # fmt: skip
    out += [_target_line(pts, *target) for target in TARGETS.get(context, ())]
    hf4 = by.get("hf-quanto-4b")
    if hf4:
        within = [p for p in pts if p.bits <= 0.8 * hf4.bits and p.kl < hf4.kl and p.cache not in ANCHORS]
        if within:
            p = min(within, key=lambda p: p.bits)
            saved = 1 - p.bits / hf4.bits
            out.append(f"- transformers' `QuantizedCache(quanto, 4)`: KL {hf4.kl:.4f} at {hf4.bits:.2f} bits; "
                       f"`{p.cache}` has a lower KL ({p.kl:.4f}) with {saved:.0%} fewer bits.")  # fmt: skip
    if context == 2048:
        out.append(_target_line(pts, *PART2_TARGET, prefix="2-bit memory at 4-bit quality: "))
    out += [_target_line(pts, *target, prefix="Stretch target: ") for target in PART3_TARGETS.get(context, ())]
    return out + _preset_lines(pts)


def _preset_lines(pts: list[Point]) -> list[str]:
    """Each shipped preset's cell: its bits against its budget, and whether a cache beats it there."""
    by = {p.cache: p for p in pts}
    out = []
    for name, (budget, cell) in PRESET_CELLS.items():
        mine = by.get(cell)
        if mine is None:
            continue
        best = best_within(pts, budget)
        within = "within" if mine.bits <= budget + 1e-9 else "**over**"
        if best is None:
            rank = f"no cache measured holds ≤ {budget} bits"
        elif best.cache == cell:
            rank = f"the lowest KL measured at ≤ {budget} bits"
        elif best.kl >= mine.kl:  # the preset is over its budget, and nothing within it does better
            rank = (f"no cache measured at ≤ {budget} bits has a lower KL (the lowest there: `{best.cache}`, "
                    f"{best.kl:.4f} at {best.bits:.2f} bits)")  # fmt: skip
        elif mine.kl - best.kl <= (se := max(mine.kl_se, best.kl_se)):
            # the standard error over (correlated) tokens is a lower bound: a smaller gap is no evidence
            rank = (f"`{best.cache}` measured {mine.kl - best.kl:.4f} lower ({best.kl:.4f} at {best.bits:.2f} bits), "
                    f"within one standard error (± {se:.4f})")  # fmt: skip
        else:
            rank = f"**`{best.cache}` has a lower KL** there ({best.kl:.4f} at {best.bits:.2f} bits)"
        out.append(f"- Preset `{name}` = `{cell}`: {mine.bits:.2f} bits ({within} its {budget}-bit budget), "
                   f"KL {mine.kl:.4f}{_worst_clause(mine)}, top-1 {mine.top1:.1%}; {rank}.")  # fmt: skip
    return out


def _worst_clause(p: Point) -> str:
    """``" (worst text 0.0468, 1.5× the mean: within 2×)"``, or ``""`` when the cell did not record it."""
    if p.kl_worst != p.kl_worst or p.kl <= 0:
        return ""
    factor = p.kl_worst / p.kl
    verdict = "within" if factor <= WORST_TEXT_FACTOR else "**over**"
    return f" (worst text {p.kl_worst:.4f}, {factor:.1f}× the mean: {verdict} {WORST_TEXT_FACTOR:g}×)"


def _decode_sentence(rows: list[dict[str, Any]]) -> str:
    """How the compressed cells' decode steps attended, from their rows (``extra.attention_paths``)."""
    cells: dict[str, dict[str, int]] = {}
    for r in rows:
        if r["kind"] in ("compressed", "preset"):
            cells.setdefault(r["cell"], {}).update(r["extra"].get("attention_paths", {}))
    fused = sum(1 for p in cells.values() if p and all(k.startswith("fused") for k in p))
    text = (f"Decode attention: {fused} of the {len(cells)} compressed cells attended over the packed codes in "
            "every decode step (the fused path that `enable_fused(model)` installs)")  # fmt: skip
    if fused < len(cells):
        text += (f"; the other {len(cells) - fused} rebuilt the history in some or all steps (cells measured with "
                 "`decode = \"materialized\"`, or before the grid recorded its paths: their rows carry no "
                 "`attention_paths`)")  # fmt: skip
    return text + ". The two paths give the same measurements up to float rounding (`tests/test_ablate_runner.py`)."


#: one selection each at W=42, K2V2 with rotation: the policy ordering compared across models
POLICY_CELLS = {"log": "log42-k2v2-rot", "sink": "sink42-k2v2-rot", "recent": "recent42-k2v2-rot"}


def orderings(first: list[Point], other: list[Point], names: tuple[str, str]) -> list[str]:
    """Table and sentences comparing two models' KL on the caches both measured (compressed ones)."""
    a = {p.cache: p for p in first if p.kl > 0}
    b = {p.cache: p for p in other if p.kl > 0}
    shared = [c for c in b if c in a]
    if len(shared) < 2:
        return [f"Fewer than two compressed caches were measured on both {names[0]} and {names[1]}."]
    shared.sort(key=lambda c: a[c].kl)
    where = " (global layers)" if any(b[c].whole_bits is not None for c in shared) else ""
    head = ["cache", f"{names[0]} bits/el", f"{names[0]} KL", f"{names[1]} bits/el{where}", f"{names[1]} KL",
            f"KL {names[1]} / {names[0]}"]  # fmt: skip
    body = [[f"`{c}`", f"{a[c].bits:.2f}", f"{a[c].kl:.4f}", f"{b[c].bits:.2f}", f"{b[c].kl:.4f}",
             f"{b[c].kl / a[c].kl:.1f}×"] for c in shared]  # fmt: skip
    out = md_table(head, body).split("\n")
    pairs = [(x, y) for i, x in enumerate(shared) for y in shared[i + 1 :]]
    flipped = [(x, y) for x, y in pairs if (a[x].kl - a[y].kl) * (b[x].kl - b[y].kl) < 0]

    def clear(p: dict[str, Point], x: str, y: str) -> bool:
        return abs(p[x].kl - p[y].kl) > max(p[x].kl_se, p[y].kl_se)

    real = [(x, y) for x, y in flipped if clear(a, x, y) and clear(b, x, y)]
    rho = spearman([a[c].kl for c in shared], [b[c].kl for c in shared])
    out += ["", f"- Rank correlation of KL over the {len(shared)} caches measured on both (Spearman): {rho:.2f}."]
    if not flipped:
        out.append(f"- {names[1]} orders every pair of them as {names[0]} does.")
    else:
        text = (f"- {len(flipped)} of the {len(pairs)} pairs are ordered differently; {len(real)} of them by more "
                "than one standard error on both models")  # fmt: skip
        shown = real[:12]
        if shown:
            text += ": " + "; ".join(
                f"`{x}` {a[x].kl:.4f} < `{y}` {a[y].kl:.4f} on {names[0]}, but {b[x].kl:.4f} > {b[y].kl:.4f} on "
                f"{names[1]}" for x, y in shown) + ("; ..." if len(real) > len(shown) else "")  # fmt: skip
        out.append(text + ".")
    pol = {name: cell for name, cell in POLICY_CELLS.items() if cell in a and cell in b}
    if len(pol) >= 2:
        order_a = sorted(pol, key=lambda n: a[pol[n]].kl)
        order_b = sorted(pol, key=lambda n: b[pol[n]].kl)
        same = "the same on both models" if order_a == order_b else "**different between the models**"
        out.append(
            f"- Policy ordering (W=42, K2V2, rotation; lowest KL first): {names[0]} "
            + " < ".join(f"{n} ({a[pol[n]].kl:.4f})" for n in order_a)
            + f"; {names[1]} "
            + " < ".join(f"{n} ({b[pol[n]].kl:.4f})" for n in order_b)
            + f": {same}."
        )
    return out


def write_frontier_doc(
    run_dir: str | Path, doc: str | Path, command: str, tables: str | Path | None = None,
    tail: str | Path | None = None, tail_command: str = "",
) -> Path:  # fmt: skip
    """Write ``doc`` (``docs/frontier.md``) from ``run_dir``; plots go to ``<doc dir>/img/frontier``, and the
    table of every cache measured to ``tables`` (by default ``<run_dir>/caches.md``, :data:`TABLES`).

    ``command``: what regenerates the page, one command per line (``scripts/write_pages.py`` gives the
    ablation run and its own command line), shown in the page's last section. ``tail``: the run directory of
    ``examples/configs/frontier-tail.toml`` (the shipped presets and the one-liner with the tail of their
    per-token KL), made by ``tail_command``; its section (:func:`kvpolicy_lab.eval.tail.tail_section`) comes
    after the models' sections."""
    run, doc = Path(run_dir), Path(doc)
    config, rows = current_rows(run)
    failed = [r for r in report_rows(read_rows(run), set(config.get("cells", []))) if r["metric"] == "error"]
    img = doc.parent / IMAGE_DIR
    img.mkdir(parents=True, exist_ok=True)
    lm = config["tasks"].get("lm", {})
    greedy = config["tasks"].get("greedy", {})
    models = [m for m in config.get("models", []) if any(r["model"] == m for r in rows)] or sorted(
        {r["model"] for r in rows}
    )
    tables_file = Path(tables) if tables is not None else run / TABLES
    parts = [
        "# Quality per byte: the frontier",
        "",
        "How close each cache stays to the uncompressed model for the bytes it holds: bits per element (every "
        "byte held, full-precision tensors counted at 16 bits; a 16-bit `DynamicCache` is 16) against the "
        f"next-token KL from the uncompressed cache ({lm.get('samples_per_context', '?')} texts of Python "
        f"standard-library source × {lm.get('tokens', '?')} teacher-forced tokens; float32 on CPU). Each "
        "section's plot comes first; the table below it names the plotted caches: the frontier (★: no other "
        "cache holds as few bits with a lower KL), kvpolicy's presets and transformers' and the published "
        "caches. The [glossary](reference/glossary.md) defines the measures; how the page was made, and the "
        f"table of all {len(config.get('caches', []))} caches, are [at the end](#how-this-page-was-made).",
        "",
    ]
    names = composition_names(config.get("caches", []))
    tables = [
        "# Every cache of the frontier's grid",
        "",
        f"Written with `{doc.name}` by `scripts/write_pages.py frontier` from the rows of this directory; do not "
        "edit it by hand. Columns: bits per element (full-precision tensors at 16 bits), ΔNLL ± standard error "
        "over tokens, mean KL and the worst text's, top-1 agreement, passkey pass rate, and the greedy "
        "continuations' share identical to the uncompressed cache's and tokens before the first difference. "
        "★ marks the frontier.",
        "",
    ]
    targets: list[str] = []
    first: dict[int, list[Point]] = {}
    for i, model in enumerate(models):
        for context in sorted({r["context"] for r in rows if r["task"] == "lm" and r["model"] == model}):
            pts = points(rows, context, model)
            hybrid = any(p.whole_bits is not None for p in pts)
            stem = f"frontier_{context}" if i == 0 else f"frontier_{model}_{context}"
            png = plot(img / f"{stem}.png", pts, context, _title(model), hybrid, names)
            title = f"{_title(model)} · context {context}"
            parts += [f"## {title}", "", f"![bits per element vs KL at {context}]({IMAGE_DIR}/{png.name})", ""]
            if hybrid:
                parts += [
                    "Bits per element here count the full-attention layers, the ones a cache compresses, so that "
                    "they compare with the other model's; the whole cache's figure, which the sliding-window layers' "
                    "full-precision windows dominate at this context, is the next column.",
                    "",
                ]
            parts += [_named_table(pts, names), ""]
            tables += [f"## {title}", "", _table(pts), ""]
            planned = [c["label"] for c in config.get("caches", [])
                       if c["label"] in config.get("model_caches", {}).get(model, [c["label"]])
                       and c["label"] in config.get("context_caches", {}).get(str(context), [c["label"]])]  # fmt: skip
            measured = {p.cache for p in pts} | set(errors(failed, context, model))
            missing = [label for label in planned if label not in measured]
            if missing:
                parts += [f"Not measured yet ({len(missing)} of the grid's {len(planned)} caches for this model; "
                          "the commands at the end run them and skip the rest): "
                          + ", ".join(f"`{c}`" for c in missing) + ".", ""]  # fmt: skip
            refused = errors(failed, context, model)
            if refused:
                by_message: dict[str, list[str]] = {}
                for cache, message in refused.items():
                    by_message.setdefault(message[:200], []).append(f"`{cache}`")
                parts += ["Refused on this model (the error their cells recorded): "
                          + "; ".join(f"{', '.join(c)}: {m}" for m, c in by_message.items()), ""]  # fmt: skip
            if model in ELSEWHERE:
                parts += [ELSEWHERE[model], ""]
            parts += ["Presets:", "", *_preset_lines(pts), ""]
            if i == 0:
                first[context] = pts
                lines = [line for line in _verdicts(pts, context) if line not in _preset_lines(pts)]
                targets += [f"{title}:", "", *lines, ""]
            elif context in first:
                short = (MODEL_SHORT.get(models[0], models[0]), MODEL_SHORT.get(model, model))
                parts += [f"### {_title(model)} against {_title(models[0])} at context {context}", "",
                          *orderings(first[context], pts, short), ""]  # fmt: skip
    if tail is not None:
        tail_config, _ = current_rows(Path(tail))
        hardware = (f"{TAIL_HARDWARE}, torch {tail_config.get('torch', '?')}, transformers "
                    f"{tail_config.get('transformers', '?')}")  # fmt: skip
        parts += tail_section(tail, tail_command, hardware, _title)
    parts += [
        "## How this page was made",
        "",
        f"{GENERATED}",
        "",
        "```bash",
        *command.splitlines(),
        "```",
        "",
        f"Grid: `examples/configs/frontier.toml` — {len(config.get('caches', []))} caches, "
        f"{len({r['cell'] for r in rows})} cells finished. torch {config.get('torch', '?')}, transformers "
        f"{config.get('transformers', '?')}. The table of every cache, with ΔNLL, the worst text's KL, passkey "
        f"and greedy continuations, is written beside the rows, as `{TABLES}` in the run directory.",
        "",
        f"{'Models' if len(models) > 1 else 'Model'}: "
        + "; ".join(f"{_title(m)} ({MODEL_NOTES[m]})" if m in MODEL_NOTES else _title(m) for m in models)
        + ". float32 on CPU. "
        + (
            f"{_title(models[0])} runs every cache and carries the targets; "
            + ", ".join(_title(m) + _only_at(config, m) for m in models[1:])
            + " a subset, the same caches on the same texts "
            "(`[model_caches]` and `[model_contexts]` in the grid file), compared with it in its section. "
            if len(models) > 1
            else ""
        )
        + f"`lm`: {lm.get('samples_per_context', '?')} texts of Python standard-library source (the ablation's LM "
        f"files; no setting was tuned on them) × {lm.get('tokens', '?')} teacher-forced tokens after the context, "
        "scored against the uncompressed cache (ΔNLL ± standard error over tokens, KL, top-1 agreement). "
        f"`greedy`: {greedy.get('samples_per_context', '?')} of those contexts continued greedily for "
        f"{greedy.get('tokens', '?')} tokens, compared token by token with the uncompressed cache's continuation "
        "(share identical; tokens before the first difference). `passkey`: a 5-digit key at depths 10/50/90 %; "
        f"{PASS_RATE_NOTE}.",
        "",
        _decode_sentence(rows),
        "",
        "**Bits per element** count every byte held after the last token (codes, scales, zero-points, positions, "
        "key staging, the full-precision window and the rotation matrix) over tokens × layers × KV heads × (key "
        "dim + value dim), with full-precision tensors counted at 16 bits (what they hold in a 16-bit model; the "
        "model runs in float32 here). **Grid labels**: `log42-k3v2-rot` is the log policy with W=42, 3-bit "
        "min-max keys (per channel, groups of 64), 2-bit min-max values (per token, groups of 64) and "
        '`transform="hadamard"` (`-kg128` keys in groups of 128 tokens; the defaults, so the one-liner '
        '`CompressedCache(policy="log", bits=2)`, are `log42-k2v2-kg128-kmse`). A `c` after '
        "the bits is the codebook scheme (one scale per token and head, Lloyd-Max indices, always rotated: "
        "`v2c` = 2-bit codebook values), `l` the lattice scheme, `cm` or `lm` keys centred on their stream's mean "
        '(`key_centre=True`), `-n8` one-byte scales, `-qh` query-weighted keys (`transform="query-hadamard"`), '
        '`-lr4` a rank-4 low-rank part of the keys (`transform="lowrank"`), '
        "`-s4` 4 sink tokens at full precision, `-mse` min-max groups whose range is fitted for the least squared "
        'error (`fit="mse"`; `-kmse` the keys\' groups only, `key_fit="mse"`), and `-t4x64` or `-t44x32` a '
        "middle tier of 4-bit codebook keys "
        'and values for the demoted tokens that the log rule at W′ = 64 or 32 keeps (`action="tiered"`); '
        "every cache's exact composition is its entry in the grid file.",
        "",
    ]
    if targets:
        parts += ["### Targets", "", "What the grid set out to reach, and the cache that reaches each:", "",
                  *targets]  # fmt: skip
    doc.write_text("\n".join(parts).rstrip("\n") + "\n")
    tables_file.write_text("\n".join(tables).rstrip("\n") + "\n")
    return doc


def _only_at(config: dict[str, Any], model: str) -> str:
    """`` (context 2048 only)`` for a model the grid keeps to some of its contexts, else ``""``."""
    mine = config.get("model_contexts", {}).get(model)
    if mine is None or set(mine) >= set(config.get("contexts", [])):
        return ""
    return f" (context {', '.join(str(c) for c in sorted(mine))} only)"


def _title(model: str) -> str:
    return MODEL_TITLES.get(model, model)
