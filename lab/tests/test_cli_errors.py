"""Mistakes on the command line and in grid files: one line on stderr naming the flag (or key), the value
and what is allowed; exit status 2; no traceback; no model loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lab_fixtures import no_model_load  # noqa: F401  (pytest fixture)

from kvpolicy import registry
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.cli import main
from kvpolicy.hookspecs import hookimpl

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


pytestmark = pytest.mark.usefixtures("no_model_load")


def _fail(argv: list[str], capsys) -> str:
    """Run ``kvpolicy argv``; assert exit status 2 and a one-line error without traceback; return it."""
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert [line for line in lines if not line.startswith(("usage:", " "))] == [lines[-1]]
    assert lines[-1].startswith(f"kvpolicy {argv[0]}") and ": error: " in lines[-1]
    return lines[-1]


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("x")
    return path


ABLATE = ["ablate", "--model", "tiny-llama", "--baseline", "dynamic"]


@pytest.mark.parametrize(
    ("flag", "value", "allowed"),
    [
        ("--context", "64,abc", "is comma-separated; --context takes its values separated by spaces: --context 64 abc"),
        ("--context", "abc", "must be a token count such as 512, 2k, 8k or 128k"),
        ("--context", "4", "must be a token count from 8 to"),
        ("--context", "", "must be a token count such as 512, 2k, 8k or 128k"),
        ("--bits", "two", "integer >= 1"),
        ("--bits", "2,0", "is comma-separated; --bits takes its values separated by spaces: --bits 2 0"),
        ("--seed", "-1", "integer >= 0"),
        ("--threads", "0", "integer >= 1"),
        ("--threads", "many", "integer >= 1"),
        ("--batch", "0", "integer >= 1"),
        ("--batch", "4.5", "integer >= 1"),
        ("--device", "gpu", "cpu, cuda, cuda:N or mps"),
    ],
)
def test_ablate_bad_flag_values(tmp_path, capsys, flag, value, allowed):
    out = tmp_path / "run"
    line = _fail([*ABLATE, "--out", str(out), flag, value], capsys)
    assert f"argument {flag}:" in line and repr(value) in line and allowed in line
    assert not out.exists()


@NO_CUDA
def test_ablate_device_without_cuda(tmp_path, capsys):
    out = tmp_path / "run"
    line = _fail([*ABLATE, "--out", str(out), "--device", "cuda"], capsys)
    assert "--device" in line and "'cuda'" in line and "not available" in line and "use cpu" in line
    assert not out.exists()


def test_ablate_out_that_is_a_file_or_under_one(a_file, capsys):
    line = _fail([*ABLATE, "--out", str(a_file)], capsys)
    assert "argument --out:" in line and str(a_file) in line and "existing file" in line
    line = _fail([*ABLATE, "--out", str(a_file / "run")], capsys)
    assert "argument --out:" in line and "cannot be created" in line


def test_out_in_an_unwritable_directory(tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(locked) else real_access(p, mode))
    line = _fail([*ABLATE, "--out", str(locked / "run")], capsys)
    assert "argument --out:" in line and "not writable" in line
    line = _fail(["bench", "decode", "--out", str(locked)], capsys)
    assert "argument --out:" in line and "cannot write" in line


@pytest.fixture
def unwritable(tmp_path):
    """A directory where creating a file really fails: a read-only one (when the permission bits bind
    this user), else ``/sys`` (which refuses new files even to root); skipped where neither works."""
    locked = tmp_path / "read-only"
    locked.mkdir()
    locked.chmod(0o555)
    candidates = [locked, Path("/sys")]
    try:
        for directory in candidates:
            try:
                (directory / "probe").touch()
            except OSError:
                yield directory
                return
            (directory / "probe").unlink()
        pytest.skip("no directory here refuses new files to this user")
    finally:
        locked.chmod(0o755)


TUNE = ["tune", "--budget-bits", "3", "--model", "tiny-llama"]

#: every output flag of every command: (arguments before it, the flag, the name written under the directory)
OUTPUT_FLAGS = [
    ([*ABLATE, "--out", "{ok}/run"], "--out", "run"),
    ([*TUNE, "--out", "{ok}/runs"], "--preset-file", "preset.toml"),
    ([*TUNE, "--preset-file", "{ok}/preset.toml"], "--out", "runs"),
    (["analyze", "attention", "--model", "tiny-llama"], "--out", "attention"),
    (["analyze", "rotation", "--model", "tiny-llama"], "--json", "rotation.json"),
    (["bench", "decode", "--model", "tiny-llama"], "--out", "bench"),
]


@pytest.mark.parametrize(("before", "flag", "name"), OUTPUT_FLAGS, ids=lambda v: v if isinstance(v, str) else None)
def test_every_output_flag_is_checked_before_any_work(tmp_path, unwritable, capsys, before, flag, name):
    target = unwritable / name
    argv = [a.replace("{ok}", str(tmp_path)) for a in before]
    line = _fail([*argv, flag, str(target)], capsys)
    assert f"argument {flag}:" in line and str(target) in line
    assert "cannot" in line or "not writable" in line


@pytest.mark.parametrize(
    ("argv", "flag"),
    [([*TUNE, "--preset-file"], "--preset-file"), (["analyze", "rotation", "--json"], "--json")],
)  # fmt: skip
def test_an_existing_file_that_cannot_be_written_is_refused(tmp_path, a_file, capsys, monkeypatch, argv, flag):
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(a_file) else real_access(p, mode))
    line = _fail([*(a.replace("{ok}", str(tmp_path)) for a in argv), str(a_file)], capsys)
    assert f"argument {flag}:" in line and str(a_file) in line and "a file this user cannot write to" in line
    assert a_file.read_text() == "x"


def test_the_default_runs_directory_of_tune_is_checked(tmp_path, capsys):
    (tmp_path / "preset-runs").write_text("not a directory")
    line = _fail([*TUNE, "--preset-file", str(tmp_path / "preset.toml")], capsys)
    assert "--out (default: next to --preset-file)" in line and str(tmp_path / "preset-runs") in line
    assert "existing file, not a directory" in line


def test_the_write_check_leaves_nothing_behind(tmp_path):
    from kvpolicy_lab.commands._types import out_dir, out_file

    (tmp_path / "page.md").write_text("kept")
    assert out_dir(str(tmp_path / "new" / "run")) == tmp_path / "new" / "run"
    assert out_file(str(tmp_path / "page.md")) == tmp_path / "page.md"
    assert out_dir(str(tmp_path)) == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.md"]
    assert (tmp_path / "page.md").read_text() == "kept"


@pytest.mark.parametrize(
    ("flag", "value", "allowed"),
    [
        ("--steps", "0", "integer >= 1"),
        ("--reps", "0", "integer >= 1"),
        ("--warmup", "-1", "integer >= 0"),
        ("--batch", "0", "integer >= 1"),
        ("--window", "-4", "integer >= 1"),
        ("--threads", "0", "integer >= 1"),
        ("--max-batch", "0", "integer >= 1"),
        ("--budget-gib", "-1", "finite number > 0"),
        ("--budget-gib", "inf", "finite number > 0"),
        ("--budget-gib", "lots", "finite number > 0"),
        ("--lengths", "0", "must be a token count from 1 to"),
        ("--lengths", "abc", "must be a token count such as 512, 2k, 8k or 128k"),
        ("--context", "1x", "must be a token count such as 512, 2k, 8k or 128k"),
        ("--caches", "nosuch", "'dynamic', 'one-liner', 'preset:<name or file.toml>', 'hf-<quanto|hqq>-<bits>'"),
        ("--device", "tpu", "cpu, cuda, cuda:N or mps"),
    ],
)
def test_bench_decode_bad_flag_values(tmp_path, capsys, flag, value, allowed):
    line = _fail(["bench", "decode", "--model", "tiny-llama", "--out", str(tmp_path / "b"), flag, value], capsys)
    assert line.startswith("kvpolicy bench decode: error:")
    assert f"argument {flag}:" in line and repr(value) in line and allowed in line


@pytest.mark.parametrize(
    ("flag", "value", "allowed"),
    [
        ("--shape", "1,2,3", "is comma-separated; --shape takes its values separated by spaces: --shape 1 2 3"),
        ("--shape", "0", "integer >= 1"),
        ("--bits", "0", "integer >= 1"),
        ("--group-size", "-64", "integer >= 1"),
        ("--repeats", "0", "integer >= 1"),
    ],
)
def test_bench_backends_bad_flag_values(capsys, flag, value, allowed):
    line = _fail(["bench", "backends", flag, value], capsys)
    assert f"argument {flag}:" in line and repr(value) in line and allowed in line


@pytest.mark.parametrize(
    ("extra", "dim"),
    [
        ([], "tokens of --shape 1 8 4096 128 (tokens=4096"),
        (["--axis", "token", "--shape", "1", "1", "8", "96"], "head_dim"),
    ],
)
def test_bench_backends_group_size_that_does_not_split_the_shape(capsys, extra, dim):
    line = _fail(["bench", "backends", "--group-size", "7", *extra], capsys)
    assert line.startswith("kvpolicy bench backends: error: --group-size 7 does not divide the ")
    assert dim in line and "use a divisor of" in line


class _Refuses(TorchBackend):
    """A backend whose library refuses, when quantizing, what its capabilities accept."""

    name = "test-refuses"

    def quantize(self, x, fmt, centre=None):
        raise ValueError(f"Group size ({fmt.group_size}) must be a divisor of (128)\nmore detail")


class _RefusingPlugin:
    @hookimpl
    def kvpolicy_register_backends(self):
        return {"test-refuses": _Refuses}


def test_bench_backends_reports_a_backend_that_refuses_when_quantizing(capsys):
    plugin = _RefusingPlugin()
    registry.register(plugin, name="test-refusing-backend")
    try:
        status = main(["bench", "backends", "--shape", "1", "1", "16", "64", "--group-size", "16", "--repeats", "1",
                       "--backends", "torch", "test-refuses"])  # fmt: skip
    finally:
        registry.unregister(plugin)
    captured = capsys.readouterr()
    assert status == 0 and "Traceback" not in captured.err
    rows = [line.split()[0] for line in captured.out.splitlines()[2:] if not line.startswith("skipped")]
    assert rows == ["clone", "torch"]
    assert (
        "skipped test-refuses: backend 'test-refuses' refused bits=2 group_size=16 axis='channel' on shape "
        "(1, 1, 16, 64) torch.float16: ValueError: Group size (16) must be a divisor of (128)\n"
    ) in captured.out


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--context-tokens", "0"),
        ("--max-new-tokens", "-1"),
        ("--max-new-tokens", "forty"),
        ("--continuation-tokens", "0"),
        ("--threads", "-3"),
    ],
)
def test_demo_bad_flag_values(capsys, flag, value):
    line = _fail(["demo", flag, value], capsys)
    allowed = "integer >= 1" if flag == "--threads" else "must be a token count"
    assert f"argument {flag}:" in line and repr(value) in line and allowed in line


@pytest.mark.parametrize(
    ("flag", "value", "allowed"),
    [
        ("--context", "0", "must be a token count from 1 to"),
        ("--queries", "0", "integer >= 1"),
        ("--top-k", "-1", "integer >= 1"),
        ("--seed", "x", "integer >= 0"),
        ("--threads", "0", "integer >= 1"),
        ("--device", "gpu", "cpu, cuda, cuda:N or mps"),
    ],
)
def test_analyze_attention_bad_flag_values(tmp_path, capsys, flag, value, allowed):
    line = _fail(["analyze", "attention", "--model", "tiny-llama", "--out", str(tmp_path / "a"), flag, value], capsys)
    assert line.startswith("kvpolicy analyze attention: error:")
    assert f"argument {flag}:" in line and repr(value) in line and allowed in line


@NO_CUDA
@pytest.mark.parametrize("command", [["bench", "decode"], ["bench", "backends"], ["analyze", "attention"]])
def test_device_cuda_without_cuda(capsys, command):
    line = _fail([*command, "--device", "cuda"], capsys)
    assert "argument --device:" in line and "'cuda'" in line and "not available" in line


def test_analyze_out_that_is_a_file(a_file, capsys):
    line = _fail(["analyze", "attention", "--out", str(a_file)], capsys)
    assert "argument --out:" in line and "existing file" in line


# ---------------------------------------------------------------------- grid files
@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ('bits = "2,4"', "[cross] bits must be a list of integers, e.g. bits = [2, 4]; got the string '2,4'"),
        ('bits = "two"', "[cross] bits must be a list of integers, e.g. bits = [2, 4]; got the string 'two'"),
        ('policies = "log"', """[cross] policies must be a list of names, e.g. policies = ["log"]; got the string"""),
        ("bits = [2, true]", "[cross] bits must be a list of integers; got bits=[2, True]"),
    ],
)
def test_cross_lists_given_as_strings_are_refused(tmp_path, capsys, toml, expected):
    config = tmp_path / "grid.toml"
    config.write_text(f'models = ["tiny-llama"]\ncontexts = [64]\n[cross]\n{toml}\n')
    line = _fail(["ablate", "--out", str(tmp_path / "run"), "--config", str(config)], capsys)
    assert expected in line


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ('models = "smollm2"', """models must be a list of model names or paths, e.g. models = ["smollm2"]"""),
        ('contexts = "2048"', "contexts must be a list of integers, e.g. contexts = [2048]"),
        ('seed = "0"', "seed must be an integer >= 0; got seed='0'"),
        ('replay = "false"', "replay must be true or false; got replay='false'"),
        ('device = "gpu"', "device: 'gpu' is not a device; did you mean 'cpu'? (use cpu, cuda, cuda:N or mps)"),
        ("[tasks.speed]\nsteps = 0", "task 'speed': steps must be an integer >= 1; got steps=0"),
        ('[tasks.speed]\ncontexts = "32,x"', "task 'speed': contexts must be integers >= 8"),
        ('[only]\nlm = "ref"', """[only] lm must be a list of cache labels, e.g. lm = ["ref"]"""),
        ("[attention]\ntop_k = 0", "[attention] top_k must be an integer >= 1; got top_k=0"),
    ],
)
def test_grid_file_values_of_the_wrong_type(tmp_path, capsys, toml, expected):
    config = tmp_path / "grid.toml"
    config.write_text(f'{toml}\n[[caches]]\nkind = "dynamic"\nlabel = "ref"\n')
    line = _fail(["ablate", "--out", str(tmp_path / "run"), "--config", str(config)], capsys)
    assert expected in line


def test_cache_entries_of_the_wrong_type(tmp_path, capsys):
    config = tmp_path / "grid.toml"
    config.write_text('[[caches]]\nkind = "dynamic"\nsize_params = "window"\n')
    line = _fail(["ablate", "--out", str(tmp_path / "run"), "--config", str(config)], capsys)
    assert 'size_params must be a list of parameter names, e.g. size_params = ["window"]' in line
    config.write_text('caches = { kind = "dynamic" }\n')
    assert "caches must be a list of tables" in _fail(
        ["ablate", "--out", str(tmp_path), "--config", str(config)], capsys
    )


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("grid.json", b"[1, 2]", "the top level must be an object of config keys"),
        ("grid.json", b"{", "is not valid JSON"),
        ("grid.toml", b"\xff\xfe", "is not UTF-8 text (byte 0xff at offset 0)"),
        ("grid.toml", b"a = " + b"[" * 3000 + b"]" * 3000, "nests tables or arrays too deeply"),
        ("grid.json", b"[" * 3000 + b"]" * 3000, "nests objects or arrays too deeply"),
        ("grid.toml", b"models = " + b"[" * 40 + b"]" * 40, "more than 32 levels deep"),
        ("grid.toml", b"\x00\x01\x02", "is a binary file"),
        ("grid.toml", b"# " + b"x" * (1 << 20), "a config file is at most 1048576 bytes"),
    ],
)
def test_unreadable_grid_files(tmp_path, capsys, name, content, expected):
    config = tmp_path / name
    config.write_bytes(content)
    line = _fail(["ablate", "--out", str(tmp_path / "run"), "--config", str(config)], capsys)
    assert expected in line and name in line


def test_grid_files_that_are_not_regular_files_are_refused_without_reading(tmp_path, capsys):
    import os

    (tmp_path / "dir.toml").mkdir()
    (tmp_path / "zero.toml").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo.toml")
    for name, expected in (("dir.toml", "is a directory"), ("zero.toml", "is not a regular file"),
                           ("fifo.toml", "is not a regular file"), ("gone.toml", "does not exist")):  # fmt: skip
        line = _fail(["ablate", "--out", str(tmp_path / "run"), "--config", str(tmp_path / name)], capsys)
        assert expected in line and name in line


def test_speed_contexts_accept_a_comma_separated_string():
    from kvpolicy_lab.eval.grid import grid_from_dict

    grid = grid_from_dict(
        {"contexts": [64], "tasks": {"speed": {"contexts": "32,64"}}, "caches": [{"kind": "dynamic"}]}
    )
    assert grid.task_objects()["speed"] == {"steps": 8, "repeats": 1, "contexts": [32, 64]}


def test_the_command_line_exits_2_without_traceback(tmp_path):
    config = tmp_path / "grid.json"
    config.write_text(json.dumps({"cross": {"bits": "2,4"}}))
    for argv in (
        ["bench", "decode", "--caches", "nosuch"],
        ["ablate", "--out", str(tmp_path), "--config", str(config)],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "kvpolicy.cli", *argv], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 2 and "Traceback" not in done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith(f"kvpolicy {argv[0]}")
