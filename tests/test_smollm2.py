"""The real reference model: SmolLM2-135M-Instruct (fetched from PyPI into the user cache once)."""

from __future__ import annotations

import pytest

from kvpolicy.eval.models import load_model


@pytest.mark.slow
def test_demo_on_smollm2(capsys):
    from kvpolicy.eval.demo import run_demo

    rows = {r.name: r for r in run_demo(max_new_tokens=24, context_tokens=512, continuation_tokens=64)}
    none, four, two = rows["none (16/32-bit)"], rows["log 4-bit"], rows["log 2-bit"]
    # the uncompressed cache is the reference: zero divergence by construction of the metric
    assert none.kl == 0.0 and none.top1 == 1.0
    assert "CycleError" in none.answer
    # quantization costs fidelity, 2 bits more than 4, and saves bytes, 2 bits more than 4
    assert 0.0 < four.kl < two.kl
    assert two.total_bytes < four.total_bytes < none.total_bytes
    assert none.prompt_tokens >= 2048
    out = capsys.readouterr().out
    assert "MemoryReport" in out and "ms/token" in out and "mean next-token KL" in out


def test_load_model_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "no-such-model"))
    with pytest.raises(FileNotFoundError, match=r"without config\.json"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="non-empty"):
        load_model("  ")
