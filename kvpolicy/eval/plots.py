"""PNG plots of an ablation run: quality vs bytes held, ms/token vs context, attention error per layer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: quality metric plotted against bytes held, per task (first one present)
QUALITY = ("delta_nll", "accuracy", "exact_match", "score")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> Path:
    """Lay out ``fig``, write it to ``path`` as PNG and close it; returns ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _by(rows: list[dict[str, Any]], metric: str) -> dict[tuple, dict[str, Any]]:
    return {(r["model"], r["task"], r["context"], r["cache"]): r for r in rows if r["metric"] == metric}


def quality_vs_bytes(out: Path, rows: list[dict[str, Any]]) -> list[Path]:
    """One PNG per (model, task, context): the task's quality metric against bytes held."""
    plt = _pyplot()
    held = _by(rows, "bytes_held")
    paths = []
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
            and (model, task, context, r["cache"]) in held
        ]  # fmt: skip
        if not points:
            continue
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for x, y, se, label, eq in points:
            ax.errorbar([x], [y], yerr=[se], fmt="s" if eq else "o", capsize=3)
            ax.annotate(label, (x, y), fontsize=6.5, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("bytes held (MiB)")
        ax.set_ylabel(metric + (" (nats, vs uncompressed)" if metric == "delta_nll" else ""))
        ax.set_title(f"{model} · {task} · context {context}  (squares: --equal-bytes)", fontsize=9)
        ax.grid(alpha=0.3)
        paths.append(_save(plt, fig, out / f"quality_vs_bytes_{_slug(model)}_{task}_{context}.png"))
    return paths


def ms_vs_context(out: Path, rows: list[dict[str, Any]]) -> list[Path]:
    """Decode ms/token (and prefill ms) against context length, one line per cache, from the speed task."""
    plt = _pyplot()
    paths = []
    for model in sorted({r["model"] for r in rows if r["task"] == "speed"}):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
        for ax, metric in zip(axes, ("decode_ms", "prefill_ms"), strict=True):
            caches: dict[str, list[tuple[int, float]]] = {}
            for r in rows:
                if r["model"] == model and r["task"] == "speed" and r["metric"] == metric:
                    caches.setdefault(r["cache"], []).append((r["context"], r["value"]))
            for cache, pts in caches.items():
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=cache)
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("decode ms/token (median)" if metric == "decode_ms" else "prefill ms")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=6.5)
        fig.suptitle(f"{model}: cost vs context", fontsize=9)
        paths.append(_save(plt, fig, out / f"ms_vs_context_{_slug(model)}.png"))
    return paths


def attention_error_layers(out: Path, rows: list[dict[str, Any]]) -> list[Path]:
    """Attention-output relative error per layer, one line per cache."""
    plt = _pyplot()
    paths = []
    keys = sorted({(r["model"], r["context"]) for r in rows if r["metric"] == "attn_error"}, key=str)
    for model, context in keys:
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        for r in rows:
            if r["metric"] == "attn_error" and (r["model"], r["context"]) == (model, context):
                per = r["extra"].get("per_layer", [])
                ax.plot(range(len(per)), per, label=r["cache"], lw=1)
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_ylabel("attention output relative error")
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
        ax.set_title(f"{model} · context {context}", fontsize=9)
        paths.append(_save(plt, fig, out / f"attn_error_layers_{_slug(model)}_{context}.png"))
    return paths


def write_plots(out: Path, rows: list[dict[str, Any]]) -> list[Path]:
    """Every plot the rows allow; returns the paths written."""
    rows = [r for r in rows if r["metric"] != "error"]
    return quality_vs_bytes(out, rows) + ms_vs_context(out, rows) + attention_error_layers(out, rows)


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in text)
