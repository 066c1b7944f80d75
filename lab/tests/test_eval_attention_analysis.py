"""``kvpolicy analyze attention`` on a tiny random model."""

from __future__ import annotations

import json

import pytest
from lab_fixtures import one_thread  # noqa: F401  (pytest fixtures)

from kvpolicy.cli import main
from kvpolicy.tiny import TinySpec, tiny_model
from kvpolicy_lab.eval.attention_analysis import analyze_attention

pytestmark = pytest.mark.usefixtures("one_thread")


def test_histogram_counts_and_coverage(tmp_path):
    model, tok = tiny_model(TinySpec("llama", layers=2))
    before = model.config._attn_implementation
    res = analyze_attention(model, tok, context=100, queries=5, top_k=4, window=8, out=tmp_path)
    heads = model.config.num_attention_heads
    assert len(res.histogram) == 2
    assert all(sum(layer) == 5 * heads * 4 for layer in res.histogram)
    assert sum(res.density()) == pytest.approx(1.0)
    for v in res.coverage.values():
        assert 0.0 <= v["topk"] <= 1.0 and 0.0 < v["mass"] <= 1.0
    assert model.config._attn_implementation == before  # restored
    assert (tmp_path / "attention_spikes.png").stat().st_size > 0
    saved = json.loads((tmp_path / "attention_spikes.json").read_text())
    assert saved["histogram"] == res.histogram
    assert "| distance |" in res.markdown()


def test_all_keys_kept_means_full_coverage():
    """A window larger than the text keeps every key: coverage is exactly 1."""
    model, tok = tiny_model(TinySpec("llama", layers=1))
    res = analyze_attention(model, tok, context=40, queries=2, top_k=3, window=40)
    for v in res.coverage.values():
        assert v["topk"] == 1.0 and v["mass"] == pytest.approx(1.0)


def test_cli(tmp_path, capsys):
    rc = main(["analyze", "attention", "--model", "tiny-llama", "--context", "64", "--queries", "2", "--out",
               str(tmp_path), "--no-progress"])  # fmt: skip
    assert rc == 0
    assert "high-attention keys kept" in capsys.readouterr().out
    assert main(["analyze", "attention", "--model", "no-such-org/x", "--out", str(tmp_path)]) == 2


def test_hybrid_model_is_analysed_in_its_full_attention_layers():
    """Gemma-3's layout: the sliding layers attend over their window only, so the analysis takes the
    full-attention layers (the ones a cache compresses) and says which; it once crashed at a context
    longer than the window. A model of sliding layers only has nothing to analyse: a clear error."""
    from kvpolicy.errors import ConfigError
    from kvpolicy.tiny import ByteTokenizer, tiny_gemma3

    model, tok = tiny_gemma3(), ByteTokenizer(96)
    res = analyze_attention(model, tok, context=60, queries=3, top_k=4, window=8)
    assert res.layers == [5] and len(res.histogram) == 1
    assert sum(res.histogram[0]) == 3 * 2 * 4  # queries x heads x top_k
    # the far bins are reachable: a full-attention layer sees keys beyond the sliding window of 8
    assert sum(res.histogram[0][4:]) > 0
    assert "Full-attention layers 5" in res.markdown() and "layer 5" in res.markdown()
    with pytest.raises(ConfigError, match="no full-attention layer"):
        analyze_attention(tiny_gemma3(["sliding_attention"] * 6), tok, context=60, queries=2)
