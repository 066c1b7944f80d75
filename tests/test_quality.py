"""kvpolicy.quality.compare: teacher-forced KL, top-1 and ΔNLL of a cache against DynamicCache."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_gemma3, tiny_model
from transformers import DynamicCache

import kvpolicy
from kvpolicy import CacheSpec, CompressedCache, ConfigError
from kvpolicy.quality import QualityReport, TextQuality, compare
from kvpolicy.tiny import ByteTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT, DECODE = 40, 16
#: 2-bit keys and values past a window of 8, torch backend (no kernel build)
TWO_BIT = {"policy": "log", "window": 8, "bits": 2, "group_size": 16, "backend": "torch"}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def texts(n: int = 3, length: int = PROMPT + DECODE, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (length,), generator=g) for _ in range(n)]


def by_hand(model, ids: torch.Tensor, make_cache) -> torch.Tensor:
    """The ``(DECODE, vocab)`` logits predicting ``ids[PROMPT : PROMPT + DECODE]``: a plain prefill of every
    prompt position (no ``logits_to_keep``), then one token at a time."""
    cache = make_cache()
    ids = ids[None, : PROMPT + DECODE]
    with torch.no_grad():
        out = [model(ids[:, :PROMPT], cache=cache, use_cache=True).logits[0, -1]]
        for t in range(PROMPT, PROMPT + DECODE - 1):
            out.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[0, -1])
    return torch.stack(out).double()


def test_no_compression_is_exactly_the_reference(model):
    report = compare(model, {"action": "none"}, texts(), prompt_tokens=PROMPT, decode_tokens=DECODE)
    for row in report.texts:
        assert (row.kl, row.top1, row.delta_nll, row.tokens) == (0.0, 1.0, 0.0, DECODE)
    assert (report.kl, report.top1, report.delta_nll) == (0.0, 1.0, 0.0)
    assert report.bits_per_element == pytest.approx(16.0)


def test_two_bits_distort_more_than_eight(model):
    data = texts(4)
    two = compare(model, TWO_BIT, data, prompt_tokens=PROMPT, decode_tokens=DECODE)
    eight = compare(model, {**TWO_BIT, "bits": 8}, data, prompt_tokens=PROMPT, decode_tokens=DECODE)
    assert all(row.kl > 0 for row in two.texts)
    assert two.kl > eight.kl > 0
    assert two.kl > eight.kl + 2 * two.kl_se  # not noise
    assert two.bits_per_element < eight.bits_per_element


def test_numbers_equal_a_reference_computed_by_hand(model):
    data = texts(3, length=PROMPT + DECODE + 5)  # later tokens are not used
    report = compare(model, lambda: CompressedCache.for_model(model, **TWO_BIT), data,
                     prompt_tokens=PROMPT, decode_tokens=DECODE)  # fmt: skip
    rows = []
    for ids in data:
        ref = by_hand(model, ids, lambda: DynamicCache(config=model.config))
        got = by_hand(model, ids, lambda: CompressedCache(config=model.config, **TWO_BIT))
        log_p, log_q = F.log_softmax(ref, -1), F.log_softmax(got, -1)
        kl = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)
        target = ids[PROMPT : PROMPT + DECODE]
        delta = F.cross_entropy(got, target, reduction="none") - F.cross_entropy(ref, target, reduction="none")
        top1 = (ref.argmax(-1) == got.argmax(-1)).double()
        rows.append((kl.mean().item(), top1.mean().item(), delta.mean().item()))
    # compare computes the prompt's last logits alone (logits_to_keep=1), by_hand every position's: the lm_head
    # matmuls differ in shape, so their float32 sums round differently, and KL, a small difference of two
    # near-equal sums, carries that to about 1.4e-4 relative (measured)
    for row, (kl, top1, delta) in zip(report.texts, rows, strict=True):
        assert row.kl == pytest.approx(kl, rel=1e-3, abs=1e-9)
        assert row.top1 == top1
        assert row.delta_nll == pytest.approx(delta, rel=1e-4, abs=1e-7)
        assert row.tokens == DECODE
    kls = [r[0] for r in rows]
    assert report.kl == pytest.approx(statistics.fmean(kls), rel=1e-3)
    assert report.kl_se == pytest.approx(statistics.stdev(kls) / math.sqrt(3), rel=1e-2)
    assert report.worst_index == max(range(3), key=kls.__getitem__)


def test_every_form_of_cache_measures_the_same(model):
    data = texts(2)
    kw = dict(prompt_tokens=PROMPT, decode_tokens=DECODE)
    mapping = compare(model, TWO_BIT, data, **kw)
    assert compare(model, CacheSpec.resolve(**TWO_BIT), data, **kw).texts == mapping.texts
    assert compare(model, lambda: CompressedCache.for_model(model, **TWO_BIT), data, **kw).texts == mapping.texts
    assert mapping.cache == repr(CompressedCache.for_model(model, **TWO_BIT))
    long = texts(1, length=208)  # past LogQuant's window of 42 (at most 126 tokens kept)
    preset = compare(model, "logquant", long, prompt_tokens=200, decode_tokens=8)
    assert preset.cache == repr(CompressedCache.for_model(model, "logquant"))
    assert preset.kl > 0
    assert compare(model, CacheSpec.from_preset("logquant"), long, prompt_tokens=200, decode_tokens=8) == preset


def test_strings_are_tokenized_with_the_tokenizer(model):
    tokenizer = ByteTokenizer(96)
    strings = ["The quick brown fox jumps over the lazy dog, again and again, until noon.",
               "Pack my box with five dozen liquor jugs; then pack it once more, please."]  # fmt: skip
    ids = [torch.tensor(tokenizer.encode(s)) for s in strings]
    kw = dict(prompt_tokens=PROMPT, decode_tokens=DECODE)
    assert compare(model, TWO_BIT, strings, tokenizer=tokenizer, **kw) == compare(model, TWO_BIT, ids, **kw)


def test_the_worst_text_is_the_one_with_the_largest_kl():
    rows = (TextQuality(0.1, 0.9, 0.02, 8), TextQuality(0.3, 0.5, 0.01, 8), TextQuality(0.2, 0.99, 0.5, 8))
    report = QualityReport(rows, "cache", 16, 8)
    assert report.worst_index == 1 and report.worst is rows[1]
    assert report.kl == pytest.approx(0.2) and report.kl_se == pytest.approx(0.1 / math.sqrt(3))
    assert report.top1 == pytest.approx((0.9 + 0.5 + 0.99) / 3)
    data = report.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["kl"] == {"mean": report.kl, "se": report.kl_se, "worst": 0.3}
    assert data["worst_index"] == 1 and data["texts"][2] == {"kl": 0.2, "top1": 0.99, "delta_nll": 0.5, "tokens": 8}
    text = str(report)
    assert "worst (text 1)" in text and "50.0%" in text and "± s.e." in text
    assert "a headline number needs >= 5 texts × 256 tokens" in text
    alone = QualityReport(rows[:1], "cache", 16, 8)
    assert math.isnan(alone.kl_se) and alone.to_dict()["kl"]["se"] is None and "± s.e." not in str(alone)


def test_a_report_from_a_real_run_prints(model):
    report = compare(model, TWO_BIT, texts(2), prompt_tokens=PROMPT, decode_tokens=DECODE)
    text = str(report)
    assert text.startswith(f"QualityReport: 2 texts × {DECODE} tokens after {PROMPT}, ")
    assert "bits per element" in text and report.cache in text
    assert f"worst (text {report.worst_index})" in text


def test_sliding_window_model():
    model = tiny_gemma3()
    data = texts(2, length=48)
    kw = dict(prompt_tokens=32, decode_tokens=16)
    none = compare(model, {"action": "none"}, data, **kw)
    assert (none.kl, none.top1, none.delta_nll) == (0.0, 1.0, 0.0)
    two = compare(model, {**TWO_BIT, "window": 4}, data, **kw)
    assert two.kl > 0
    assert "sliding" not in two.cache  # the repr is the cache's; its sliding layers are transformers' own
    # the sliding layers hold what a DynamicCache would: bits per element sit between 2-bit and 16-bit
    assert 2 < two.bits_per_element < 16


def test_model_state_and_attention_are_left_as_they_were(model):
    model.train()
    model.model.layers[0].eval()
    before = {name: m.training for name, m in model.named_modules()}
    implementation = model.config._attn_implementation
    try:
        compare(model, TWO_BIT, texts(1), prompt_tokens=PROMPT, decode_tokens=DECODE)
        assert {name: m.training for name, m in model.named_modules()} == before
        assert model.config._attn_implementation == implementation
    finally:
        model.eval()


def test_fused_attention_is_what_gets_measured(model):
    fused = {**TWO_BIT, "attention": "fused"}  # refuses a decode step that would not run fused
    with kvpolicy.decode_mode(model, "fused"):
        on = compare(model, fused, texts(1), prompt_tokens=PROMPT, decode_tokens=DECODE)
    materialized = compare(model, {**TWO_BIT, "attention": "materialized"}, texts(1), prompt_tokens=PROMPT,
                           decode_tokens=DECODE)  # fmt: skip
    assert on.kl == pytest.approx(materialized.kl, rel=1e-2)
    with pytest.raises((RuntimeError, ConfigError), match="fused"):
        compare(model, fused, texts(1), prompt_tokens=PROMPT, decode_tokens=DECODE)  # not switched on for you


class _NotACache:
    pass


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"texts": []}, r"texts must hold at least one text; got texts=\[\]"),
        ({"texts": "a text"}, r"texts must be a list .*got a str"),
        ({"texts": torch.arange(3, 99)}, r"texts must be a list .*got a Tensor"),
        ({"texts": ["a text"]}, r"texts\[0\] is a string, which needs tokenizer="),
        ({"texts": [torch.arange(3, 50)]}, r"texts\[0\] has 47 tokens; prompt_tokens \+ decode_tokens = 56 are needed"),
        ({"texts": [torch.ones(60)]}, r"texts\[0\] must be a 1-D integer tensor .*float32"),
        ({"texts": [torch.ones(1, 60, dtype=torch.long)]}, r"texts\[0\] must be a 1-D integer .*shape \(1, 60\)"),
        ({"texts": [[5] * 60]}, r"texts\[0\] must be a string or a 1-D tensor of token ids; got a list"),
        ({"texts": [torch.full((60,), 96)]}, r"texts\[0\] holds token id 96, outside the model's vocabulary \[0, 96\)"),
        ({"texts": [torch.full((60,), -1)]}, r"token id -1, outside"),
        ({"prompt_tokens": 0}, r"prompt_tokens must be an integer >= 1; got prompt_tokens=0"),
        ({"prompt_tokens": True}, r"prompt_tokens must be an integer >= 1; got prompt_tokens=True"),
        ({"decode_tokens": -1}, r"decode_tokens must be an integer >= 1; got decode_tokens=-1"),
        ({"decode_tokens": 2.5}, r"decode_tokens must be an integer >= 1; got decode_tokens=2.5"),
        ({"cache": 42}, r"cache must be a preset name, a CacheSpec, .*got a int: 42"),
        ({"cache": DynamicCache()}, r"cache must build a fresh cache for each text; got a DynamicCache instance"),
        ({"cache": _NotACache}, r"the cache callable must return a transformers Cache; it returned a _NotACache"),
        ({"cache": {"bitz": 2}}, r"bitz"),
        ({"cache": {1: 2}}, r"cache mapping's keys must be CompressedCache keywords"),
        ({"cache": "no-such-preset"}, r"no-such-preset"),
    ],
)
def test_bad_input_fails_before_the_model_runs(model, change, match):
    calls = []
    hook = model.register_forward_pre_hook(lambda *_: calls.append(1))
    args = {"cache": TWO_BIT, "texts": texts(1), "prompt_tokens": PROMPT, "decode_tokens": DECODE, **change}
    try:
        with pytest.raises(ConfigError, match=match):
            compare(model, args.pop("cache"), args.pop("texts"), **args)
    finally:
        hook.remove()
    assert calls == []


def test_exported_lazily():
    assert kvpolicy.compare is compare
    assert "compare" in kvpolicy.__all__
