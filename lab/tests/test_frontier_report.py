"""docs/frontier.md's generator: the Pareto frontier of bits per element vs KL, and the page itself."""

from __future__ import annotations

import json

from lab_fixtures import write_pages

from kvpolicy.cli import main
from kvpolicy_lab.eval.frontier_report import Point, best_within, frontier, write_frontier_doc


def _p(cache: str, bits: float, kl: float, top1: float = 0.9) -> Point:
    return Point(cache, bits, {("lm", "kl"): (kl, None), ("lm", "top1"): (top1, None)})


def test_frontier_keeps_points_no_other_beats_with_as_few_bits():
    pts = [_p("a", 3.0, 0.2), _p("b", 3.2, 0.1), _p("c", 3.3, 0.15), _p("d", 4.0, 0.01), _p("e", 4.0, 0.02),
           _p("f", 16.0, 0.0)]  # fmt: skip
    assert [p.cache for p in frontier(pts)] == ["a", "b", "d", "f"]


def test_best_within_takes_the_lowest_kl_at_or_under_the_budget():
    pts = [_p("a", 3.0, 0.2), _p("b", 3.5, 0.1), _p("c", 3.6, 0.01)]
    assert best_within(pts, 3.5).cache == "b"
    assert best_within(pts, 2.0) is None
    assert best_within(pts, 4.0, exclude=("c",)).cache == "b"


def test_ablate_writes_the_frontier_page(tmp_path):
    cfg = tmp_path / "f.toml"
    cfg.write_text(
        'models = ["tiny-llama"]\ncontexts = [96]\n[tasks.lm]\nsamples_per_context = 1\ntokens = 8\n'
        '[[caches]]\nlabel = "uncompressed"\nkind = "dynamic"\n'
        '[[caches]]\nlabel = "log42-k2v2"\npolicy = "log"\nwindow = 8\ngroup_size = 16\nbits = 2\n'
        '[[caches]]\nlabel = "log42-k2v2-rot"\npolicy = "log"\nwindow = 8\ngroup_size = 16\nbits = 2\n'
        'transform = "hadamard"\n'
        '[[caches]]\nlabel = "log42-k2v2-mse"\npolicy = "log"\nwindow = 8\ngroup_size = 16\nbits = 2\nfit = "mse"\n'
        '[[caches]]\nlabel = "log-4b"\npolicy = "log"\nwindow = 8\ngroup_size = 16\nbits = 4\n'
    )
    doc = tmp_path / "docs" / "frontier.md"
    assert main(["ablate", "--config", str(cfg), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    assert write_pages().main(["frontier", "--run", str(tmp_path / "run"), "--page", str(doc)]) == 0
    text = doc.read_text()
    # the page opens on its first section: its plot, then the caches the plot names; how it was made comes last
    section, made = text.index("## tiny-llama · context 96"), text.index("## How this page was made")
    assert section < text.index("![bits per element vs KL at 96](img/frontier/frontier_96.png)") < made
    assert "do not edit it by hand" not in text[:made] and len(text[:section].split()) < 150
    # the last section gives both steps: the run that fills the directory, then the script that writes the page
    assert (f"```bash\nkvpolicy ablate --config examples/configs/frontier.toml --out {tmp_path / 'run'} --threads 2\n"
            f"python scripts/write_pages.py frontier --run {tmp_path / 'run'} --page {doc}\n```") in text  # fmt: skip
    # the plotted caches under readable names, their grid label last; the uncompressed cache is on the frontier
    # (nothing has a lower KL), in bold with a star
    assert "| cache | bits/el | KL (nats) | top-1 | grid label |" in text
    assert "| **uncompressed** ★ | 16.00 |" in text
    assert "Rotation at equal bits (log, W=42, K2V2" in text[made:]  # the grid's targets: at the end
    assert "Fitted ranges at equal bits (`log42-k2v2` vs `log42-k2v2-mse`" in text[made:]
    assert "`log42-k2v2-rot-mse`" not in text  # no such cell, no such line
    assert (tmp_path / "docs" / "img" / "frontier" / "frontier_96.png").stat().st_size > 1000
    assert "Decode attention: 4 of the 4 compressed cells attended over the packed codes" in text
    # every cache, with every metric, in the table beside the rows
    tables = (tmp_path / "run" / "caches.md").read_text()
    head = "| cache | bits/el | ΔNLL (nats) | KL (nats) | KL, worst text | top-1 |"
    assert "## tiny-llama · context 96" in tables and head in tables
    for label in ("uncompressed", "log42-k2v2", "log42-k2v2-rot", "log42-k2v2-mse", "log-4b"):
        assert f"`{label}`" in tables
    assert "**`uncompressed`** ★" in tables and "as `caches.md` in the run directory" in text

    # a materialised cell (or one measured before rows recorded paths) is counted as such
    rows = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    for r in rows:
        if r["cache"] == "log-4b":
            r["extra"].pop("attention_paths")
    (tmp_path / "run" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = write_frontier_doc(tmp_path / "run", doc, "cmd").read_text()
    assert "Decode attention: 3 of the 4 compressed cells" in text and "the other 1 rebuilt the history" in text


def test_each_shipped_preset_is_the_frontier_cell_the_page_names():
    """docs/frontier.md labels a cell with a preset's name: the preset must build exactly that cell."""
    from pathlib import Path

    from kvpolicy import CompressedCache
    from kvpolicy.presets import BUILTIN_PRESETS
    from kvpolicy_lab.eval.frontier_report import PRESET_CELLS
    from kvpolicy_lab.eval.grid import grid_from_dict, load_config

    grid = grid_from_dict(load_config(Path(__file__).resolve().parents[2] / "examples/configs/frontier.toml"))
    specs = {s.label: s for s in grid.caches}
    assert set(PRESET_CELLS) == {n for n in BUILTIN_PRESETS if n.startswith("kvpolicy-")}
    for name, (budget, label) in PRESET_CELLS.items():
        assert name == f"kvpolicy-{budget:g}bit"
        assert specs[label].describe() == repr(CompressedCache.from_preset(name)), name


def test_verdicts_name_the_best_cache_under_each_budget_and_judge_the_presets():
    from kvpolicy_lab.eval.frontier_report import _verdicts

    pts = [_p("log4-k3cmv2c-t44x32-n8", 2.97, 0.031, 0.929), _p("other", 2.99, 0.019, 0.951),
           _p("log4-k3cmv3c-t44x32-n8", 3.45, 0.021, 0.937),
           _p("log4-k4cmv3c-t44x32-n8", 3.93, 0.0102, 0.959)]  # fmt: skip
    lines = "\n".join(_verdicts(pts))
    assert ("2-bit memory at 4-bit quality: Fewest bits meeting it at ≤ 3.0 bits per element: `other` "
            "(2.99 bits), KL 0.019, top-1 95.1% (target KL ≤ 0.02, top-1 ≥ 95%: met)") in lines  # fmt: skip
    # a budget's target is met by any cache within it that meets all of it, not only by the lowest KL:
    # here the lowest KL within 4.5 bits misses top-1, and a cache with more bits meets both
    assert ("Best at ≤ 4.5 bits per element: `log4-k4cmv3c-t44x32-n8` (3.93 bits), KL 0.010, top-1 95.9% (target KL "
            "≤ 0.015, top-1 ≥ 96%: not met)") in lines  # fmt: skip
    both = "\n".join(_verdicts([*pts, _p("k4v4", 4.4, 0.0125, 0.962)]))
    assert ("Fewest bits meeting it at ≤ 4.5 bits per element: `k4v4` (4.40 bits), KL 0.013, top-1 96.2% (target "
            "KL ≤ 0.015, top-1 ≥ 96%: met)") in both  # fmt: skip
    # 8k has its own target, and no 2k one
    at8k = "\n".join(_verdicts([_p("a", 2.8, 0.09, 0.85), _p("b", 2.95, 0.05, 0.9)], 8192))
    assert (
        "Fewest bits meeting it at ≤ 2.9 bits per element: `a` (2.80 bits), KL 0.090, top-1 85.0% (target KL ≤ "
        "0.1: met)" in at8k
    )
    assert "3.5 bits" not in at8k and "4-bit quality" not in at8k
    assert "`kvpolicy-3bit` = `log4-k3cmv2c-t44x32-n8`: 2.97 bits (within its 3.0-bit budget)" in lines
    assert "**`other` has a lower KL** there (0.0190 at 2.99 bits)" in lines
    assert "`kvpolicy-3.5bit` = `log4-k3cmv3c-t44x32-n8`: 3.45 bits (within its 3.5-bit budget), KL 0.0210" in lines
    assert "`other` has a lower KL** there (0.0190 at 2.99 bits)." in lines.split("kvpolicy-3.5bit")[1]
    assert (
        "`kvpolicy-4bit` = `log4-k4cmv3c-t44x32-n8`: 3.93 bits (within its 4.0-bit budget), KL 0.0102, top-1 95.9%; "
        "the lowest KL measured at ≤ 4.0 bits" in lines
    )
    # a lower KL within one standard error is not called better
    close = [Point("log4-k3cmv2c-t44x32-n8", 2.97, {("lm", "kl"): (0.0313, 0.002), ("lm", "top1"): (0.93, None)}),
             Point("s4", 2.99, {("lm", "kl"): (0.0310, 0.002), ("lm", "top1"): (0.93, None)})]  # fmt: skip
    lines = "\n".join(_verdicts(close))
    assert "`s4` measured 0.0003 lower (0.0310 at 2.99 bits), within one standard error (± 0.0020)" in lines
    assert "has a lower KL" not in lines
    # over budget, and the target missed, said so
    lines = "\n".join(_verdicts([_p("log4-k3cmv2c-t44x32-n8", 3.05, 0.03, 0.93), _p("a", 2.9, 0.05, 0.9)]))
    assert "3.05 bits (**over** its 3.0-bit budget)" in lines
    assert (
        "Best at ≤ 3.0 bits per element: `a` (2.90 bits), KL 0.050, top-1 90.0% (target KL ≤ 0.02, top-1 ≥ "
        "95%: not met)" in lines
    )
    # over budget with nothing within it (Gemma-3 at 3 bits): not called the lowest there
    lines = "\n".join(_verdicts([_p("log4-k3cmv2c-t44x32-n8", 3.35, 0.069, 0.91), _p("b", 3.3, 0.03, 0.94)]))
    assert (
        "3.35 bits (**over** its 3.0-bit budget), KL 0.0690, top-1 91.0%; no cache measured holds ≤ 3.0 bits" in lines
    )
    # over budget with a lower KL than everything within it: no negative "lower" gap
    lines = "\n".join(_verdicts([_p("log4-k4cmv3c-t44x32-n8", 4.3, 0.0198, 0.95), _p("b", 3.3, 0.0316, 0.94)]))
    assert ("4.30 bits (**over** its 4.0-bit budget), KL 0.0198, top-1 95.0%; no cache measured at ≤ 4.0 bits has "
            "a lower KL (the lowest there: `b`, 0.0316 at 3.30 bits)") in lines  # fmt: skip


def test_orderings_name_the_pairs_two_models_order_differently_beyond_their_errors():
    from kvpolicy_lab.eval.frontier_report import orderings

    def pt(cache, kl, se=0.001, whole=None):
        return Point(cache, 3.0, {("lm", "kl"): (kl, se), ("lm", "top1"): (0.9, None)}, whole)

    first = [pt("uncompressed", 0.0), pt("log42-k2v2", 0.27), pt("log42-k2v2-rot", 0.11), pt("sink42-k2v2-rot", 0.12),
             pt("recent42-k2v2-rot", 0.30), pt("only-first", 0.5)]  # fmt: skip
    other = [pt("uncompressed", 0.0), pt("log42-k2v2", 0.12, whole=10.2), pt("log42-k2v2-rot", 0.62, whole=10.4),
             pt("sink42-k2v2-rot", 0.6195, se=0.01, whole=10.4), pt("recent42-k2v2-rot", 0.9, whole=10.4)]  # fmt: skip
    text = "\n".join(orderings(first, other, ("A", "B")))
    assert "| cache | A bits/el | A KL | B bits/el (global layers) | B KL | KL B / A |" in text
    assert "`only-first`" not in text and "`uncompressed`" not in text  # shared, compressed caches only
    # pairs: (rot, sink) flipped within B's error; (k2v2, rot), (k2v2, sink) flipped beyond both errors
    assert "3 of the 6 pairs are ordered differently; 2 of them by more than one standard error on both" in text
    assert "`log42-k2v2-rot` 0.1100 < `log42-k2v2` 0.2700 on A, but 0.6200 > 0.1200 on B" in text
    # a policy ordering that differs is said to, even when the gap is within the errors (the pairs say which)
    want = (
        "Policy ordering (W=42, K2V2, rotation; lowest KL first): A log (0.1100) < sink (0.1200) < recent "
        "(0.3000); B sink (0.6195) < log (0.6200) < recent (0.9000): **different between the models**."
    )
    assert want in text


def test_the_page_lists_the_caches_of_the_grid_not_measured_yet(tmp_path):
    """A grid run in parts (hours of cells, stopped and resumed): the page names every cache of the
    grid that has no measurement yet."""
    cfg = tmp_path / "f.toml"
    cfg.write_text(
        'models = ["tiny-llama"]\ncontexts = [96]\n[tasks.lm]\nsamples_per_context = 1\ntokens = 4\n'
        '[[caches]]\nlabel = "uncompressed"\nkind = "dynamic"\n'
        '[[caches]]\nlabel = "log-2b"\npolicy = "log"\nwindow = 8\ngroup_size = 16\nbits = 2\n'
        '[[caches]]\nlabel = "later"\npolicy = "log"\nwindow = 8\ngroup_size = 16\nbits = 4\n'
    )
    run, doc = tmp_path / "run", tmp_path / "frontier.md"
    assert main(["ablate", "--config", str(cfg), "--out", str(run), "--no-progress"]) == 0
    # the run stopped before its last cell: that cell's rows never reached results.jsonl
    lines = (run / "results.jsonl").read_text().splitlines()
    (run / "results.jsonl").write_text("".join(line + "\n" for line in lines if '"later"' not in line))
    assert write_pages().main(["frontier", "--run", str(run), "--page", str(doc)]) == 0
    text = doc.read_text()
    assert "Not measured yet (1 of the grid's 3 caches for this model" in text and ": `later`." in text


def test_the_plot_names_the_frontier_the_anchors_and_the_presets_only():
    from kvpolicy_lab.eval.frontier_report import PRESET_CELLS, plot_labels

    name, (_, cell) = next(iter(PRESET_CELLS.items()))
    pts = [_p("a", 3.0, 0.2), _p("behind", 3.2, 0.3), _p("hf-quanto-4b", 5.0, 0.5), _p(cell, 3.5, 0.4),
           _p("b", 4.0, 0.01)]  # fmt: skip
    # "behind" is beaten by "a" with fewer bits: a grey, unnamed dot; the preset's cell is named for the preset
    assert plot_labels(pts) == {"a": "a", "hf-quanto-4b": "hf-quanto-4b", cell: name, "b": "b"}


def test_presets_show_their_worst_text_and_part_3_targets_are_judged():
    from kvpolicy_lab.eval.frontier_report import _verdicts

    def point(cache, bits, kl, worst, top1):
        return Point(cache, bits, {("lm", "kl"): (kl, None), ("lm", "kl_worst"): (worst, None),
                                   ("lm", "top1"): (top1, None)})  # fmt: skip

    pts = [point("log4-k3cmv2c-t44x32-n8", 2.97, 0.0314, 0.0468, 0.93),
           point("log4-k3cmv3c-t44x32-n8", 3.45, 0.0215, 0.0500, 0.94),
           point("low", 2.45, 0.039, 0.05, 0.9)]  # fmt: skip
    lines = "\n".join(_verdicts(pts))
    assert "KL 0.0314 (worst text 0.0468, 1.5× the mean: within 2×), top-1 93.0%" in lines
    assert "KL 0.0215 (worst text 0.0500, 2.3× the mean: **over** 2×)" in lines
    assert "- Stretch target: Fewest bits meeting it at ≤ 2.5 bits per element: `low` (2.45 bits)" in lines
    assert ("- Stretch target: Best at ≤ 3.0 bits per element: `log4-k3cmv2c-t44x32-n8` (2.97 bits), KL 0.031, "
            "top-1 93.0% (target KL ≤ 0.015, top-1 ≥ 95%: not met)") in lines  # fmt: skip
    # a cell without the worst text (measured before it was recorded) gets no clause, and 8k its own target
    assert "worst text" not in "\n".join(_verdicts([_p("log4-k3cmv2c-t44x32-n8", 2.97, 0.03, 0.93)]))
    at8k = "\n".join(_verdicts([_p("a", 1.9, 0.05, 0.85)], 8192))
    assert "- Stretch target: Fewest bits meeting it at ≤ 2.0 bits per element: `a` (1.90 bits)" in at8k
