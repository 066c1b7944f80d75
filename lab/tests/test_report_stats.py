"""The reports' statistics (kvpolicy_lab.eval.stats) and Markdown tables (kvpolicy_lab.eval.markdown)."""

from __future__ import annotations

import math

import pytest

from kvpolicy_lab.eval.markdown import md_table
from kvpolicy_lab.eval.stats import mean_se, spearman, successes, wilson
from kvpolicy_lab.eval.summary import depth_table, fmt, table


@pytest.mark.parametrize(
    ("k", "n", "low", "high"),
    # Newcombe (1998), "Two-sided confidence intervals for the single proportion", Table I, method 3 (Wilson)
    [(81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)],
)
def test_wilson_matches_the_published_intervals(k, n, low, high):
    got = wilson(k, n)
    assert got == pytest.approx((low, high), abs=5e-5)


def test_wilson_at_three_samples_matches_the_closed_form():
    """2 of 3 by hand: centre (p + z²/2n) / (1 + z²/n), half-width z √(p(1-p)/n + z²/4n²) / (1 + z²/n)."""
    z, n, p = 1.959963984540054, 3, 2 / 3
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert wilson(2, 3) == pytest.approx((centre - half, centre + half))
    assert wilson(3, 3)[1] == 1.0 and wilson(0, 3)[0] == 0.0  # inside [0, 1], unlike p ± 2 s.e.


@pytest.mark.parametrize(
    ("k", "n", "confidence", "name"),
    [(1, 0, 0.95, "n=0"), (4, 3, 0.95, "k=4"), (-1, 3, 0.95, "k=-1"), (1, 3, 1.0, "confidence=1.0")],
)
def test_wilson_names_the_argument_out_of_range(k, n, confidence, name):
    with pytest.raises(ValueError, match=name):
        wilson(k, n, confidence)


def test_successes_recovers_whole_pass_counts_only():
    assert successes(2 / 3, 3) == 2 and successes(0.0, 3) == 0 and successes(1.0, 5) == 5
    assert successes(0.5, 3) is None  # 1.5 passes: an average of scores other than 0 and 1
    assert successes(0.5, None) is None and successes(math.nan, 3) is None


def test_spearman_with_ties_uses_average_ranks():
    # ranks (1, 2.5, 2.5, 4) and (1, 3, 2, 4): covariance 4.5 over √(4.5 · 5), i.e. √0.9
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(math.sqrt(0.9))
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))  # one value only: no ranking to compare
    with pytest.raises(ValueError, match="3 and 2 values"):
        spearman([1, 2, 3], [1, 2])


def test_mean_se_is_the_sample_standard_deviation_over_root_n():
    mean, se = mean_se([1.0, 2.0, 3.0, 4.0])  # variance (2.25 + 0.25 + 0.25 + 2.25) / 3
    assert mean == 2.5 and se == pytest.approx(math.sqrt(5 / 3) / 2)
    assert math.isnan(mean_se([7.0])[1])
    with pytest.raises(ValueError, match="empty"):
        mean_se([])


def test_md_table_writes_compact_pipe_rows():
    text = md_table(["cache", "KL", "note"], [["`a`", "0.1000", ""], ["**`long-name`** ★", "12.5 ± 3", "–"]])
    assert text.split("\n") == ["| cache | KL | note |", "|---|---|---|", "| `a` | 0.1000 |  |",
                                "| **`long-name`** ★ | 12.5 ± 3 | – |"]  # fmt: skip
    assert md_table(["a", "b"], [["1", "x"]], align=["right", "left"]).split("\n")[1] == "|---:|---|"
    assert md_table(["a", "b"], []) == "| a | b |\n|---|---|"


def test_md_table_refuses_rows_of_another_width_and_unknown_alignments():
    with pytest.raises(ValueError, match="row 0 has 1 cells; the header has 2"):
        md_table(["a", "b"], [["1"]])
    with pytest.raises(ValueError, match="align 'centre'; allowed: left, right"):
        md_table(["a"], [["1"]], align=["centre"])


def test_pass_rates_show_a_wilson_interval_and_other_shares_their_standard_error():
    assert fmt("accuracy", 2 / 3, 1 / 3, 3) == "67% (21–94%)"
    assert fmt("accuracy", 1.0, 0.0, 3) == "100% (44–100%)"
    assert fmt("exact_match", 0.0, 0.0, 3) == "0% (0–56%)"
    assert fmt("accuracy", 0.5, 0.1, 3) == "50% ± 10%"  # not a count of passes: the standard error stays
    assert fmt("top1", 0.87, 0.01, 1280) == "87% ± 1%"  # agreement over correlated tokens: not a pass rate


def test_the_summary_table_gives_pass_rates_their_interval():
    rows = [{"cache": c, "metric": "accuracy", "value": v, "se": 0.33, "n": 3, "extra": {"by_depth": d}}
            for c, v, d in (("log", 2 / 3, {"0.1": 1.0, "0.9": 0.0}), ("evict", 0.0, {"0.1": 0.0}))]  # fmt: skip
    want = ["| cache | accuracy |", "|---|---|", "| `log` | 67% (21–94%) |", "| `evict` | 0% (0–56%) |"]
    assert table(rows, ["log", "evict"]).split("\n") == want
    want = ["| cache | depth 0.1 | depth 0.9 |", "|---|---|---|", "| `log` | 100% | 0% |", "| `evict` | 0% | – |"]
    assert depth_table(rows).split("\n") == want
