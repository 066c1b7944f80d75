"""The long-running commands under interruption, a second run on the same directory and an unreachable cluster.

- Ctrl-C: one line saying the run was interrupted and how to resume it, exit status 130, no traceback;
  the run directory is left consistent and the same command resumes it.
- A run directory is written by one run at a time: a second run on it is refused at once.
- ``--executor ray`` with an address where nothing listens fails in seconds, naming the address.

The grids are two cells on a tiny random Llama (a second or two each).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lab_fixtures import one_thread  # noqa: F401  (pytest fixtures)

import kvpolicy_lab.eval.cells
import kvpolicy_lab.eval.runner
from kvpolicy.cli import main
from kvpolicy_lab.eval.lock import LOCK, hold_run_dir
from kvpolicy_lab.eval.runner import CONFIG, RESULTS, load_done, scan_rows

pytestmark = pytest.mark.usefixtures("one_thread")

GRID = ["--model", "tiny-llama", "--context", "32", "--task", "lm:samples_per_context=1:tokens=4",
        "--baseline", "dynamic", "--policy", "log:window=8", "--bits", "2", "--no-progress"]  # fmt: skip
REPO = Path(__file__).resolve().parents[2]


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    """``kvpolicy argv``: exit status, stdout and stderr."""
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse
        status = exc.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _one_line(err: str) -> str:
    """The only line of ``err`` (blank lines aside); no traceback."""
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def _consistent(out: Path) -> set[str]:
    """Assert that ``out`` is a readable run directory; the ids of its finished cells."""
    config = json.loads((out / CONFIG).read_text())
    assert scan_rows(out / RESULTS)[1] == [] and (out / RESULTS).read_bytes().endswith(b"\n")
    done = load_done(out / RESULTS)
    assert done <= set(config["cells"])
    return done


def _resumes(out: Path, capsys, ran: int, skipped: int) -> None:
    """The same command again: it runs only the cells left."""
    status, stdout, _ = _run(["ablate", *GRID, "--out", str(out)], capsys)
    assert status == 0 and f"({ran} run, {skipped} already done), 0 failed" in stdout


def _interrupt_second_cell(monkeypatch) -> None:
    """Ctrl-C as the second cell starts (the first cell's rows are written by then)."""
    real = kvpolicy_lab.eval.cells.CellGroup.run
    calls = []

    def run(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(kvpolicy_lab.eval.cells.CellGroup, "run", run)


# ---------------------------------------------------------------------- Ctrl-C
def _interrupted_line(out: Path, command: str = "ablate") -> str:
    return (f"kvpolicy {command}: interrupted; the cells finished so far are kept in {out}: run the same command "
            "again to resume")  # fmt: skip


def test_an_interrupted_ablation_says_so_and_resumes(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    _interrupt_second_cell(monkeypatch)
    status, _, err = _run(["ablate", *GRID, "--out", str(out)], capsys)
    assert status == 130
    assert _one_line(err) == _interrupted_line(out)
    assert len(_consistent(out)) == 1
    with hold_run_dir(out):  # the lock went with the interrupted run
        pass
    monkeypatch.undo()
    _resumes(out, capsys, ran=1, skipped=1)


def _slow_ablate(out: Path, call: int, seconds: float) -> list[str]:
    """A ``kvpolicy ablate`` process whose ``call``-th cell first sleeps ``seconds`` (to be caught at it).

    The process starts with Python's own SIGINT handler, as from a terminal: a child inherits an ignored
    SIGINT from its parent, and a pytest worker's may be ignored by what ran in it before (a full run
    once caught the process napping in its slow cell 60 s after SIGINT). The sleep is cut in 0.05 s
    naps, as a real cell runs Python between its torch calls. SIGUSR1 makes the process print every
    thread's stack (the tests send it before they give up on a process)."""
    driver = (
        "import faulthandler, signal, sys, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
        "import kvpolicy_lab.eval.cells as cells\n"
        "real, calls = cells.CellGroup.run, []\n"
        "def run(self, *args, **kwargs):\n"
        "    calls.append(1)\n"
        f"    if len(calls) == {call}:\n"
        f"        end = time.monotonic() + {seconds}\n"
        "        while time.monotonic() < end:\n"
        "            time.sleep(0.05)\n"
        "    return real(self, *args, **kwargs)\n"
        "cells.CellGroup.run = run\n"
        "from kvpolicy.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    return [sys.executable, "-c", driver, "ablate", *GRID, "--out", str(out), "--threads", "1"]


def test_ctrl_c_in_a_real_process(tmp_path):
    """SIGINT to a ``kvpolicy ablate`` process while its second cell runs: exit status 130, one line."""
    out = tmp_path / "run"
    argv = _slow_ablate(out, call=2, seconds=120)
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 900  # a hang guard, not a timing: a busy machine runs the first cell slowly
        while not load_done(out / RESULTS) and proc.poll() is None:
            if time.monotonic() > deadline:
                pytest.fail(f"the first cell did not finish within 900 s: {proc.communicate()}")
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)  # into the second cell's sleep (an interruption anywhere after the first row says the same)
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # where it hangs: every thread's stack, on its stderr
            time.sleep(2)
            proc.kill()
            pytest.fail(f"still running 60 s after SIGINT; its stacks and output:\n{proc.communicate()}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.strip().splitlines()[-1] == _interrupted_line(out)
    assert len(_consistent(out)) == 1


def test_an_interrupted_ray_run_stops_ray_and_resumes(tmp_path, capsys, monkeypatch):
    ray = pytest.importorskip("ray")
    out = tmp_path / "run"
    real_wait, calls = ray.wait, []

    def wait(*args, **kwargs):  # Ctrl-C while the driver waits for the second result
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_wait(*args, **kwargs)

    monkeypatch.setattr(ray, "wait", wait)
    if ray.is_initialized():  # an earlier test's instance: this run must start (and stop) its own
        ray.shutdown()
    # Ray's log handlers keep the stderr of the test that first imported it (pytest closed that capture
    # since): point them at this test's, or their "--- Logging error ---" tracebacks land in err
    for handler in logging.getLogger("ray").handlers:
        if isinstance(handler, logging.StreamHandler):
            monkeypatch.setattr(handler, "stream", sys.stderr)
    status, _, err = _run(["ablate", *GRID, "--out", str(out), "--executor", "ray"], capsys)
    assert status == 130
    assert err.strip().splitlines()[-1] == _interrupted_line(out) and "Traceback" not in err
    assert not ray.is_initialized()  # the workers were stopped and the instance started for the run shut down
    assert len(_consistent(out)) == 1
    monkeypatch.undo()
    _resumes(out, capsys, ran=1, skipped=1)


def test_other_commands_say_they_were_interrupted(capsys, monkeypatch):
    import kvpolicy_lab.bench.backends

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(kvpolicy_lab.bench.backends, "_available", interrupted)
    status, _, err = _run(["bench", "backends", "--shape", "1", "1", "8", "64", "--group-size", "8"], capsys)
    assert status == 130 and _one_line(err) == "kvpolicy bench backends: interrupted"


def test_an_interrupted_tune_names_its_run_directories(tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(kvpolicy_lab.eval.runner, "open_model", interrupted)
    status, _, err = _run(["tune", "--budget-bits", "3", "--model", "tiny-llama",
                           "--preset-file", str(tmp_path / "p.toml")], capsys)  # fmt: skip
    assert status == 130 and _one_line(err) == _interrupted_line(tmp_path / "p-runs", "tune")


# ---------------------------------------------------------------------- one run per directory
@pytest.fixture
def held(tmp_path):
    """A run directory whose lock another process holds; yields (directory, that process's id)."""
    out = tmp_path / "held"
    code = (
        "import sys\nfrom pathlib import Path\nfrom kvpolicy_lab.eval.lock import hold_run_dir\n"
        "with hold_run_dir(Path(sys.argv[1])):\n    print('held', flush=True)\n    sys.stdin.read()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "held"
        yield out, proc.pid
    finally:
        proc.communicate("")  # end of input: the holder exits, and its lock goes
    assert proc.returncode == 0


def _refused(line: str, out: Path, pid: int, flag: str = "--out") -> None:
    assert line.startswith("kvpolicy ") and ": error: " in line
    assert f"{flag} {str(out)!r} is in use: another kvpolicy run (process {pid}) holds its lock" in line


def test_a_second_ablation_on_a_held_directory_is_refused(held, capsys):
    out, pid = held
    status, _, err = _run(["ablate", *GRID, "--out", str(out)], capsys)
    assert status == 2
    _refused(_one_line(err), out, pid)
    assert sorted(p.name for p in out.iterdir()) == [LOCK]  # nothing computed, nothing written


def test_two_ablations_at_once_run_each_cell_once(tmp_path):
    """Two processes on one directory: one runs the grid, the other is refused; every cell runs once."""
    out = tmp_path / "run"
    argv = _slow_ablate(out, call=1, seconds=10)  # whichever gets the lock holds it while the other starts
    procs = [subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]  # fmt: skip
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    assert sorted(status for status, _, _ in results) == [0, 2], results
    err = next(err for status, _, err in results if status == 2)
    assert "Traceback" not in err and f"--out {str(out)!r} is in use" in err.strip().splitlines()[-1]
    rows, _ = scan_rows(out / RESULTS)
    cells = [r["cell"] for r in rows]
    assert len(set(cells)) == 2 and len(cells) == len({(r["cell"], r["metric"]) for r in rows})


def test_tune_and_merge_refuse_a_held_directory_and_report_only_reads_it(held, tmp_path, capsys, monkeypatch):
    out, pid = held

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the held directory was refused")

    monkeypatch.setattr(kvpolicy_lab.eval.runner, "open_model", refuse)
    status, _, err = _run(["tune", "--budget-bits", "3", "--model", "tiny-llama", "--preset-file",
                           str(tmp_path / "p.toml"), "--out", str(out)], capsys)  # fmt: skip
    assert status == 2
    _refused(_one_line(err), out, pid, "--out")
    monkeypatch.undo()

    shard = tmp_path / "shard"
    assert _run(["ablate", *GRID, "--out", str(shard)], capsys)[0] == 0
    status, _, err = _run(["ablate", "--out", str(out), "--merge", str(shard)], capsys)
    assert status == 2
    _refused(_one_line(err), out, pid)

    with hold_run_dir(shard):  # a run in progress: --report-only only reads results and rewrites the report
        status, _, err = _run(["ablate", *GRID, "--out", str(shard), "--report-only"], capsys)
    assert status == 0 and "Traceback" not in err and (shard / "summary.md").is_file()


def test_the_lock_goes_with_the_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert _run(["ablate", *GRID, "--out", str(out)], capsys)[0] == 0
    assert (out / LOCK).is_file()
    with hold_run_dir(out):  # free again once the run has ended
        pass
    (out / CONFIG).write_text("{")
    status, _, err = _run(["ablate", *GRID, "--out", str(out), "--report-only"], capsys)
    line = _one_line(err)
    assert status == 2 and "is not valid JSON" in line
    _resumes(out, capsys, ran=0, skipped=2)  # a normal run rewrites config.json and finds every cell done


# ---------------------------------------------------------------------- unreachable clusters
def _free_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("scheme", ["", "ray://"])
def test_an_address_where_nothing_listens_fails_in_seconds(tmp_path, capsys, monkeypatch, scheme):
    pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    address = f"{scheme}127.0.0.1:{_free_port()}"
    out = tmp_path / "run"
    start = time.monotonic()
    status, _, err = _run(["ablate", *GRID, "--out", str(out), "--executor", "ray", "--address", address], capsys)
    assert time.monotonic() - start < 30
    line = _one_line(err)
    assert status == 2 and line.startswith("kvpolicy ablate: error: --executor ray: ")
    assert f"--address {address!r}" in line and "Connection refused" in line and "give another --address" in line
    assert not out.exists()


def test_ray_address_from_the_environment_is_probed_too(tmp_path, capsys, monkeypatch):
    pytest.importorskip("ray")
    address = f"127.0.0.1:{_free_port()}"
    monkeypatch.setenv("RAY_ADDRESS", address)

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the address was checked")

    monkeypatch.setattr(kvpolicy_lab.eval.runner, "open_model", refuse)
    for argv in (["ablate", *GRID, "--out", str(tmp_path / "run"), "--executor", "ray", "--address", "auto"],
                 ["tune", "--budget-bits", "3", "--model", "tiny-llama", "--preset-file", str(tmp_path / "p.toml"),
                  "--executor", "ray"]):  # fmt: skip
        status, _, err = _run(argv, capsys)
        line = _one_line(err)
        assert status == 2 and f"RAY_ADDRESS {address!r}" in line and "Connection refused" in line, line


def test_write_whole_leaves_the_old_file_or_the_new(tmp_path, monkeypatch):
    from kvpolicy_lab.eval.runner import write_whole

    path = tmp_path / CONFIG
    path.write_text("old")

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_whole(path, "new")
    assert path.read_text() == "old"
    monkeypatch.undo()
    write_whole(path, "new")
    assert path.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == [CONFIG]
