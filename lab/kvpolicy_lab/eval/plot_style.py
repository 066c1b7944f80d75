"""Colours, markers and log axes shared by kvpolicy's plots.

:func:`series_styles` gives every series of a plot its own colour (and, past ten series, its own marker
as well, so that two series stay apart even where two colours look alike); :func:`log_axis` puts an axis
on a log scale with plain tick labels (``2``, ``5``, ``10``, ``20`` rather than ``2×10⁰``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvpolicy.errors import ConfigError

#: markers in the order :func:`series_styles` uses them, one per group of ten series
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")


@dataclass(frozen=True)
class SeriesStyle:
    """How one series is drawn: a matplotlib colour (``"#rrggbb"``) and marker."""

    color: str
    marker: str

    def __post_init__(self) -> None:
        if not (isinstance(self.color, str) and len(self.color) == 7 and self.color.startswith("#")):
            raise ConfigError(f"SeriesStyle color must be a '#rrggbb' string; got {self.color!r}")
        if self.marker not in MARKERS:
            raise ConfigError(f"SeriesStyle marker must be one of {MARKERS}; got {self.marker!r}")


def _palette() -> list[str]:
    """Distinct colours, the most distinguishable first: tab10's ten, tab20's lighter ten, then tab20b's
    and tab20c's forty, one hue after another (60 in all)."""
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    tab20 = [to_hex(c) for c in colormaps["tab20"].colors]
    more = [[to_hex(c) for c in colormaps[name].colors] for name in ("tab20b", "tab20c")]
    out = tab20[0::2] + tab20[1::2] + [m[shade::4][hue] for shade in range(4) for m in more for hue in range(5)]
    return list(dict.fromkeys(out))


def series_styles(n: int) -> list[SeriesStyle]:
    """One style per series for ``n`` series: a different colour for each of the first 60 and, where
    there are more than ten, a different marker for each group of ten, so no two series share both.

    Parameters
    ----------
    n : int
        Number of series, 0 to 300.

    Returns
    -------
    list of SeriesStyle
        ``n`` styles, pairwise different.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ConfigError(f"series_styles n must be an integer >= 0; got {n!r}")
    colors = _palette()
    limit = len(colors) * len(MARKERS) // 2  # colour i and i + 60 differ in marker up to here
    if n > limit:
        raise ConfigError(f"series_styles n must be at most {limit}; got {n}")
    return [SeriesStyle(colors[i % len(colors)], MARKERS[(i // 10) % len(MARKERS)] if n > 10 else MARKERS[0])
            for i in range(n)]  # fmt: skip


def darker(color: str, factor: float = 0.6) -> str:
    """``color`` (any matplotlib colour) at ``factor`` (0 to 1) of its brightness, as ``"#rrggbb"``: the
    edge that keeps a pale marker visible on white."""
    from matplotlib.colors import to_hex, to_rgb

    if not 0 <= factor <= 1:
        raise ConfigError(f"darker factor must be between 0 and 1; got {factor!r}")
    return to_hex(tuple(factor * c for c in to_rgb(color)))


def _ticks(low: float, high: float) -> list[float]:
    """Round ticks from ``low`` to ``high`` (both > 0): 1-2-5 per decade, or every integer step where the
    span is under a decade (e.g. 2.5 to 5.2 bits)."""
    if high / low < 10:
        top = 10.0 ** math.ceil(math.log10(high - low)) if high > low else 1.0
        for step in (top * f for f in (1, 0.5, 0.2, 0.1, 0.05, 0.02, 0.01)):
            out = [round(k * step, 10) for k in range(math.ceil(low / step - 1e-9), math.floor(high / step + 1e-9) + 1)]
            if len(out) >= 4:
                return out
        return out
    for mantissas in ((1, 2, 5), (1, 2, 3, 5)):
        out = [m * 10.0**e for e in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
               for m in mantissas if low * (1 - 1e-9) <= m * 10.0**e <= high * (1 + 1e-9)]  # fmt: skip
        if len(out) >= 4:
            break
    return out


def log_axis(ax: Any, which: str = "x") -> None:
    """Put the ``which`` axis (``"x"`` or ``"y"``) of ``ax`` on a log scale with round, plainly written
    ticks over its current data limits; call it after the data are drawn."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    if which not in ("x", "y"):
        raise ConfigError(f"log_axis which must be 'x' or 'y'; got {which!r}")
    axis = ax.xaxis if which == "x" else ax.yaxis
    (ax.set_xscale if which == "x" else ax.set_yscale)("log")
    low, high = ax.get_xlim() if which == "x" else ax.get_ylim()
    if not (low > 0 and high > low):
        return
    ticks = _ticks(low, high)
    if len(ticks) >= 2:
        axis.set_major_locator(FixedLocator(ticks))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())
