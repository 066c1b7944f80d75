"""The plots stay readable: log byte axes, a colour per series, labels that do not overlap, preset names.

Every check reads the matplotlib Figure (Agg backend) after drawing: axis scales, the colours of the
drawn series, and the renderer's window extents of every text label (annotations and legend entries).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest
from matplotlib.colors import to_hex
from matplotlib.text import Text

from kvpolicy.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _labels(fig) -> list[tuple[str, tuple[float, float, float, float]]]:
    """Every text label of ``fig`` (annotations, legend entries) with its box in display pixels."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    out = []
    for ax in fig.axes:
        for t in ax.texts:
            b = Text.get_window_extent(t, r)  # the text alone, not its leader line
            out.append((t.get_text(), (b.x0, b.y0, b.x1, b.y1)))
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    for leg in legends:
        for t in leg.get_texts():
            b = t.get_window_extent(r)
            out.append((t.get_text(), (b.x0, b.y0, b.x1, b.y1)))
    return out


def _overlapping(fig) -> list[tuple[str, str]]:
    boxes = _labels(fig)
    return [(a, b) for (a, p), (b, q) in itertools.combinations(boxes, 2)
            if p[0] < q[2] and q[0] < p[2] and p[1] < q[3] and q[1] < p[3]]  # fmt: skip


def _inside_axes(fig) -> bool:
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    for ax in fig.axes:
        frame = ax.get_window_extent(r)
        for t in ax.texts:
            b = Text.get_window_extent(t, r)
            if b.x0 < frame.x0 or b.x1 > frame.x1 or b.y0 < frame.y0 or b.y1 > frame.y1:
                return False
    return True


# ---------------------------------------------------------------------- styles and names
def test_series_styles_differ_in_colour_and_past_ten_in_marker():
    from kvpolicy_lab.eval.plot_style import series_styles

    for n in (1, 10, 11, 22, 60):
        styles = series_styles(n)
        assert len({s.color for s in styles}) == n
    assert {s.marker for s in series_styles(10)} == {"o"}
    big = series_styles(300)
    assert len(set(big)) == 300
    with pytest.raises(ConfigError, match="n must be"):
        series_styles(-1)
    with pytest.raises(ConfigError, match="at most 300"):
        series_styles(301)


def test_log_axis_ticks_are_round_and_plain():
    from kvpolicy_lab.eval.plot_style import log_axis

    fig, ax = plt.subplots()
    ax.plot([4.2, 93.0], [0, 1])
    log_axis(ax, "x")
    fig.canvas.draw()
    assert ax.get_xscale() == "log"
    shown = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert {"5", "10", "20", "50"} <= set(shown) and not any("times" in s or "^" in s for s in shown)
    plt.close(fig)
    with pytest.raises(ConfigError, match="which must be"):
        log_axis(ax, "z")


def test_composition_names_spell_out_the_grid_entries():
    from kvpolicy_lab.eval.cache_names import composition_name

    def name(kind="compressed", **args):
        return composition_name({"label": "id", "kind": kind, "args": args})

    assert name(policy="log", window=16, key_bits=3, value_bits=2, transform="hadamard") == "log W16, K3/V2, rotated"
    assert name(policy="sink", sinks=4, window=12, key_bits=4, value_bits=4) == "sink 4+12, K4/V4"
    assert (name(policy="log", window=8, key_bits=3, value_bits=2, scheme="codebook", key_centre=True,
                 transform="hadamard") == "log W8, K3/V2 codebook, centred keys")  # fmt: skip
    assert (name(policy="log", window=42, key_bits=2, value_bits=2, key_group_size=128, key_fit="mse")
            == "log W42, K2/V2, key groups 128, key MSE fit")  # fmt: skip
    tiered = name(policy="log", window=4, transform="hadamard", action="tiered",
                  tiers=[{"bits": 4, "scheme": "codebook"}, {"key_bits": 3, "value_bits": 2, "scheme": "codebook"}],
                  keep=[{"name": "log", "window": 32}])  # fmt: skip
    assert tiered == "log W4, K3/V2 codebook, 4-bit tier W′32"
    assert (name(policy="log", window=42, bits=2, transform="query-hadamard")
            == "log W42, K2/V2, query-weighted keys")  # fmt: skip
    assert (name(policy="log", window=8, bits=2, scheme="codebook", transform="lowrank", rank=4)
            == "log W8, K2/V2 codebook, low-rank keys (rank 4)")  # fmt: skip
    assert name("hf-quantized", backend="hqq", nbits=2) == "transformers HQQ 2-bit"
    assert name("preset", name="logquant") == "LogQuant"
    assert name("dynamic") == "uncompressed"
    assert name(policy="some-plugin", window=3) == "id"  # unknown: the label
    with pytest.raises(ConfigError, match="composition_name entry"):
        composition_name(["not", "a", "dict"])


def test_the_committed_grids_caches_have_distinct_names():
    """No two caches of the frontier's grid share a readable name (a plot's legend and its key use them)."""
    from collections import Counter

    from kvpolicy_lab.eval.cache_names import composition_names

    config = json.loads((ROOT / "results" / "frontier" / "config.json").read_text())
    names = composition_names(config["caches"])
    assert len(names) == len(config["caches"]) > 100
    assert [name for name, n in Counter(names.values()).items() if n > 1] == []


# ---------------------------------------------------------------------- label placement
@pytest.mark.parametrize("n", [6, 18])
def test_place_labels_keeps_a_crowded_cluster_apart(n):
    from kvpolicy_lab.eval.label_placement import place_labels

    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    xs = [10 + 0.05 * (i % 4) for i in range(n)]
    ys = [0.5 + 0.004 * i for i in range(n)]
    ax.scatter([*xs, 1, 90], [*ys, 0, 2])
    fig.tight_layout()
    texts = [f"cache-number-{i}" for i in range(n)]
    anns = place_labels(ax, xs, ys, texts)
    assert [a.get_text() for a in anns] == texts
    assert _overlapping(fig) == [] and _inside_axes(fig)
    plt.close(fig)


def test_place_labels_checks_its_arguments():
    from kvpolicy_lab.eval.label_placement import LabelSpec, numbered_key, place_labels

    fig, ax = plt.subplots()
    with pytest.raises(ConfigError, match="as many xs, ys, texts"):
        place_labels(ax, [1.0], [1.0, 2.0], ["a"])
    with pytest.raises(ConfigError, match="fontsize must be a number > 0"):
        LabelSpec(fontsize=0)
    plt.close(fig)
    assert numbered_key(["a", "b"], 2) == (["a", "b"], None)
    assert numbered_key(["a", "b", "c"], 2, keep=frozenset({1})) == (["1", "b", "2"], ["1  a", "2  c"])


# ---------------------------------------------------------------------- quality vs bytes
def _row(cache, metric, value, se=None, task="lm", eq=False):
    return dict(model="m", task=task, context=2048, cache=cache, metric=metric, value=value, se=se, equal_bytes=eq,
                extra={})  # fmt: skip


def _quality_rows(n_compressed: int, bunched: bool = True) -> list[dict]:
    """An uncompressed cache at 93 MiB and ``n_compressed`` caches between 4 and 20 MiB (half of them bunched
    up at 11.5 MiB unless not ``bunched``)."""
    from kvpolicy_lab.eval.frontier_report import PRESET_CELLS

    preset_cell = next(iter(PRESET_CELLS.values()))[1]
    rows = [_row("uncompressed", "delta_nll", 0.0, 0.0), _row("uncompressed", "bytes_held", 93 * 2**20)]
    for i in range(n_compressed):
        cache = preset_cell if i == 0 else f"policy-{i}-2b" + ("@96" if i % 3 == 0 else "")
        mib = 4 + 16 * i / max(1, n_compressed - 1) if i % 2 or not bunched else 11.5 + 0.1 * i
        rows += [_row(cache, "delta_nll", 0.4 + (0.01 if bunched else 0.2) * i, 0.12, eq="@" in cache),
                 _row(cache, "bytes_held", mib * 2**20, eq="@" in cache)]  # fmt: skip
    return rows


def _series_colors(ax) -> set[str]:
    return {to_hex(c.lines[0].get_color()) for c in ax.containers if to_hex(c.lines[0].get_color()) != "#c0c0c0"}


@pytest.mark.parametrize(("n_compressed", "bunched"), [(8, False), (21, True)])
def test_quality_vs_bytes_is_log_scaled_distinct_and_unoverlapped(n_compressed, bunched):
    from kvpolicy_lab.eval.frontier_report import PRESET_CELLS
    from kvpolicy_lab.eval.plots import quality_figures

    [(name, fig)] = quality_figures(_quality_rows(n_compressed, bunched))
    assert name == "quality_vs_bytes_m_lm_2048.png"
    ax = fig.axes[0]
    assert ax.get_xscale() == "log"
    assert len(_series_colors(ax)) == n_compressed + 1  # every cache, uncompressed included
    assert _overlapping(fig) == [] and _inside_axes(fig)
    texts = [t for t, _ in _labels(fig)]
    preset = next(iter(PRESET_CELLS))
    named = [t for t in texts if "policy-" in t or t == preset or t.endswith(f"  {preset}")]
    assert any(preset in t for t in named) and not any(next(iter(PRESET_CELLS.values()))[1] in t for t in texts)
    if bunched:  # numbered beside the points, named in the key
        assert {t for t in texts if t.isdigit()} == {str(k) for k in range(1, n_compressed + 2)}
    else:
        caches = {r["cache"] for r in _quality_rows(n_compressed, bunched)}
        assert {t for t in texts if t.startswith("policy-")} == {c for c in caches if c.startswith("policy-")}
    plt.close(fig)


def test_names_that_would_need_leader_lines_become_a_numbered_key():
    from kvpolicy_lab.eval.plots import quality_figures

    rows = [_row("uncompressed", "delta_nll", 0.0, 0.0), _row("uncompressed", "bytes_held", 27 * 2**20)]
    for i in range(10):  # ten caches on one spot: no room for ten names beside it
        rows += [_row(f"cache-{i}", "delta_nll", 0.25, 0.25), _row(f"cache-{i}", "bytes_held", 16.5 * 2**20)]
    [(_, fig)] = quality_figures(rows)
    texts = [t for t, _ in _labels(fig)]
    assert {t for t in texts if t.isdigit()} == {str(k) for k in range(1, 12)}
    assert {f"{k}  cache-{k - 1}" for k in range(1, 11)} <= set(texts)
    assert _overlapping(fig) == []
    plt.close(fig)


def test_write_plots_writes_the_quality_pngs(tmp_path):
    from kvpolicy_lab.eval.plots import write_plots

    paths = write_plots(tmp_path, _quality_rows(5))
    assert [p.name for p in paths] == ["quality_vs_bytes_m_lm_2048.png"] and paths[0].stat().st_size > 0


# ---------------------------------------------------------------------- frontier
def _point(cache, bits, kl):
    from kvpolicy_lab.eval.frontier_report import Point

    return Point(cache, bits, {("lm", "kl"): (kl, 0.001)})


def test_frontier_plot_names_presets_and_compositions_on_log_axes():
    from kvpolicy_lab.eval.frontier_report import PRESET_CELLS, frontier_figure

    presets = list(PRESET_CELLS.items())
    pts = [_point("uncompressed", 16.0, 0.0), _point("hf-quanto-2b", 3.2, 2.0), _point("a", 2.5, 0.1),
           _point(presets[0][1][1], 3.0, 0.03), _point(presets[1][1][1], 3.5, 0.02), _point("b", 4.0, 0.01),
           _point("behind", 4.1, 0.5)]  # fmt: skip
    names = {"a": "log W16, K2/V2", "b": "sink 4+12, K4/V4", "hf-quanto-2b": "transformers quanto 2-bit"}
    fig = frontier_figure(pts, 2048, "Model", names=names)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert {t.get_text() for t in ax.texts} == {presets[0][0], presets[1][0], *names.values()}
    assert _overlapping(fig) == [] and _inside_axes(fig)
    plt.close(fig)


def test_frontier_plots_of_the_committed_run_are_readable():
    from kvpolicy_lab.eval.cache_names import composition_names
    from kvpolicy_lab.eval.frontier_report import PRESET_CELLS, frontier_figure, points
    from kvpolicy_lab.eval.runner import current_rows

    run = ROOT / "results" / "frontier"
    if not (run / "results.jsonl").is_file():
        pytest.skip("the committed frontier run is not in this checkout")
    config, rows = current_rows(run)
    names = composition_names(config["caches"])
    pts = points(rows, 2048, "smollm2")
    fig = frontier_figure(pts, 2048, "SmolLM2-135M-Instruct", names=names)
    texts = [t for t, _ in _labels(fig)]
    assert set(PRESET_CELLS) <= set(texts)  # the presets by name, beside their points
    assert not any(cell in " ".join(texts) for _, cell in PRESET_CELLS.values())
    assert "1  " + names[min((p for p in pts if p.kl > 0), key=lambda p: p.bits).cache] in texts
    assert fig.axes[0].get_xscale() == "log"
    assert _overlapping(fig) == [] and _inside_axes(fig)
    plt.close(fig)


# ---------------------------------------------------------------------- bench sweep
def test_sweep_plot_gives_each_of_eleven_variants_its_own_colour(tmp_path):
    from kvpolicy_lab.bench.decode import Row
    from kvpolicy_lab.bench.sweep_plot import plot, sweep_figure

    variants = ["dynamic", "hf-quanto-2", "hf-hqq-4"] + [f"log-{i}-torch-ordered-fused" for i in range(8)]
    rows = [Row("m", "float32", "cpu", n, 1, v, float("nan"), 10.0 + i + n / 1024, bytes_held=(i + 1) * n * 1000)
            for i, v in enumerate(variants) for n in (1024, 2048, 4096)]  # fmt: skip
    rows += [Row("m", "float32", "cpu", 1024, 8, "dynamic", float("nan"), 1.0)]  # another batch: left out
    fig = sweep_figure(rows, "m float32 cpu")
    a, b = fig.axes
    assert b.get_yscale() == "log" and a.get_xscale() == "log"
    assert len({to_hex(line.get_color()) for line in a.lines}) == len(a.lines) == 11
    assert len({(to_hex(line.get_color()), line.get_marker()) for line in b.lines}) == 11
    assert [t.get_text() for t in fig.legends[0].get_texts()] == variants
    assert _overlapping(fig) == []
    plt.close(fig)
    plot(rows, tmp_path / "decode.png", "m float32 cpu")
    assert (tmp_path / "decode.png").stat().st_size > 0


def test_the_committed_sweep_json_draws_a_colour_per_variant():
    from kvpolicy_lab.bench.decode import Row
    from kvpolicy_lab.bench.sweep_plot import sweep_figure

    data = json.loads((ROOT / "docs" / "img" / "bench-fp32-sweep.json").read_text())
    rows = [Row(**r) for r in data["rows"]]
    fig = sweep_figure(rows, "sweep")
    n = len({r.variant for r in rows if r.batch == rows[0].batch})
    assert n > 10 and len({to_hex(line.get_color()) for line in fig.axes[0].lines}) == n
    plt.close(fig)
