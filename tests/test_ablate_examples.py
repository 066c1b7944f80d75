"""The ablation scripts of examples/ run (``--smoke``: a tiny random model) so they never rot."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("script", ["logquant_vs_kivi.py", "quantize_vs_evict.py", "bits_sweep.py"])
def test_example_smoke(script, capsys):
    spec = importlib.util.spec_from_file_location(script[:-3], EXAMPLES / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--smoke"])
    out = capsys.readouterr().out
    assert "ΔNLL" in out or "attn err" in out
    if script == "quantize_vs_evict.py":
        ratio = float(out.split("evict / quantize: ")[1].split("x")[0])
        assert ratio > 1.0  # dropping tokens distorts attention more than 2-bit codes of them
    if script == "bits_sweep.py":
        rows = [line.split() for line in out.splitlines() if line[:1].isdigit()]
        errors = [float(r[4]) for r in rows]  # attention error column, bits 2, 4, 8
        assert errors == sorted(errors, reverse=True)
