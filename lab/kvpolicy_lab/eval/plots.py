"""PNG plots of an ablation run: quality vs bytes held, ms/token vs context, attention error per layer.

Each plot has a ``*_figures`` function returning the matplotlib figures (for tests and for callers that
save them elsewhere) and a function writing them as PNGs into a run directory. Every series has its own
colour (:func:`~kvpolicy_lab.eval.plot_style.series_styles`), bytes are on log axes, and point labels are
placed where they overlap neither each other nor the markers (:mod:`kvpolicy_lab.eval.label_placement`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpolicy_lab.eval.cache_names import PRESET_NAMES
from kvpolicy_lab.eval.label_placement import LabelSpec, artist_box, data_box, numbered_key, place_labels
from kvpolicy_lab.eval.plot_style import darker, log_axis, series_styles

#: quality metric plotted against bytes held, per task (first one present)
QUALITY = ("delta_nll", "accuracy", "exact_match", "score")
#: quality metrics where lower is better (the others: higher is better)
LOWER_IS_BETTER = ("delta_nll", "kl")
#: at most this many caches are named on one quality plot: past it, the Pareto-optimal ones (and the
#: uncompressed cache); the others are grey dots, named in summary.md's tables
MAX_NAMED = 24
#: up to this many caches are named beside their points; past it they are numbered, with a key
INLINE_MAX = 12
#: resolution of the PNGs (figures are drawn at it, so label placement sees the pixels that are saved)
DPI = 110


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path, layout: bool = True) -> Path:
    """Lay out ``fig`` (unless ``layout`` is False: its labels were placed on the final layout), write it to
    ``path`` as PNG and close it; returns ``path``."""
    if layout:
        fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _by(rows: list[dict[str, Any]], metric: str) -> dict[tuple, dict[str, Any]]:
    return {(r["model"], r["task"], r["context"], r["cache"]): r for r in rows if r["metric"] == metric}


def _display_name(cache: str) -> str:
    """A cache's name on a plot: the preset's name for a shipped preset's cell, else its label."""
    return PRESET_NAMES.get(cache, cache)


def _pareto(points: list[tuple], lower_is_better: bool) -> set[str]:
    """The caches of ``points`` (``(mib, value, se, cache, equal_bytes)``) that no other cache beats with
    as few bytes or fewer."""
    best, out = None, set()
    for _mib, value, _, cache, _ in sorted(points, key=lambda p: (p[0], p[1] if lower_is_better else -p[1])):
        if best is None or (value < best if lower_is_better else value > best):
            out.add(cache)
            best = value
    return out


def quality_figures(rows: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """One figure per (model, task, context): the task's quality metric against bytes held (MiB, log axis).

    Returns
    -------
    list of (str, matplotlib Figure)
        The PNG file name of each figure and the figure (open: the caller saves or closes it).
    """
    plt = _pyplot()
    held = _by(rows, "bytes_held")
    out = []
    keys = sorted({(r["model"], r["task"], r["context"]) for r in rows if r["task"] != "speed"}, key=str)
    for model, task, context in keys:
        metric = next((m for m in QUALITY if any(r["metric"] == m and r["task"] == task for r in rows)), None)
        if metric is None:
            continue
        points = [
            (held[(model, task, context, r["cache"])]["value"] / 2**20, r["value"], r.get("se") or 0.0, r["cache"],
             r.get("equal_bytes", False))
            for r in rows
            if r["metric"] == metric and (r["model"], r["task"], r["context"]) == (model, task, context)
            and (model, task, context, r["cache"]) in held and held[(model, task, context, r["cache"])]["value"] > 0
        ]  # fmt: skip
        if not points:
            continue
        fig = _quality_figure(plt, points, metric, f"{model} · {task} · context {context}")
        out.append((f"quality_vs_bytes_{_slug(model)}_{task}_{context}.png", fig))
    return out


def _quality_figure(plt: Any, points: list[tuple], metric: str, title: str, numbered: bool = False) -> Any:
    """Draw one quality-vs-bytes figure from ``(mib, value, se, cache, equal_bytes)`` points: the named
    caches in colours of their own (hollow at --equal-bytes), labelled beside their points, or numbered
    with a key beside the axes when there are more than :data:`INLINE_MAX` or (``numbered``) when names
    beside the points would need leader lines (:func:`crowded`)."""
    named = {p[3] for p in points}
    if len(named) > MAX_NAMED:
        named = _pareto(points, metric in LOWER_IS_BETTER) | ({"uncompressed"} & named)
    shown = sorted((p for p in points if p[3] in named), key=lambda p: (p[0], p[1]))
    styles = series_styles(len(shown))
    names = [_display_name(p[3]) for p in shown]
    texts, key = numbered_key(names, 0 if numbered else INLINE_MAX)
    fig, ax = plt.subplots(figsize=(10, 5.4) if key else (8.5, 5.2), dpi=DPI)
    for k, ((x, y, se, _, eq), st) in enumerate(zip(shown, styles, strict=True)):
        ax.errorbar([x], [y], yerr=[se], fmt=st.marker, color=st.color, mfc="white" if eq else st.color,
                    mec=darker(st.color), ms=6.5, capsize=3, zorder=3, label=key[k] if key else None)  # fmt: skip
    for x, y, se, cache, _ in points:
        if cache not in named:
            ax.errorbar([x], [y], yerr=[se], fmt="o", color="silver", ms=4, capsize=2, zorder=1)
    log_axis(ax, "x")
    ax.set_xlabel("bytes held (MiB, log scale)")
    ax.set_ylabel(metric + (" (nats, vs uncompressed)" if metric == "delta_nll" else ""))
    notes = (["hollow markers: --equal-bytes"] if any(p[4] for p in points) else []) + (
        [f"grey: {len(points) - len(shown)} other caches, named in summary.md"] if len(shown) < len(points) else []
    )
    ax.set_title(title + (f"  ({'; '.join(notes)})" if notes else ""), fontsize=9)
    ax.grid(alpha=0.3, which="both")
    if key:
        _legend_right(fig, ax)
    else:
        fig.tight_layout()
    boxes = [data_box(ax, x, y - se, x, y + se, pad_px=3) for x, y, se, *_ in points if se]
    placed = place_labels(ax, [p[0] for p in shown], [p[1] for p in shown], texts, spec=LabelSpec(fontsize=7),
                          colors=[st.color for st in styles], points=[(p[0], p[1]) for p in points],
                          obstacles=boxes)  # fmt: skip
    if key is None and crowded(placed):
        plt.close(fig)
        return _quality_figure(plt, points, metric, title, numbered=True)
    return fig


def crowded(labels: list[Any]) -> bool:
    """Whether names placed beside their points are too far from them to read: more than two, or more than
    a quarter, of them needed a leader line (a key of numbers reads better then)."""
    far = sum(1 for a in labels if a.arrow_patch is not None)
    return far > max(2, len(labels) // 4)


def quality_vs_bytes(out: Path, rows: list[dict[str, Any]]) -> list[Path]:
    """One PNG per (model, task, context): the task's quality metric against bytes held."""
    plt = _pyplot()
    return [_save(plt, fig, out / name, layout=False) for name, fig in quality_figures(rows)]


def ms_figures(rows: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """Per model, decode ms/token and prefill ms against context, one line per cache (the speed task)."""
    plt = _pyplot()
    out = []
    for model in sorted({r["model"] for r in rows if r["task"] == "speed"}):
        caches = list(dict.fromkeys(r["cache"] for r in rows if r["model"] == model and r["task"] == "speed"))
        styles = dict(zip(caches, series_styles(len(caches)), strict=True))
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=DPI)
        for ax, metric in zip(axes, ("decode_ms", "prefill_ms"), strict=True):
            for cache in caches:
                pts = sorted((r["context"], r["value"]) for r in rows if r["model"] == model and r["task"] == "speed"
                             and r["metric"] == metric and r["cache"] == cache)  # fmt: skip
                if pts:
                    st = styles[cache]
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=st.marker, color=st.color,
                            mec=darker(st.color), label=_display_name(cache))  # fmt: skip
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("decode ms/token (median)" if metric == "decode_ms" else "prefill ms")
            ax.grid(alpha=0.3)
        fig.suptitle(f"{model}: cost vs context", fontsize=9)
        _legend_right(fig, axes[0])
        out.append((f"ms_vs_context_{_slug(model)}.png", fig))
    return out


def ms_vs_context(out: Path, rows: list[dict[str, Any]]) -> list[Path]:
    """Decode ms/token (and prefill ms) against context length, one line per cache, from the speed task."""
    plt = _pyplot()
    return [_save(plt, fig, out / name, layout=False) for name, fig in ms_figures(rows)]


def attention_error_figures(rows: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """Per (model, context), the attention-output relative error per layer, one line per cache."""
    plt = _pyplot()
    out = []
    keys = sorted({(r["model"], r["context"]) for r in rows if r["metric"] == "attn_error"}, key=str)
    for model, context in keys:
        mine = [r for r in rows if r["metric"] == "attn_error" and (r["model"], r["context"]) == (model, context)]
        styles = series_styles(len(mine))
        fig, ax = plt.subplots(figsize=(9.5, 4.6), dpi=DPI)
        for r, st in zip(mine, styles, strict=True):
            per = r["extra"].get("per_layer", [])
            ax.plot(range(len(per)), per, color=st.color, marker=st.marker, ms=3.5, mec=darker(st.color),
                    markevery=max(1, len(per) // 8),
                    lw=1, label=_display_name(r["cache"]))  # fmt: skip
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_ylabel("attention output relative error")
        ax.grid(alpha=0.3)
        ax.set_title(f"{model} · context {context}", fontsize=9)
        _legend_right(fig, ax)
        out.append((f"attn_error_layers_{_slug(model)}_{context}.png", fig))
    return out


def attention_error_layers(out: Path, rows: list[dict[str, Any]]) -> list[Path]:
    """Attention-output relative error per layer, one line per cache."""
    plt = _pyplot()
    return [_save(plt, fig, out / name, layout=False) for name, fig in attention_error_figures(rows)]


def _legend_right(fig: Any, ax: Any, fontsize: float = 7.0) -> Any:
    """The legend of ``ax``'s artists beside the figure's right edge (off the data), then the layout;
    returns the legend (None when nothing is labelled)."""
    handles, labels = ax.get_legend_handles_labels()
    if not handles:
        fig.tight_layout()
        return None
    legend = fig.legend(handles, labels, loc="center right", fontsize=fontsize, frameon=False,
                        ncol=1 if len(labels) <= 26 else 2)  # fmt: skip
    fig.canvas.draw()
    width = artist_box(legend, fig.canvas.get_renderer())
    fig.tight_layout(rect=(0, 0, 1 - (width[2] - width[0]) / fig.bbox.width - 0.01, 1))
    return legend


def write_plots(out: Path, rows: list[dict[str, Any]]) -> list[Path]:
    """Every plot the rows allow; returns the paths written."""
    rows = [r for r in rows if r["metric"] != "error"]
    return quality_vs_bytes(out, rows) + ms_vs_context(out, rows) + attention_error_layers(out, rows)


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in text)
