"""Resuming an ablation run from a damaged run directory: cut rows, garbage, bad config.json and sizing memo.

Each test runs a two-cell grid on a tiny random Llama (a second or two), damages the run directory
the way an interruption or a stray edit would, and runs again.
"""

from __future__ import annotations

import json

import pytest
from lab_fixtures import one_thread  # noqa: F401  (pytest fixtures)

from kvpolicy.cli import main
from kvpolicy.errors import ConfigError
from kvpolicy_lab.eval.grid import grid_from_dict
from kvpolicy_lab.eval.runner import CONFIG, RESULTS, Runner, load_done, repair_tail, scan_rows

pytestmark = pytest.mark.usefixtures("one_thread")

GRID = {
    "models": ["tiny-llama"],
    "contexts": [32],
    "tasks": {"lm": {"samples_per_context": 1, "tokens": 4}},
    "caches": [{"kind": "dynamic", "label": "ref"}, {"policy": "log", "window": 8, "bits": 2, "label": "log"}],
    "replay": False,
}


def _run(out, log=None):
    """Run the grid into ``out``; returns (failed cells, log lines)."""
    lines = [] if log is None else log
    failed = Runner(grid_from_dict(GRID), out, progress=False, log=lines.append).run()
    return failed, lines


def _lines(out):
    return (out / RESULTS).read_text().splitlines()


def _summary(log):
    return next(line for line in log if line.startswith("ablation:"))


@pytest.fixture
def finished(tmp_path):
    """A finished run directory and its result lines."""
    failed, _ = _run(tmp_path)
    assert failed == 0
    return tmp_path, _lines(tmp_path)


def _cells(out):
    return json.loads((out / CONFIG).read_text())["cells"]


def test_a_cut_last_row_is_dropped_and_its_cell_runs_again(finished):
    out, lines = finished
    last_cell = json.loads(lines[-1])["cell"]
    cut = "\n".join(lines)[: -len(lines[-1]) // 2]  # half of the last row, no newline
    (out / RESULTS).write_text(cut)
    assert last_cell not in load_done(out / RESULTS)

    failed, log = _run(out)

    assert failed == 0
    assert any("dropped its last line" in m and RESULTS in m for m in log)
    assert "(1 run, 1 already done), 0 failed" in _summary(log)
    after = _lines(out)
    rows = [json.loads(line) for line in after]  # every line parses: nothing was glued to the cut row
    assert set(_cells(out)) <= load_done(out / RESULTS)
    n_last = sum(json.loads(line)["cell"] == last_cell for line in lines)
    assert len(rows) == len(lines) - 1 + n_last  # the cut row gone, the cell's rows written whole again
    assert sum(r["cell"] == last_cell for r in rows) == 2 * n_last - 1


def test_a_whole_last_row_without_its_newline_is_kept(finished):
    out, lines = finished
    (out / RESULTS).write_text("\n".join(lines))  # only the final newline is missing

    failed, log = _run(out)

    assert failed == 0
    assert "(0 run, 2 already done), 0 failed" in _summary(log)
    assert not any("warning" in m for m in log)
    assert _lines(out) == lines and (out / RESULTS).read_text().endswith("\n")


def test_repair_tail_leaves_complete_files_alone(tmp_path):
    path = tmp_path / RESULTS
    assert repair_tail(path) == 0 and not path.exists()
    path.write_text('{"cell": "a", "metric": "m"}\n')
    assert repair_tail(path) == 0
    path.write_text('{"cell": "a", "metric": "m"}\n{"cell": "b", "met')
    assert repair_tail(path) == len('{"cell": "b", "met')
    assert path.read_text() == '{"cell": "a", "metric": "m"}\n'


def test_garbage_lines_are_skipped_with_a_warning_and_missing_rows_rerun(finished):
    out, lines = finished
    victim = json.loads(lines[0])["cell"]
    damaged = ["not json at all", *lines[1:3], "[1, 2]", '{"no": "cell"}', *lines[3:]]
    # the first row replaced by garbage; junk lines in the middle; a line that is not UTF-8 at the end
    (out / RESULTS).write_bytes(("\n".join(damaged) + "\n").encode() + b"\xff\xfe\n")
    rows, bad = scan_rows(out / RESULTS)
    assert bad == [1, 4, 5, len(damaged) + 1] and len(rows) == len(lines) - 1

    failed, log = _run(out)

    assert failed == 0
    warning = next(m for m in log if "not result rows" in m)
    assert "skipped 4 line(s)" in warning and "line 1, 4, 5," in warning and str(out / RESULTS) in warning
    assert "(1 run, 1 already done), 0 failed" in _summary(log)
    assert victim in load_done(out / RESULTS)
    assert set(_cells(out)) <= load_done(out / RESULTS)


def test_a_corrupt_config_json_is_rewritten_by_a_run(finished):
    out, _ = finished
    (out / CONFIG).write_text("{ truncated")

    failed, log = _run(out)

    assert failed == 0
    assert "(0 run, 2 already done)" in _summary(log)
    assert len(_cells(out)) == 2  # valid JSON again, the cells of the grid


@pytest.mark.parametrize("content", ["{ truncated", "[1, 2]", '{"cells": "abc"}'])
def test_report_only_with_a_corrupt_config_json_is_one_line(finished, capsys, content):
    out, _ = finished
    (out / CONFIG).write_text(content)
    argv = ["ablate", "--out", str(out), "--report-only", "--model", "tiny-llama", "--context", "32",
            "--task", "lm:samples_per_context=1:tokens=4", "--baseline", "dynamic"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert str(out / CONFIG) in err and "without --report-only" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_report_only_without_a_run_is_one_line(tmp_path, capsys):
    out = tmp_path / "none"
    assert main(["ablate", "--out", str(out), "--report-only", "--model", "tiny-llama", "--baseline", "dynamic"]) == 2
    err = capsys.readouterr().err
    assert "config.json not found" in err and "Traceback" not in err
    assert not (tmp_path / "none").exists()


def test_an_unreadable_results_file_is_a_config_error(tmp_path):
    (tmp_path / RESULTS).mkdir(parents=True)  # a directory where the file should be
    with pytest.raises(ConfigError, match=rf"{RESULTS} cannot be read .*new --out"):
        _run(tmp_path)


def test_rows_that_never_reach_the_file_are_counted_as_failed(tmp_path, monkeypatch):
    def drop_results(self, name, rows):  # a write that silently loses the rows
        pass

    monkeypatch.setattr(Runner, "_append", drop_results)
    failed, log = _run(tmp_path)
    assert failed == 2
    assert "2 failed" in _summary(log) and any("incomplete" in m for m in log)


def test_a_corrupt_sizing_memo_is_ignored_with_a_warning(tmp_path):
    runner = Runner(grid_from_dict(GRID), tmp_path, progress=False, log=(log := []).append)
    memo = tmp_path / "sizing.json"
    for content in ("{ truncated", "[1]", '{"tiny-llama": 3}'):
        memo.write_text(content)
        assert runner._read_sizing_memo(memo) == {}
    assert sum("not a sizing memo" in m for m in log) == 3
    memo.write_text('{"tiny-llama": {"k": 1}}')
    assert runner._read_sizing_memo(memo) == {"tiny-llama": {"k": 1}}


def test_a_run_stopped_early_still_reports_the_cells_finished_before(tmp_path, monkeypatch):
    """``config.json`` lists the grid's cells when a run starts, not only as its groups run: a run
    stopped before it reached a model (a long grid resumed, then interrupted again) must not hide
    that model's finished cells from ``--report-only`` and the pages."""
    from kvpolicy_lab.eval.runner import current_rows

    log = {"label": "log", "policy": "log", "window": 8, "bits": 2, "group_size": 16}
    grid = grid_from_dict({"models": ["tiny-llama", "tiny-qwen2"], "contexts": [32],
                           "tasks": {"lm": {"samples_per_context": 1, "tokens": 3}},
                           "caches": [{"kind": "dynamic", "label": "ref"}, log]})  # fmt: skip
    assert Runner(grid, tmp_path, progress=False, log=lambda s: None).run() == 0
    before = current_rows(tmp_path)[1]
    assert {r["model"] for r in before} == {"tiny-llama", "tiny-qwen2"}

    def stopped(self, model_name, tasks, done, bar):
        raise KeyboardInterrupt

    monkeypatch.setattr(Runner, "run_model", stopped)
    with pytest.raises(KeyboardInterrupt):
        Runner(grid, tmp_path, progress=False, log=lambda s: None).run()
    after = current_rows(tmp_path)[1]
    assert sorted((r["cell"], r["metric"]) for r in after) == sorted((r["cell"], r["metric"]) for r in before)
