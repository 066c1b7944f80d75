"""The PNG of a ``kvpolicy bench decode`` sweep: decode ms/token and MiB held against context length.

One line per cache variant, each in a colour (and past ten variants a marker) of its own, the line style
telling the family apart (solid ``DynamicCache``, dashed transformers' caches, dash-dot kvpolicy's);
bytes held on a log axis, context lengths on a log-2 axis ticked at the lengths measured, the legend
beside the panels, off the data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from kvpolicy.errors import ConfigError

#: resolution of the PNG
DPI = 110


class SweepRow(Protocol):
    """What the plot reads of one measured cell (:class:`kvpolicy_lab.bench.decode.Row`)."""

    variant: str
    length: int
    batch: int
    decode_ms: float
    bytes_held: int


def _tokens(n: float) -> str:
    """``1024`` -> ``1k``, ``16384`` -> ``16k``, ``1500`` -> ``1500``."""
    return f"{int(n) // 1024}k" if n >= 1024 and int(n) % 1024 == 0 else f"{n:g}"


def sweep_figure(rows: list[SweepRow], title: str) -> Any:
    """The sweep's figure for the batch size of the first row.

    Parameters
    ----------
    rows : list of SweepRow
        Measured cells; those of another batch size than ``rows[0]``'s are left out.
    title : str
        Figure title (the batch size is appended).

    Returns
    -------
    matplotlib Figure
        Drawn and laid out (the caller saves or closes it).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    from kvpolicy_lab.eval.plot_style import darker, log_axis, series_styles

    if not rows:
        raise ConfigError("sweep_figure needs at least one row; got none")
    batch = rows[0].batch
    sel = [r for r in rows if r.batch == batch]
    names = list(dict.fromkeys(r.variant for r in sel))
    styles = series_styles(len(names))
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8), dpi=DPI)
    for name, st in zip(names, styles, strict=True):
        pts = sorted((r.length, r.decode_ms, r.bytes_held) for r in sel if r.variant == name)
        line = "-" if name == "dynamic" else ("--" if name.startswith("hf-") else "-.")
        kw = dict(color=st.color, marker=st.marker, mec=darker(st.color), ms=5, lw=1.4, label=name)
        a.plot([p[0] for p in pts], [p[1] for p in pts], line, **kw)
        b.plot([p[0] for p in pts], [p[2] / 2**20 for p in pts], line, **kw)
    lengths = sorted({r.length for r in sel})
    for ax, label in ((a, "decode ms / token"), (b, "MiB held (log scale)")):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(lengths))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _tokens(v)))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
    log_axis(b, "y")
    fig.suptitle(f"{title} (batch {batch})")
    legend = fig.legend(*a.get_legend_handles_labels(), loc="center right", fontsize=7.5, frameon=False)
    fig.canvas.draw()
    box = legend.get_window_extent(fig.canvas.get_renderer())
    fig.tight_layout(rect=(0, 0, 1 - box.width / fig.bbox.width - 0.01, 1))
    return fig


def plot(rows: list[SweepRow], path: Path, title: str) -> Path:
    """Write :func:`sweep_figure` to ``path`` as PNG; returns ``path``."""
    import matplotlib.pyplot as plt

    fig = sweep_figure(rows, title)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
