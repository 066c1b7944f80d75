"""``kvpolicy bench memory``: one process per cache on a tiny Llama saved to a directory, and its parts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import kvpolicy_lab.bench.memory as bench_memory
from kvpolicy.cli import main
from kvpolicy_lab.bench.decode import tiny_llama

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(torch.float32).save_pretrained(path)
    return path


def _bytes(length: int) -> int:
    """fp32 DynamicCache of the tiny Llama: tokens x 4 layers x 2 kv heads x 64 x (k, v) x 4 bytes."""
    return length * 4 * 2 * 64 * 2 * 4


def test_one_process_per_cache_smoke(model_dir, tmp_path, capsys):
    caches = ["none", "dynamic", "hf-quanto-2", "one-liner"]
    rc = main(["bench", "memory", "--model", str(model_dir), "--lengths", "200", "--steps", "3", "--threads", "1",
               "--caches", *caches, "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "x hf-quanto-2" in printed and "peak MiB" in printed
    data = json.loads((tmp_path / "memory.json").read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert list(rows) == caches
    assert rows["dynamic"]["held_bytes"] == _bytes(200 + 3)
    assert 0 < rows["one-liner"]["held_bytes"] < rows["dynamic"]["held_bytes"]
    assert rows["none"]["held_bytes"] == 0 and rows["none"]["first_step_s"] != rows["none"]["first_step_s"]  # nan
    assert rows["dynamic"]["peak_x_dynamic"] == 1.0 and rows["hf-quanto-2"]["peak_x_quantized"] == 1.0
    assert rows["dynamic"]["ttft_x_dynamic"] == 1.0
    for r in rows.values():
        assert isinstance(r["peak_bytes"], int) and r["peak_bytes"] >= 0
        assert r["threads"] == 1 and r["prefill_s"] > 0
    if sys.platform.startswith("linux"):
        assert data["meta"]["peak_source"] == "proc"


def test_without_getrusage_the_peak_is_reported_unavailable(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_memory, "peak_source", lambda device: None)
    monkeypatch.setattr(bench_memory, "_spawn", bench_memory.measure)  # in this process, so the patch applies
    rc = main(["bench", "memory", "--model", str(model_dir), "--lengths", "64", "--steps", "2",
               "--caches", "dynamic", "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    captured = capsys.readouterr()
    assert "peak memory is unavailable on this platform" in captured.err and "getrusage" in captured.err
    row = json.loads((tmp_path / "memory.json").read_text())["rows"][0]
    assert row["peak_bytes"] is None and row["peak_source"] == "unavailable"
    assert row["held_bytes"] == _bytes(64 + 2)
    assert " n/a " in captured.out


@LINUX
def test_the_meter_sees_an_allocation_after_its_start():
    # in a fresh process: one that ran other tests may hold freed pages its allocator hands out again without
    # the resident set growing
    script = (
        "import torch\n"
        "from kvpolicy_lab.bench import memory\n"
        "meter = memory.PeakMeter('proc')\n"
        "meter.start()\n"
        "assert meter.reset\n"
        "block = torch.ones(16 * 2**20)\n"  # 64 MiB, touched
        "del block\n"
        "print(meter.peak())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    assert int(out.stdout.split()[-1]) >= 60 * 2**20  # page-granular: a few pages of the level may be freed meanwhile


def test_ratios_against_dynamic_and_quantized():
    def row(name: str, peak: int | None) -> bench_memory.Row:
        return bench_memory.Row("m", "fp32", "cpu", 1, 8, name, peak, 0, 1.0, 0.5, 0.1)

    rows = [row("dynamic", 100), row("hf-quanto-2", 50), row("one-liner", 25), row("other", None)]
    bench_memory.ratios(rows)
    assert [r.peak_x_dynamic for r in rows[:3]] == [1.0, 0.5, 0.25]
    assert [r.peak_x_quantized for r in rows[:3]] == [2.0, 1.0, 0.5]
    assert rows[3].peak_x_dynamic != rows[3].peak_x_dynamic and rows[3].ttft_x_dynamic == 1.0


def test_a_worker_failure_is_reported_not_raised(tmp_path, monkeypatch, capsys):
    def fail(spec):
        raise RuntimeError(f"the worker process for cache {spec['variant']!r} failed")

    monkeypatch.setattr(bench_memory, "_spawn", fail)
    rc = main(["bench", "memory", "--model", "tiny-llama", "--lengths", "8", "--caches", "dynamic",
               "--out", str(tmp_path)])  # fmt: skip
    assert rc == 1
    assert "the worker process for cache 'dynamic' failed" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "./no-such-dir"], "model path './no-such-dir' does not exist"),
        (["--lengths", "0"], "must be a token count from 1 to"),
        (["--caches", "fast"], "not understood"),
        (["--steps", "0"], "integer >= 1"),
        (["--chunk", "0"], "integer >= 1"),
    ],
)
def test_bad_flags_are_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "memory", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_chunked_prefill_mode(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(bench_memory, "_spawn", bench_memory.measure)  # in this process: faster
    rc = main(["bench", "memory", "--model", str(model_dir), "--lengths", "200", "--steps", "2", "--chunk", "64",
               "--caches", "none", "dynamic", "one-liner", "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    data = json.loads((tmp_path / "memory.json").read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert data["meta"]["chunk"] == 64
    assert rows["dynamic"]["chunk"] == rows["one-liner"]["chunk"] == 64 and rows["none"]["chunk"] == 0
    assert rows["dynamic"]["held_bytes"] == _bytes(200 + 2)
    assert 0 < rows["one-liner"]["held_bytes"] < rows["dynamic"]["held_bytes"]
