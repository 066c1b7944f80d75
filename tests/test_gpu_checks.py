"""scripts/gpu_checks.sh runs on CPU at reduced sizes (Triton's interpreter), so it is tested before a GPU
is lent; scripts/long_decode_check.py fails when fused attention disagrees with dequantize-then-attend."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _long_decode():
    spec = importlib.util.spec_from_file_location("long_decode_check", ROOT / "scripts" / "long_decode_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


SMALL = ["--device", "cpu", "--lengths", "300", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
         "--dtype", "float32", "--steps", "1", "--presets", "one-liner"]  # fmt: skip


def _row(out: str, length: int) -> str:
    return next(line for line in out.splitlines() if line.split()[:1] == [str(length)])


def test_long_decode_check_agrees_and_reports(capsys, tmp_path):
    assert _long_decode().main([*SMALL, "--markdown", str(tmp_path / "t.md")]) == 0
    line = _row(capsys.readouterr().out, 300)
    assert line.split()[1] == "one-liner" and "fused/dynamic" in line and line.endswith("ok")
    table = (tmp_path / "t.md").read_text().splitlines()
    assert table[2].startswith("| preset | tokens | backend | fused ms | dequantized ms | DynamicCache ms |")
    row = table[4].split(" | ")
    assert row[0] == "| one-liner" and row[1] == "300" and table[4].endswith("| ok |")


def test_long_decode_check_fails_on_a_wrong_fused_result(monkeypatch, capsys, tmp_path):
    module = _long_decode()
    real = module.attend_parts
    monkeypatch.setattr(module, "attend_parts", lambda *a, **k: real(*a, **k) + 1e-2)
    assert module.main([*SMALL, "--markdown", str(tmp_path / "t.md")]) == 1
    assert "FAILED: fused vs dequantized" in _row(capsys.readouterr().out, 300)
    assert "| FAILED: fused vs dequantized" in (tmp_path / "t.md").read_text()


def test_long_decode_check_fails_on_a_wrong_kernel(monkeypatch, capsys):
    """A Triton attention kernel off by 1e-2 (here its launcher, under the interpreter) fails the check against
    the torch backend, at the default precision and at float32's."""
    from kvpolicy.kernels import triton_ops

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    real = triton_ops.attend
    monkeypatch.setattr(triton_ops, "attend", lambda *a: tuple(t + 1e-2 for t in real(*a)))
    args = [*SMALL[: SMALL.index("--presets")], "--presets", "kvpolicy-3bit", "--backend", "triton", "--layers", "1"]
    assert _long_decode().main(args) == 1
    line = _row(capsys.readouterr().out, 300)
    assert "triton attend (default) vs torch" in line and "triton attend (ieee) vs torch" in line


def test_bad_arguments_are_refused():
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_checks.sh"), "--gpu"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown argument '--gpu'" in proc.stderr
    with pytest.raises(SystemExit):
        _long_decode().main(["--device", "cpu", "--heads", "6", "--kv-heads", "4"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the reduced CPU run; a GPU runs the full script")
def test_the_script_runs_every_check_on_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_checks.sh"), "--cpu"], capture_output=True,
                          text=True, env=env, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for section in ("== 1. Triton kernels", "== 2. memory benchmark", "== 3. decode", "== 4. device map"):
        assert section in proc.stdout
    assert proc.stdout.strip().endswith("gpu_checks.sh: all checks passed (cpu)")
    rows = json.loads((tmp_path / "memory" / "memory.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["dynamic", "hf-quanto-2", "one-liner"]
    # one row per preset that quantizes, each decoded fused in the Triton kernels and checked
    table = (tmp_path / "presets.md").read_text()
    presets = [line.split(" | ")[0].removeprefix("| ") for line in table.splitlines() if line.startswith("| ")][1:]
    assert presets == _long_decode().default_presets() and "kvpolicy-3bit" in presets and "kivi" in presets
    assert table.count("| triton |") == len(presets) and table.count("| ok |") == len(presets)
