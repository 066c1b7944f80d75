"""``kvpolicy ablate --executor ray``, ``--shard i/n`` and ``--merge``: the rows of the in-process runner.

A two-cell grid on a tiny random Llama (a second in-process). The Ray test starts a local Ray instance
twice (once by the executor, once by the test), which takes most of its half minute.
"""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from lab_fixtures import one_thread  # noqa: F401  (pytest fixtures)

from kvpolicy.cli import main
from kvpolicy_lab.eval.runner import CONFIG, RESULTS

pytestmark = pytest.mark.usefixtures("one_thread")

GRID = ["--model", "tiny-llama", "--context", "32", "--task", "lm:samples_per_context=1:tokens=4",
        "--baseline", "dynamic", "--policy", "log:window=8", "--bits", "2", "--no-progress"]  # fmt: skip


def _rows(out):
    """The rows of ``out/results.jsonl`` in file order, without their one timing field (``extra.seconds``)."""
    rows = [json.loads(line) for line in (out / RESULTS).read_text().splitlines()]
    for row in rows:
        del row["extra"]["seconds"]
    return rows


def _by_cell(rows):
    return sorted(rows, key=lambda r: (r["cell"], r["metric"]))


def _config(out):
    return json.loads((out / CONFIG).read_text())


def _ablate(argv, capsys):
    """``kvpolicy ablate argv``: its exit status and its stdout."""
    status = main(["ablate", *argv])
    return status, capsys.readouterr().out


def _fail(argv, capsys):
    """``kvpolicy ablate argv`` must stop with status 2 and a one-line error; returns that line."""
    try:
        status = main(["ablate", *argv])
    except SystemExit as exc:  # argparse
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("kvpolicy ablate: error: ")
    return line


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The grid run by the default (in-process) executor."""
    out = tmp_path_factory.mktemp("local")
    assert main(["ablate", *GRID, "--out", str(out)]) == 0
    rows = _rows(out)
    assert len({r["cell"] for r in rows}) == 2 and all(r["metric"] != "error" for r in rows)
    return out


def test_ray_gives_the_local_rows_and_resumes(local, tmp_path, capsys):
    ray = pytest.importorskip("ray")
    out = tmp_path / "ray"

    # the executor starts a local Ray instance for the run and shuts it down
    status, log = _ablate([*GRID, "--out", str(out), "--executor", "ray"], capsys)
    assert status == 0, log
    assert "ray: 2 cell(s) on 2 worker(s)" in log and "(2 run, 0 already done), 0 failed" in log
    assert not ray.is_initialized()
    assert _by_cell(_rows(out)) == _by_cell(_rows(local))
    assert _config(out) == _config(local)
    assert (out / "summary.md").read_text() == (local / "summary.md").read_text().replace(str(local), str(out))

    # everything done: nothing runs, and Ray is not even started
    lines = (out / RESULTS).read_text().splitlines()
    status, log = _ablate([*GRID, "--out", str(out), "--executor", "ray"], capsys)
    assert status == 0 and "(0 run, 2 already done)" in log and "ray:" not in log
    assert (out / RESULTS).read_text().splitlines() == lines

    # one cell's rows lost: only that cell runs again, on a Ray instance the caller started (left running)
    last = json.loads(lines[-1])["cell"]
    (out / RESULTS).write_text("".join(line + "\n" for line in lines if json.loads(line)["cell"] != last))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        line = _fail([*GRID, "--out", str(out), "--executor", "ray", "--cpus-per-cell", "64"], capsys)
        assert "asks for 64 CPU(s) (--cpus-per-cell), but the Ray cluster has 2" in line
        status, log = _ablate([*GRID, "--out", str(out), "--executor", "ray"], capsys)
        assert status == 0 and "(1 run, 1 already done), 0 failed" in log and "ray: 1 cell(s) on 1 worker(s)" in log
        assert ray.is_initialized()
    finally:
        ray.shutdown()
    assert _by_cell(_rows(out)) == _by_cell(_rows(local))


def test_shards_merge_into_the_unsharded_run(local, tmp_path, capsys):
    shards = [tmp_path / "s0", tmp_path / "s1"]
    for i, shard in enumerate(shards):
        status, log = _ablate([*GRID, "--out", str(shard), "--shard", f"{i}/2"], capsys)
        assert status == 0 and "ablation: 1 cells (1 run, 0 already done)" in log
        assert _config(shard)["shard"] == f"{i}/2" and len(_config(shard)["cells"]) == 1
    assert {r["cell"] for r in _rows(shards[0])}.isdisjoint(r["cell"] for r in _rows(shards[1]))

    merged = tmp_path / "merged"
    status, log = _ablate(["--out", str(merged), "--merge", *map(str, shards)], capsys)
    assert status == 0 and "merged 2 run(s)" in log and "2 cells, 2 finished, 0 failed" in log
    assert _rows(merged) == _rows(local)  # the same rows in the same order
    assert _config(merged) == _config(local)
    assert (merged / "summary.md").read_text() == (local / "summary.md").read_text()
    assert list(merged.glob("quality_vs_bytes_*.png"))

    # merging again, with the full run as a third source: every cell once
    status, _ = _ablate(["--out", str(merged), "--merge", *map(str, shards), str(local)], capsys)
    assert status == 0 and _rows(merged) == _rows(local)

    # the merged directory resumes like any run: nothing left to do
    status, log = _ablate([*GRID, "--out", str(merged)], capsys)
    assert status == 0 and "(0 run, 2 already done)" in log

    # a shard missing is named
    status, log = _ablate(["--out", str(tmp_path / "half"), "--merge", str(shards[1])], capsys)
    assert status == 0 and "shard(s) 0/2 not given" in log and len(_config(tmp_path / "half")["cells"]) == 1


def test_merge_refuses_runs_of_different_grids(local, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(local, other)
    config = _config(other)
    config["seed"] = 1
    (other / CONFIG).write_text(json.dumps(config))
    line = _fail(["--out", str(tmp_path / "m"), "--merge", str(local), str(other)], capsys)
    assert "another grid" in line and "'seed'" in line and str(other) in line
    assert not (tmp_path / "m").exists()
    line = _fail(["--out", str(tmp_path / "m"), "--merge", str(tmp_path / "nothing")], capsys)
    assert "holds no ablation run" in line
    line = _fail(["--out", str(tmp_path / "m"), "--merge", str(local), "--model", "tiny-llama"], capsys)
    assert "--merge takes the grid from the shards' config.json; leave out --model" in line
    line = _fail(["--out", str(tmp_path / "m"), "--merge", str(local), "--shard", "0/2"], capsys)
    assert "cannot be used with --shard 0/2" in line


@pytest.mark.parametrize("value", ["2/2", "-1/2", "0/0", "a/b", "1", "1/2/3", ""])
def test_bad_shard_values(tmp_path, capsys, value):
    line = _fail([*GRID, "--out", str(tmp_path / "run"), f"--shard={value}"], capsys)  # "=": "-1/2" is no flag
    assert "argument --shard:" in line and repr(value) in line and "0 <= I < N" in line
    assert not (tmp_path / "run").exists()


def test_missing_ray_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if ray were not installed
    line = _fail([*GRID, "--out", str(tmp_path / "run"), "--executor", "ray"], capsys)
    assert "--executor ray needs the package 'ray'" in line and 'pip install "kvpolicy-lab[ray]"' in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--address", "auto"], "--address applies only to --executor ray; got --executor local"),
        (["--cpus-per-cell", "2"], "--cpus-per-cell applies only to --executor ray"),
        (["--executor", "ray", "--gpus-per-cell", "1"], "--gpus-per-cell 1 applies to grids on cuda; device 'cpu'"),
        (["--executor", "ray", "--device", "cuda:1"], "with --executor ray use 'cuda'"),
    ],
)
def test_ray_settings_that_do_not_apply(tmp_path, capsys, extra, message):
    line = _fail([*GRID, "--out", str(tmp_path / "run"), *extra], capsys)
    assert message in line
    assert not (tmp_path / "run").exists()
