"""Markdown tables of an ablation run (``summary.md``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvpolicy_lab.eval.markdown import md_table
from kvpolicy_lab.eval.stats import successes, wilson

#: column order and headers
METRICS = {
    "delta_nll": "ΔNLL (nats)",
    "kl": "KL (nats)",
    "kl_worst": "KL, worst text",
    "kl_p99": "KL p99 (tokens)",
    "kl_p999": "KL p99.9 (tokens)",
    "top1": "top-1",
    "attn_error": "attn rel. err",
    "accuracy": "accuracy",
    "exact_match": "exact match",
    "edit_similarity": "edit sim.",
    "score": "score",
    "agreement": "same answer",
    "f1": "F1",
    "identical": "greedy identical",
    "first_divergence": "first divergence",
    "bytes_held": "bytes held",
    "ratio": "vs 16-bit",
    "bits_per_element": "bits/el",
    "bits_per_element_16": "bits/el (16-bit FP)",
    "bits_per_element_16_global": "bits/el, global layers (16-bit FP)",
    "prefill_ms": "prefill ms",
    "decode_ms": "decode ms/tok",
}
#: the metrics that are shares of samples scored 0 or 1 (a retrieved key, an exact line, the same answer):
#: :func:`fmt` gives them a binomial interval, which stays inside [0, 1] at a handful of samples
PASS_RATES = ("accuracy", "exact_match", "agreement")
#: how the pages say what the brackets after a pass rate are
PASS_RATE_NOTE = "pass rates show their 95 % Wilson score interval over samples in brackets"


def fmt(metric: str, value: float | None, se: float | None = None, n: int | None = None) -> str:
    """A cell of a table.

    Parameters
    ----------
    metric
        The metric's name (a key of :data:`METRICS`); it picks the format.
    value
        The value; None or NaN is written ``–``.
    se
        Its standard error, written ``± se`` where given.
    n
        The samples behind it: a pass rate (:data:`PASS_RATES`) over ``n`` samples scored 0 or 1 is
        written with its 95 % Wilson score interval, ``67% (21–94%)``, instead of ``± se``.

    Returns
    -------
    str
        The cell's text.
    """
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if metric == "bytes_held":
        return f"{value / 2**20:.2f} MiB"
    if metric == "ratio":
        return f"{value:.2f}×"
    if metric.startswith("bits_per_element"):
        return f"{value:.2f}"
    if metric in ("prefill_ms", "decode_ms"):
        return f"{value:.0f}" if value >= 100 else f"{value:.1f}"
    if metric == "first_divergence":
        return f"{value:.0f}" + (f" ± {se:.0f}" if se is not None and not math.isnan(se) and se > 0 else "")
    if metric in PASS_RATES and n is not None and (k := successes(value, n)) is not None:
        low, high = wilson(k, n)
        return f"{value:.0%} ({low * 100:.0f}–{high:.0%})"
    if metric in ("top1", "accuracy", "exact_match", "identical", "agreement"):
        text = f"{value:.0%}"
        return text + (f" ± {se:.0%}" if se is not None and not math.isnan(se) and se > 0 else "")
    text = f"{value:.4f}" if abs(value) < 10 else f"{value:.1f}"
    if se is not None and not math.isnan(se):
        text += f" ± {se:.4f}"
    return text


def groups(rows: list[dict[str, Any]]) -> dict[tuple[str, str, Any], list[dict[str, Any]]]:
    """Rows by (model, task, context), in first-appearance order."""
    out: dict[tuple[str, str, Any], list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault((r["model"], r["task"], r["context"]), []).append(r)
    return out


def table(rows: list[dict[str, Any]], caches: list[str] | None = None) -> str:
    """One Markdown table: a row per cache, a column per metric present."""
    by_cache: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_cache.setdefault(r["cache"], {})[r["metric"]] = r
    order = [c for c in (caches or []) if c in by_cache] + [c for c in by_cache if c not in (caches or [])]
    present = [m for m in METRICS if any(m in v for v in by_cache.values())]
    has_error = any("error" in v for v in by_cache.values())
    head = ["cache", *[METRICS[m] for m in present]] + (["error"] if has_error else [])
    body = []
    for cache in order:
        cells = by_cache[cache]
        vals = [fmt(m, cells[m]["value"], cells[m].get("se"), cells[m].get("n")) if m in cells else "–"
                for m in present]  # fmt: skip
        if has_error:
            vals.append(cells["error"]["extra"].get("error", "")[:80] if "error" in cells else "")
        body.append([f"`{cache}`", *vals])
    return md_table(head, body)


def depth_table(rows: list[dict[str, Any]], metric: str = "accuracy") -> str | None:
    """Accuracy by needle depth (passkey, kv), or None when the rows have no depths."""
    data = {
        r["cache"]: r["extra"].get("by_depth") for r in rows if r["metric"] == metric and r["extra"].get("by_depth")
    }
    if not data:
        return None
    depths = sorted({d for v in data.values() for d in v}, key=float)
    body = [[f"`{cache}`", *(f"{v[d]:.0%}" if d in v else "–" for d in depths)] for cache, v in data.items()]
    return md_table(["cache", *(f"depth {d}" for d in depths)], body)


def write_summary(out: Path, rows: list[dict[str, Any]], grid: Any, sizings: list[dict[str, Any]]) -> Path:
    """Write ``out/summary.md`` and return its path."""
    caches = [c.label for c in grid.caches]
    parts = [
        "# Ablation summary",
        "",
        f"Models: {', '.join(grid.models)}; dtype {grid.dtype}; device {grid.device}; seed {grid.seed}; "
        f"prefill replay: {grid.replay}; decode attention: {grid.decode}. Exact cache reprs: "
        "`config.json`. Rows: `results.jsonl` (`extra.attention_paths`: how many decode layer-steps took each path).",
        "",
        "ΔNLL, KL and top-1 are teacher-forced against the uncompressed cache on the same tokens (± standard "
        "error over tokens); KL, worst text is the largest of the texts' mean KLs, and KL p99 and p99.9 the "
        "percentiles of the per-token KL over every scored token of every text (linear interpolation); attention "
        "error is the per-layer relative error of the attention output on the same "
        "input, averaged over layers; bytes held are counted from the tensors the cache holds after the last token; "
        f"{PASS_RATE_NOTE}.",
    ]
    for (model, task, context), grp in groups(rows).items():
        parts += [
            "",
            f"## {model} · {task} · context {context if context is not None else '–'}",
            "",
            table(grp, caches),
        ]
        for metric in ("accuracy",):
            d = depth_table(grp, metric)
            if d:
                parts += ["", f"{metric} by needle depth:", "", d]
    if sizings:
        body: dict[tuple[Any, ...], list[str]] = {}  # each (model, context, cache) once, the first sizing
        for s in sizings:
            body.setdefault((s.get("model"), s["context"], s["label"]),
                            [str(s.get("model", "–")), str(s["context"]), f"`{s['anchor']}`", f"`{s['label']}`",
                             str(s["value"]), str(s["bytes"]), str(s["target"])])  # fmt: skip
        head = ["model", "context", "anchor", "cache", "size parameter", "bytes/layer", "anchor bytes/layer"]
        parts += ["", "## Equal bytes", "", md_table(head, list(body.values()))]
    path = out / "summary.md"
    path.write_text("\n".join(parts) + "\n", encoding="utf-8")
    return path
