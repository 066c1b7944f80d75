"""Point labels that do not overlap: a greedy placement pass over a drawn matplotlib axes.

:func:`place_labels` tries, for each label, positions around its point at growing distances (past the
nearest ones with a thin leader line back to the point), then any free place inside the axes, and keeps
the first whose box (the renderer's window extent of the text) stays inside the axes and clear of the
labels already placed, of every point's marker and of the boxes the caller names (a legend, error bars).
The figure's layout must be final before the pass (positions are display coordinates), so a caller lays
the figure out first and saves it without laying it out again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvpolicy.errors import ConfigError

#: distances from the point tried in turn (points, 1/72 inch); past :data:`LEADER_FROM` a leader line is drawn
RADII = (3.0, 6.0, 10.0, 16.0, 24.0, 34.0, 46.0, 60.0, 78.0, 100.0)
LEADER_FROM = 10.0
#: directions tried at each distance (degrees; right and up first)
ANGLES = (0, 40, -40, 90, -90, 140, -140, 180, 20, -20, 65, -65, 115, -115, 160, -160)


@dataclass(frozen=True)
class LabelSpec:
    """Settings of :func:`place_labels`.

    Parameters
    ----------
    fontsize : float
        Label font size in points, > 0.
    marker_radius : float
        Half the side of the square kept clear around every point, in points, >= 0.
    pad : float
        Gap kept between two boxes, in points, >= 0.
    """

    fontsize: float = 7.0
    marker_radius: float = 3.5
    pad: float = 1.0

    def __post_init__(self) -> None:
        for name, low, strict in (("fontsize", 0.0, True), ("marker_radius", 0.0, False), ("pad", 0.0, False)):
            value = getattr(self, name)
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not (value > low if strict else value >= low)
            ):
                raise ConfigError(f"LabelSpec {name} must be a number {'>' if strict else '>='} {low}; got {value!r}")


Box = tuple[float, float, float, float]  # x0, y0, x1, y1 in display pixels


def _overlaps(a: Box, b: Box, pad: float) -> bool:
    return a[0] < b[2] + pad and b[0] < a[2] + pad and a[1] < b[3] + pad and b[1] < a[3] + pad


def _inside(a: Box, frame: Box) -> bool:
    return a[0] >= frame[0] and a[1] >= frame[1] and a[2] <= frame[2] and a[3] <= frame[3]


def data_box(ax: Any, x0: float, y0: float, x1: float, y1: float, pad_px: float = 0.0) -> Box:
    """The display box (pixels) spanning data points ``(x0, y0)`` and ``(x1, y1)``, grown by ``pad_px``."""
    (ax_, ay_), (bx, by) = ax.transData.transform([(x0, y0), (x1, y1)])
    return (min(ax_, bx) - pad_px, min(ay_, by) - pad_px, max(ax_, bx) + pad_px, max(ay_, by) + pad_px)


def artist_box(artist: Any, renderer: Any) -> Box:
    """The display box of a drawn artist (a legend, a text)."""
    b = artist.get_window_extent(renderer)
    return (b.x0, b.y0, b.x1, b.y1)


def text_box(text: Any, renderer: Any) -> Box:
    """The box of a text or annotation's text alone (without its leader line), in display pixels."""
    from matplotlib.text import Text

    if hasattr(text, "update_positions"):  # an annotation places its text only when drawn or asked here
        text.update_positions(renderer)
    b = Text.get_window_extent(text, renderer)
    return (b.x0, b.y0, b.x1, b.y1)


def place_labels(ax: Any, xs: list[float], ys: list[float], texts: list[str], *, spec: LabelSpec | None = None,
                 colors: list[str] | None = None, points: list[tuple[float, float]] | None = None,
                 obstacles: list[Box] | None = None) -> list[Any]:  # fmt: skip
    """Annotate point ``i`` (data coordinates ``xs[i], ys[i]``) with ``texts[i]`` where no label overlaps.

    Parameters
    ----------
    ax : matplotlib Axes
        Axes already drawn with its final limits and layout.
    xs, ys : list of float
        The labelled points, ``n`` each (points outside the axes' limits are skipped).
    texts : list of str
        ``n`` labels.
    spec : LabelSpec, optional
        Font size and clearances.
    colors : list of str, optional
        ``n`` colours for the labels' leader lines (grey when omitted).
    points : list of (float, float), optional
        Every marker to keep clear, labelled or not (data coordinates); default the labelled ones.
    obstacles : list of Box, optional
        Further display boxes to keep clear (e.g. :func:`artist_box` of a legend).

    Returns
    -------
    list of matplotlib Annotation
        The labels placed, in the order of ``texts``; those that found no free place anywhere lie at
        the place that overlaps least (none do on the committed plots; the tests check it).
    """
    spec = spec or LabelSpec()
    if not len(xs) == len(ys) == len(texts) or (colors is not None and len(colors) != len(texts)):
        raise ConfigError(f"place_labels needs as many xs, ys, texts (and colors) as labels; got {len(xs)}, "
                          f"{len(ys)}, {len(texts)}" + ("" if colors is None else f", {len(colors)}"))  # fmt: skip
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    px = fig.dpi / 72.0
    frame = artist_box(ax, renderer)
    frame = (frame[0] + 2, frame[1] + 2, frame[2] - 2, frame[3] - 2)
    pad = spec.pad * px
    r = spec.marker_radius * px
    marks = [tuple(p) for p in ax.transData.transform(points if points is not None else list(zip(xs, ys, strict=True)))]
    taken: list[Box] = [(x - r, y - r, x + r, y + r) for x, y in marks] + list(obstacles or [])
    anchors = ax.transData.transform(list(zip(xs, ys, strict=True))) if texts else []
    order = sorted(range(len(texts)), key=lambda i: -sum(math.dist(anchors[i], a) < 60 * px for a in anchors))
    out: dict[int, Any] = {}
    for i in order:
        ax_, ay_ = anchors[i]
        if not (frame[0] <= ax_ <= frame[2] and frame[1] <= ay_ <= frame[3]):
            continue
        probe = ax.annotate(texts[i], (xs[i], ys[i]), xytext=(0, 0), textcoords="offset points",
                            fontsize=spec.fontsize, ha="left", va="bottom", annotation_clip=False)  # fmt: skip
        b = text_box(probe, renderer)
        w, h = b[2] - b[0], b[3] - b[1]
        probe.remove()
        best: tuple[float, float, float] | None = None  # (overlap, dx, dy) in pixels
        for dx, dy in _candidates(ax_, ay_, w, h, r, px, frame):
            box = (ax_ + dx, ay_ + dy, ax_ + dx + w, ay_ + dy + h)
            if not _inside(box, frame):
                continue
            clash = sum(_area(box, t, pad) for t in taken)
            if clash == 0:
                best = (0.0, dx, dy)
                break
            if best is None or clash < best[0]:
                best = (clash, dx, dy)
        if best is None:
            best = (0.0, r, r)
        _, dx, dy = best
        far = math.hypot(dx + w / 2, dy + h / 2) - math.hypot(w / 2, h / 2) > LEADER_FROM * px
        # the leader line leaves the label from its side or corner nearest the point
        near = (0.0 if dx >= 0 else (1.0 if dx + w <= 0 else 0.5), 0.0 if dy >= 0 else (1.0 if dy + h <= 0 else 0.5))
        arrow = ({"arrowstyle": "-", "color": colors[i] if colors else "0.45", "lw": 0.6, "shrinkA": 1,
                  "shrinkB": spec.marker_radius, "relpos": near} if far else None)  # fmt: skip
        ann = ax.annotate(texts[i], (xs[i], ys[i]), xytext=(dx / px, dy / px), textcoords="offset points",
                          fontsize=spec.fontsize, ha="left", va="bottom", arrowprops=arrow,
                          annotation_clip=False)  # fmt: skip
        ann.set_in_layout(False)
        taken.append(text_box(ann, renderer))
        out[i] = ann
    return [out[i] for i in range(len(texts)) if i in out]


def numbered_key(names: list[str], inline_max: int = 12, keep: frozenset[int] = frozenset()) -> tuple[
        list[str], list[str] | None]:  # fmt: skip
    """The texts to place beside ``n`` points and the entries of a key naming them.

    Up to ``inline_max`` names go beside their points (no key: ``None``); past it each point gets a
    number (``"1"`` ...), small enough to stay beside its marker, and the key lists ``"1  name"`` — all
    but the points at the indices ``keep``, which keep their names beside them (and stay off the key).
    """
    if not isinstance(inline_max, int) or inline_max < 0:
        raise ConfigError(f"numbered_key inline_max must be an integer >= 0; got {inline_max!r}")
    if len(names) <= inline_max:
        return list(names), None
    texts, key = [], []
    for i, name in enumerate(names):
        if i in keep:
            texts.append(name)
        else:
            key.append(f"{len(key) + 1}  {name}")
            texts.append(str(len(key)))
    return texts, key


def _area(a: Box, b: Box, pad: float) -> float:
    """How much ``a`` and ``b`` (grown by ``pad``) overlap, in square pixels (0 when apart)."""
    if not _overlaps(a, b, pad):
        return 0.0
    return (min(a[2], b[2] + pad) - max(a[0], b[0] - pad)) * (min(a[3], b[3] + pad) - max(a[1], b[1] - pad))


def _candidates(x: float, y: float, w: float, h: float, r: float, px: float, frame: Box):
    """Lower-left offsets (pixels, from the point) of a ``w`` x ``h`` box: around the point at each of
    :data:`RADII`, the box's near side or corner that far from the marker; then a grid over the frame,
    nearest first."""
    for radius in RADII:
        d = r + radius * px
        for angle in ANGLES:
            c, s = math.cos(math.radians(angle)), math.sin(math.radians(angle))
            dx = d * c if c > 0.2 else (d * c - w if c < -0.2 else -w / 2)
            dy = d * s if s > 0.2 else (d * s - h if s < -0.2 else -h / 2)
            yield dx, dy
    step = max(h, 4 * px)
    grid = [(gx - x, gy - y)
            for gx in _range(frame[0], frame[2] - w, step) for gy in _range(frame[1], frame[3] - h, step)]  # fmt: skip
    yield from sorted(grid, key=lambda o: math.hypot(o[0] + w / 2, o[1] + h / 2))


def _range(low: float, high: float, step: float) -> list[float]:
    n = int((high - low) // step) + 1 if high >= low else 0
    return [low + k * step for k in range(n)]
