"""``kvpolicy analyze rotation``: where the queries look decides whether rotating the keys helps."""

from __future__ import annotations

import json

import pytest
import torch
from lab_fixtures import one_thread  # noqa: F401  (pytest fixtures)

from kvpolicy import registry
from kvpolicy.cli import main
from kvpolicy.errors import ConfigError
from kvpolicy.tiny import TinySpec, tiny_model
from kvpolicy.transforms import Hadamard
from kvpolicy_lab.eval.rotation_analysis import analyze_rotation, capture, layer_rotation

pytestmark = pytest.mark.usefixtures("one_thread")


def _keys_with_wide_channels(n: int = 272, d: int = 64, wide: int = 8, seed: int = 0) -> torch.Tensor:
    """``(1, 1, n, d)`` Gaussian keys whose first ``wide`` channels (8: as many as the analysis calls
    "the widest") span 30x the range of the others."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, 1, n, d, generator=g)
    k[..., :wide] *= 30
    return k


def _queries(on_wide: bool, n_q: int = 16, d: int = 64, wide: int = 8, seed: int = 1) -> torch.Tensor:
    """``(1, 2, n_q, d)`` queries that read only the wide channels, or only the others."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, n_q, d, generator=g) * 0.3
    if on_wide:
        q[..., wide:] = 0
    else:
        q[..., :wide] = 0
    return q


def test_rotation_hurts_when_queries_ignore_the_wide_channels_and_helps_when_they_read_them():
    """The mechanism the analysis measures: per-channel groups confine the wide channels' large errors
    to those channels; rotation spreads them over every channel. Queries that do not read the wide
    channels (Gemma-3) lose by it, queries that read them (SmolLM2) gain."""
    k, had = _keys_with_wide_channels(), Hadamard(0)
    ignore = layer_rotation(0, _queries(on_wide=False), k, 0.125, 256, had, 2, 64)
    read = layer_rotation(0, _queries(on_wide=True), k, 0.125, 256, had, 2, 64)
    assert ignore.wide_share == 0.0 and read.wide_share == pytest.approx(1.0)
    # the keys' own error does not tell the two cases apart: it is the same tensor both times
    assert ignore.key_error == read.key_error
    assert ignore.score_rms[1] > 2 * ignore.score_rms[0] and ignore.attention_kl[1] > ignore.attention_kl[0]
    # (by less: the rotated errors of keys that live near an 8-dimensional subspace stay partly in it)
    assert read.score_rms[1] < 0.9 * read.score_rms[0] and read.attention_kl[1] < read.attention_kl[0]


def test_eight_bit_keys_are_near_exact_in_both_bases_and_bad_head_dims_are_refused():
    k, q = torch.randn(1, 1, 272, 64, generator=torch.Generator().manual_seed(0)), _queries(on_wide=False)
    r = layer_rotation(3, q, k, 0.125, 256, Hadamard(0), 8, 64)
    assert r.layer == 3 and max(r.key_error) < 1e-4 and max(r.attention_kl) < 1e-5
    with pytest.raises(ConfigError, match="head_dim=12"):
        layer_rotation(0, torch.randn(1, 1, 4, 12), torch.randn(1, 1, 68, 12), 0.3, 64, Hadamard(0), 2, 64)


def test_captured_keys_are_the_keys_a_cache_stores_and_the_implementation_is_restored():
    from transformers import DynamicCache

    model, _ = tiny_model(TinySpec("llama", layers=2))
    before = model.config._attn_implementation
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    got = capture(model, ids, queries=5)
    assert model.config._attn_implementation == before
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids, cache=cache, use_cache=True)
    assert sorted(got) == [0, 1]
    for layer, (q, k, scaling) in got.items():
        torch.testing.assert_close(k, cache.layers[layer].keys, rtol=0, atol=0)
        assert q.shape == (1, model.config.num_attention_heads, 5, k.shape[-1])
        assert scaling == pytest.approx(k.shape[-1] ** -0.5)


def test_analyze_rotation_reports_every_full_attention_layer(tmp_path, capsys):
    model, tok = tiny_model(TinySpec("llama", layers=2))
    res = analyze_rotation(model, tok, Hadamard(0), bits=2, group_size=16, context=64, queries=8, name="tiny")
    assert [r.layer for r in res.layers] == [0, 1]
    assert all(min(r.key_error) > 0 and min(r.attention_kl) >= 0 for r in res.layers)
    text = res.markdown()
    assert "| layer | key error | score RMS | attention KL |" in text and res.verdict() in text
    assert f"it lowers it in {res.helped()} of 2 layers" in res.verdict()
    with pytest.raises(ConfigError, match="context=8 holds no whole group of group_size=16"):
        analyze_rotation(model, tok, Hadamard(0), group_size=16, context=8, queries=2)

    # the command: the table on stdout, the same numbers in the JSON
    out = tmp_path / "rot.json"
    assert main(["analyze", "rotation", "--model", "tiny-llama", "--context", "64", "--queries", "8",
                 "--group-size", "16", "--json", str(out)]) == 0  # fmt: skip
    saved = json.loads(out.read_text())
    assert saved["transform"] == "Hadamard(seed=0)" and len(saved["layers"]) == saved["layers"][-1]["layer"] + 1
    assert saved["verdict"].startswith("Hadamard(seed=0) ")
    # the identity changes nothing, and says so
    assert main(["analyze", "rotation", "--model", "tiny-llama", "--context", "64", "--queries", "8",
                 "--group-size", "16", "--transform", "none"]) == 0  # fmt: skip
    assert "NoTransform() leaves the mean attention KL of 2-bit per-channel keys at " in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:  # refused while the command line is parsed
        main(["analyze", "rotation", "--model", "tiny-llama", "--transform", "nope"])
    assert exit_.value.code == 2
    known = ", ".join(sorted(registry.names("transforms")))  # the core's and the installed plugins'
    assert f"unknown transform 'nope'; did you mean 'none'? (one of: {known})" in capsys.readouterr().err
    for fitted in ("query-hadamard", "lowrank"):
        assert main(["analyze", "rotation", "--model", "tiny-llama", "--transform", fitted]) != 0
        assert f"transform {fitted!r} fits something of its own inside the cache's store" in capsys.readouterr().err


def test_hybrid_model_is_analysed_in_its_full_attention_layers():
    from kvpolicy.tiny import ByteTokenizer, tiny_gemma3

    res = analyze_rotation(tiny_gemma3(), ByteTokenizer(96), Hadamard(0), group_size=16, context=48, queries=4)
    assert [r.layer for r in res.layers] == [5]
    with pytest.raises(ConfigError, match="no full-attention layer"):
        analyze_rotation(
            tiny_gemma3(["sliding_attention"] * 6), ByteTokenizer(96), Hadamard(0), group_size=16, context=48
        )
