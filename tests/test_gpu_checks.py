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
    spec.loader.exec_module(module)
    return module


SMALL = ["--device", "cpu", "--lengths", "300", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
         "--dtype", "float32", "--steps", "1"]  # fmt: skip


def test_long_decode_check_agrees_and_reports(capsys):
    assert _long_decode().main(SMALL) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.split()[0] == "300" and "fused/dynamic" in line and line.endswith("ok")


def test_long_decode_check_fails_on_a_wrong_fused_result(monkeypatch, capsys):
    module = _long_decode()
    real = module.attend_parts
    monkeypatch.setattr(module, "attend_parts", lambda *a, **k: real(*a, **k) + 1e-2)
    assert module.main(SMALL) == 1
    assert "FAILED (> 0.0001)" in capsys.readouterr().out


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
