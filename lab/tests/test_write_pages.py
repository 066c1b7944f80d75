"""scripts/write_pages.py: the maintainer script that writes docs/results.md and docs/frontier.md from run
directories, and ``kvpolicy ablate``, which no longer writes them."""

from __future__ import annotations

from pathlib import Path

import pytest
from lab_fixtures import ROOT, write_pages

from kvpolicy.cli import main


def _error(argv: list[str], capsys) -> str:
    """Run the script with ``argv``; assert exit status 2 and return the last line of stderr."""
    with pytest.raises(SystemExit) as exc:
        write_pages().main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.fixture
def run(tmp_path) -> Path:
    """A directory that looks like a finished run (its rows are never read by the checks)."""
    path = tmp_path / "run"
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "results.jsonl").write_text("")
    return path


def test_ablate_help_shows_no_page_flags(capsys):
    with pytest.raises(SystemExit):
        main(["ablate", "--help"])
    text = capsys.readouterr().out
    assert "--out" in text and "--report-only" in text
    assert "--docs" not in text and "--frontier-doc" not in text and "--command-line" not in text


def test_ablate_refuses_the_page_flags(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["ablate", "--model", "tiny-llama", "--out", str(tmp_path / "run"), "--docs", "x.md"])
    assert exc.value.code == 2 and "unrecognized arguments: --docs" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_missing_run_directory_is_named(tmp_path, capsys):
    missing = tmp_path / "no-such-run"
    line = _error(["frontier", "--run", str(missing), "--page", str(tmp_path / "frontier.md")], capsys)
    assert "argument --run:" in line and str(missing) in line and "not a directory" in line
    assert "give the --out directory of a kvpolicy ablate run" in line


def test_a_directory_without_rows_is_not_a_run(tmp_path, capsys):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    line = _error(["results", "--run", str(tmp_path / "half"), "--page", str(tmp_path / "results.md")], capsys)
    assert "argument --run:" in line and "has no results.jsonl" in line


def test_a_page_that_cannot_be_written_is_named(tmp_path, run, capsys):
    line = _error(["frontier", "--run", str(run), "--page", str(tmp_path)], capsys)
    assert "argument --page:" in line and str(tmp_path) in line and "existing directory" in line
    (tmp_path / "a-file").write_text("x")
    under = tmp_path / "a-file" / "frontier.md"
    line = _error(["frontier", "--run", str(run), "--page", str(under)], capsys)
    assert "argument --page:" in line and str(under) in line and "existing file, not a directory" in line


@pytest.mark.parametrize(("name", "images"), [("results", "img/results"), ("frontier", "img/frontier")])
def test_the_images_directory_of_a_page_is_checked_before_any_row_is_read(tmp_path, run, capsys, name, images):
    (tmp_path / "docs" / images).parent.mkdir(parents=True)
    (tmp_path / "docs" / images).write_text("not a directory")
    page = tmp_path / "docs" / "page.md"
    line = _error([name, "--run", str(run), "--page", str(page)], capsys)
    assert f"--page {str(page)!r}: its images directory" in line and str(tmp_path / "docs" / images) in line
    assert not page.exists()


def test_the_results_page_is_written_from_a_run(tmp_path):
    cfg = tmp_path / "r.toml"
    cfg.write_text(
        'models = ["tiny-llama"]\ncontexts = [96]\n[tasks.lm]\nsamples_per_context = 1\ntokens = 4\n'
        '[[caches]]\nlabel = "uncompressed"\nkind = "dynamic"\n'
        '[[caches]]\nlabel = "log-2b"\npolicy = "log"\nwindow = 8\ngroup_size = 16\nbits = 2\n'
    )
    run, page = tmp_path / "run", tmp_path / "docs" / "results.md"
    assert main(["ablate", "--config", str(cfg), "--out", str(run), "--no-progress"]) == 0
    assert write_pages().main(["results", "--run", str(run), "--page", str(page)]) == 0
    text = page.read_text()
    assert (f"    kvpolicy ablate --config examples/configs/results.toml --out {run} --threads 2\n"
            f"    python scripts/write_pages.py results --run {run} --page {page}\n") in text  # fmt: skip
    assert "| `log-2b` |" in text and "Wilson score interval" in text


def test_the_committed_frontier_page_regenerates_from_the_committed_rows(tmp_path, monkeypatch):
    """docs/frontier.md, and the table of every cache beside the rows (results/frontier/caches.md), are what the
    script writes from results/frontier and the tail's results/frontier-tail, byte for byte (the plots are left
    out of the comparison: matplotlib's PNGs are not byte-stable across machines)."""
    script = write_pages()
    run, page, tail = Path("results/frontier"), Path("docs/frontier.md"), Path("results/frontier-tail")
    command = script.reproduction("frontier", run, page, tail)
    from kvpolicy_lab.eval.frontier_report import TABLES, write_frontier_doc

    monkeypatch.chdir(ROOT)  # the page names the run directories as the command gives them
    written = write_frontier_doc(run, tmp_path / "frontier.md", command, tmp_path / TABLES, tail=tail,
                                 tail_command=script.tail_run(tail))  # fmt: skip
    assert written.read_text() == (ROOT / page).read_text()
    assert (tmp_path / TABLES).read_text() == (ROOT / run / TABLES).read_text()
