"""Attention statistics over calibration texts (kvpolicy_research.calibration): what the pass measures, the
file it writes, and the refusal of any file that is not this model's statistics."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from kvpolicy_research import calibration
from kvpolicy_research.calibrated import CalibratedRotation
from research_cases import tiny_model
from research_parts import research_parts  # noqa: F401 - fixtures, and the plugin's parts registered


@pytest.fixture(scope="module")
def measured():
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(0))
    want = model(input_ids=ids, use_cache=False).logits
    return model, ids, want, calibration.measure(model, [ids])


def _eager_qkv(model, ids):
    """Each layer's post-RoPE queries, keys and values, recorded from the model's own eager attention."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen = {}

    def record(module, query, key, value, attention_mask, **kw):
        seen[module.layer_idx] = (query.double(), key.double(), value.double())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("test_record", record)
    before = model.config._attn_implementation
    model.set_attn_implementation("test_record")
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        model.set_attn_implementation(before)
    return seen


def test_the_pass_measures_the_second_moments_and_leaves_the_model_as_it_was(measured):
    model, ids, want, stats = measured
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(model(input_ids=ids, use_cache=False).logits, want)
    heads = model.config.num_key_value_heads
    for layer, (q, k, v) in _eager_qkv(model, ids).items():
        b, hq, n, d = q.shape
        group = hq // heads
        qr = q.reshape(b, heads, group * n, d)
        torch.testing.assert_close(
            stats.query_moment[layer].double(), (qr.mT @ qr).sum(0) / (b * group * n), rtol=1e-4, atol=1e-5
        )
        kf = k.permute(1, 0, 2, 3).reshape(heads, b * n, d)
        cov = torch.stack([torch.cov(kf[h].T, correction=0) for h in range(heads)])
        torch.testing.assert_close(stats.key_covariance[layer].double(), cov, rtol=1e-4, atol=1e-5)
        # values weighted by the attention they receive (causal softmax, summed over queries and query heads)
        scores = q @ k.repeat_interleave(group, 1).mT * d**-0.5
        probs = torch.softmax(scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")), -1)
        a = probs.reshape(b, heads, group, n, n).sum(dim=(2, 3))
        vm = (v.mT @ (a.unsqueeze(-1) * v)).sum(0) / a.sum(dim=(0, 2))[:, None, None]
        torch.testing.assert_close(stats.value_moment[layer].double(), vm, rtol=1e-4, atol=1e-5)
    assert stats.tokens == ids.numel()


def test_a_saved_file_loads_as_it_was_and_gives_the_rotations(measured, tmp_path):
    model, _, _, stats = measured
    path = calibration.save(stats, tmp_path / "smol.stats.safetensors")
    back = calibration.load(path, model.config)
    for name in ("query_moment", "key_covariance", "value_moment"):
        assert torch.equal(getattr(back, name), getattr(stats, name))
    assert back.model == stats.model and back.tokens == stats.tokens
    u, w, v = back.rotations(CalibratedRotation())
    layers, heads, d = 2, model.config.num_key_value_heads, 64
    assert u.shape == v.shape == (layers, heads, d, d) and w.shape == (layers, heads, 1, d)


def test_a_file_of_another_model_is_refused_naming_it(measured, tmp_path):
    _, _, _, stats = measured
    path = calibration.save(stats, tmp_path / "llama.stats.safetensors")
    other = tiny_model("qwen2").config
    with pytest.raises(ValueError, match=rf"{path.name}.*another model.*model_type 'llama'"):
        calibration.load(path, other)
    deeper = tiny_model("llama", layers=3).config
    with pytest.raises(ValueError, match=r"another model \(num_hidden_layers 2"):
        calibration.load(path, deeper)


def _rewrite(path, out, edit_header):
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + size])
    edit_header(header)
    text = json.dumps(header).encode()
    out.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + size :])
    return out


def _shape(header):
    header["query_moment"]["shape"] = [2, 2, 32, 128]


def _identity(header):
    model = json.loads(header["__metadata__"]["model"])
    model["head_dim"] = 32
    header["__metadata__"]["model"] = json.dumps(model)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_shape, r"query_moment must be F32 of shape \[2, 2, 64, 64\]"),
        (_identity, r"another model \(head_dim 32"),
        (lambda h: h["__metadata__"].update(format="something"), "not a kvpolicy-research attention statistics"),
        (lambda h: h["__metadata__"].pop("model"), "does not name the model"),
        (lambda h: h["key_covariance"].update(dtype="F16"), "key_covariance must be F32"),
        (lambda h: h.update(extra=h["value_moment"]), "unexpected tensors"),
    ],
    ids=["shape", "identity", "format", "no-model", "dtype", "extra"],
)
def test_a_tampered_header_is_refused_before_a_tensor_is_read(measured, tmp_path, edit, match):
    model, _, _, stats = measured
    path = calibration.save(stats, tmp_path / "s.safetensors")
    bad = _rewrite(path, tmp_path / "bad.safetensors", edit)
    with pytest.raises(ValueError, match=match):
        calibration.load(bad, model.config)


@pytest.mark.parametrize(
    "content",
    [b"", b"\x00" * 4, struct.pack("<Q", 1 << 40) + b"{}", struct.pack("<Q", 10) + b"{", b"PK\x03\x04pickle"],
    ids=["empty", "short", "huge-header", "cut", "not-safetensors"],
)
def test_a_file_that_is_not_safetensors_is_refused_naming_it(measured, tmp_path, content):
    model = measured[0]
    path = tmp_path / "junk.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"junk\.safetensors"):
        calibration.load(path, model.config)


def test_non_finite_or_asymmetric_moments_are_refused(measured, tmp_path):
    model, _, _, stats = measured
    edits = (
        ("non-finite", lambda t: t.index_fill_(0, torch.tensor([1]), float("nan"))),
        ("not symmetric", lambda t: t.add_(torch.triu(torch.ones_like(t), 1))),
    )
    for what, edit in edits:
        moment = edit(stats.value_moment.clone())
        broken = calibration.Statistics(stats.query_moment, stats.key_covariance, moment, stats.model, stats.tokens)
        path = calibration.save(broken, tmp_path / f"{what}.safetensors")
        with pytest.raises(ValueError, match=f"value_moment.*{what}"):
            calibration.load(path, model.config)
