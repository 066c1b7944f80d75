"""kvpolicy_lab.quality.compare: teacher-forced KL, top-1 and ΔNLL of a cache against DynamicCache."""

from __future__ import annotations

import json
import math
import re
import statistics
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from lab_fixtures import one_thread  # noqa: F401  (pytest fixtures)
from transformers import DynamicCache, LlamaConfig

import kvpolicy
from kvpolicy import CacheSpec, CompressedCache, ConfigError
from kvpolicy.tiny import ByteTokenizer, random_model, tiny_gemma3
from kvpolicy_lab.quality import QualityReport, TextQuality, compare, token_percentile

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT, DECODE = 40, 16
#: 2-bit keys and values past a window of 8, torch backend (no kernel build)
TWO_BIT = {"policy": "log", "window": 8, "bits": 2, "group_size": 16, "backend": "torch"}


@pytest.fixture(scope="module")
def model():
    return random_model("llama")


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
    rows, per_token = [], []
    for ids in data:
        ref = by_hand(model, ids, lambda: DynamicCache(config=model.config))
        got = by_hand(model, ids, lambda: CompressedCache(config=model.config, **TWO_BIT))
        log_p, log_q = F.log_softmax(ref, -1), F.log_softmax(got, -1)
        kl = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)
        target = ids[PROMPT : PROMPT + DECODE]
        delta = F.cross_entropy(got, target, reduction="none") - F.cross_entropy(ref, target, reduction="none")
        top1 = (ref.argmax(-1) == got.argmax(-1)).double()
        rows.append((kl.mean().item(), top1.mean().item(), delta.mean().item()))
        per_token.append(kl.double().numpy())
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
    # the tail: each position's KL, and numpy's linear percentiles of all of them pooled; one position's KL carries
    # the same float32 rounding undivided, about 5e-7 nats here (measured), on KLs of about 5e-4
    atol = 2e-6
    for row, kl in zip(report.texts, per_token, strict=True):
        assert np.allclose(row.kl_tokens, kl, rtol=1e-3, atol=atol)
    pooled = np.concatenate(per_token)
    assert report.scored_tokens == len(pooled) == 3 * DECODE
    for got, q in ((report.kl_p99, 0.99), (report.kl_p999, 0.999), (report.kl_max, 1.0)):
        assert got == pytest.approx(np.percentile(pooled, 100 * q, method="linear"), rel=1e-3, abs=atol)


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
    # rows built without their per-token KL have no tail: NaN, None in the dict, and no tail rows printed
    assert data["kl"] == {"mean": report.kl, "se": report.kl_se, "worst": 0.3, "p99": None, "p999": None, "max": None}
    assert data["worst_index"] == 1 and data["texts"][2] == {
        "kl": 0.2,
        "top1": 0.99,
        "delta_nll": 0.5,
        "tokens": 8,
        "kl_p99": None,
        "kl_p999": None,
        "kl_tokens": None,
    }
    assert math.isnan(report.kl_p999) and math.isnan(rows[0].kl_p99)
    text = str(report)
    assert "worst (text 1)" in text and "50.0%" in text and "± s.e." in text and "p99" not in text
    assert "a headline number needs >= 5 texts × 256 tokens" in text
    alone = QualityReport(rows[:1], "cache", 16, 8)
    assert math.isnan(alone.kl_se) and alone.to_dict()["kl"]["se"] is None and "± s.e." not in str(alone)


def test_a_report_from_a_real_run_prints(model):
    report = compare(model, TWO_BIT, texts(2), prompt_tokens=PROMPT, decode_tokens=DECODE)
    text = str(report)
    assert text.startswith(f"QualityReport: 2 texts × {DECODE} tokens after {PROMPT}, ")
    assert "bits per element" in text and report.cache in text
    assert f"worst (text {report.worst_index})" in text
    # each row's per-token KL averages to its KL; the tail is printed, with a word on how few tokens it rests on
    for row in report.texts:
        assert len(row.kl_tokens) == DECODE and statistics.fmean(row.kl_tokens) == pytest.approx(row.kl, rel=1e-9)
    assert re.search(rf"\n  p99.9 of tokens +{report.kl_p999:.4g}\n", text)
    assert (f"percentiles of the per-token KL over all {2 * DECODE} scored tokens; so few that p99 and p99.9 rest "
            f"on the largest two: max {report.kl_max:.4g})") in text  # fmt: skip


# ---------------------------------------------------------------------- the tail
def _type7(values: list[float], q: float) -> float:
    """Hyndman and Fan's type 7 quantile written out: the independent reference for token_percentile."""
    x = sorted(values)
    h = (len(x) - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, len(x) - 1)
    return x[lo] + (h - lo) * (x[hi] - x[lo])


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.floats(0, 50, allow_nan=False), min_size=1, max_size=3000),
       q=st.sampled_from([0.0, 0.5, 0.9, 0.99, 0.999, 1.0]))  # fmt: skip
def test_token_percentile_is_the_linear_interpolation_of_order_statistics(values, q):
    got = token_percentile(values, q)
    assert got == pytest.approx(_type7(values, q), rel=1e-12, abs=1e-12)
    assert got == pytest.approx(float(np.quantile(np.array(values), q, method="linear")), rel=1e-12, abs=1e-12)
    assert min(values) <= got <= max(values)


def test_token_percentile_near_the_top_rests_on_the_largest_two():
    # 1,001 values: (n - 1) q = 999.0 for q = 0.999, the second largest exactly; with one value more it moves below
    values = [float(i) for i in range(1001)]
    assert token_percentile(values, 0.999) == pytest.approx(999.0)
    assert token_percentile([float(i) for i in range(1002)], 0.999) == pytest.approx(999.999)
    assert token_percentile([7.0], 0.999) == 7.0
    with pytest.raises(ConfigError, match=r"q must be a number in \[0, 1\]; got q=99"):
        token_percentile(values, 99)
    with pytest.raises(ConfigError, match="at least one value"):
        token_percentile([], 0.5)


def test_a_row_holds_one_kl_per_scored_token():
    with pytest.raises(ConfigError, match=r"kl_tokens must hold one KL per scored position \(tokens=3\); got 2"):
        TextQuality(0.1, 1.0, 0.0, 3, kl_tokens=(0.1, 0.2))
    with pytest.raises(ConfigError, match=r"kl must be the mean of kl_tokens; got kl=0.5 and a mean of 0.1999"):
        TextQuality(0.5, 1.0, 0.0, 3, kl_tokens=(0.1, 0.2, 0.3))
    assert TextQuality(0.2, 1.0, 0.0, 3, kl_tokens=np.array([0.1, 0.2, 0.3])).kl_tokens == (0.1, 0.2, 0.3)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.floats(0, 20, allow_nan=False), min_size=1, max_size=400), min_size=1, max_size=6))
def test_the_tail_is_ordered_and_pools_every_token(per_text):
    rows = [TextQuality(math.fsum(k) / len(k), 1.0, 0.0, len(k), kl_tokens=k) for k in per_text]
    report = QualityReport(rows, "cache", 4, max(len(k) for k in per_text))
    pooled = np.array([v for k in per_text for v in k])
    assert report.scored_tokens == len(pooled)
    assert report.kl_p99 <= report.kl_p999 <= report.kl_max == pooled.max()
    assert report.kl <= report.worst.kl <= report.kl_max * (1 + 1e-12)
    assert report.kl_p999 == pytest.approx(np.percentile(pooled, 99.9), rel=1e-12, abs=1e-12)
    for row in rows:
        assert row.kl_p99 <= row.kl_p999 <= report.kl_max


class _Marked(DynamicCache):
    """The cache under test of :class:`_KnownKL` (it only marks which distribution the model answers with)."""


class _KnownKL(torch.nn.Module):
    """A stand-in causal LM whose next-token logits depend only on the last input token ``j``: uniform over
    the vocabulary through a ``DynamicCache`` (the reference), and uniform but for logit ``c[j]`` on token 0
    through a :class:`_Marked` cache. The KL of the two is then known in closed form:
    ``KL(u || q) = log((e^c + V - 1) / V) - c / V``."""

    def __init__(self, c: torch.Tensor):
        super().__init__()
        self.c = c.double()
        self.embed = torch.nn.Embedding(len(c), 4)
        self.config = LlamaConfig(vocab_size=len(c), hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                                  num_key_value_heads=1, intermediate_size=8)  # fmt: skip

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, cache=None, use_cache=True, logits_to_keep=0):
        logits = torch.zeros(input_ids.shape[0], 1, len(self.c))
        if isinstance(cache, _Marked):
            logits[:, 0, 0] = self.c[input_ids[:, -1]].float()
        return SimpleNamespace(logits=logits)

    def kl(self, j: torch.Tensor) -> np.ndarray:
        """The closed-form KL after input tokens ``j``, in float64."""
        c, v = self.c[j].numpy(), len(self.c)
        return np.log((np.exp(c) + v - 1) / v) - c / v


def test_tail_percentiles_are_those_of_the_known_token_kls():
    """Three texts whose every scored position has a KL known in closed form: the report's pooled and per-text
    percentiles equal numpy's of those KLs, the mean their mean, the worst text the one with the largest mean."""
    prompt, decode, n = 6, 400, 3
    length = prompt + decode
    g = torch.Generator().manual_seed(0)
    c = torch.distributions.Exponential(torch.tensor(0.6)).sample((n * length,))  # a long right tail
    c[torch.randint(0, n * length, (5,), generator=g)] = 12.0  # and a few tokens far out
    model = _KnownKL(c)
    data = [torch.arange(i * length, (i + 1) * length) for i in range(n)]
    report = compare(model, _Marked, data, prompt_tokens=prompt, decode_tokens=decode)
    # the scored positions of text i follow input tokens prompt - 1 .. length - 2 of that text
    known = [model.kl(ids[prompt - 1 : length - 1]) for ids in data]
    pooled = np.concatenate(known)
    assert report.scored_tokens == n * decode == len(pooled)
    for row, kl in zip(report.texts, known, strict=True):
        # compare works in float32: over a vocabulary of 1,218 the log-partition's rounding is about 5e-7
        assert np.allclose(row.kl_tokens, kl, rtol=1e-4, atol=5e-6)
        assert row.kl == pytest.approx(kl.mean(), rel=1e-4)
        assert row.kl_p99 == pytest.approx(np.quantile(kl, 0.99), rel=1e-4)
        assert row.kl_p999 == pytest.approx(np.quantile(kl, 0.999), rel=1e-4)
    assert report.kl_p99 == pytest.approx(np.quantile(pooled, 0.99), rel=1e-4)
    assert report.kl_p999 == pytest.approx(np.quantile(pooled, 0.999), rel=1e-4)
    assert report.kl_max == pytest.approx(pooled.max(), rel=1e-4)
    assert report.kl == pytest.approx(statistics.fmean(k.mean() for k in known), rel=1e-4)
    assert report.worst_index == int(np.argmax([k.mean() for k in known]))
    assert report.kl < report.kl_p99 < report.kl_p999 <= report.kl_max  # the tail sits far above the mean
    # the same figures in the dict (per text and pooled), through JSON and back
    data_out = report.to_dict()
    assert json.loads(json.dumps(data_out)) == data_out
    assert (data_out["kl"]["p99"], data_out["kl"]["p999"], data_out["kl"]["max"]) == (
        report.kl_p99, report.kl_p999, report.kl_max)  # fmt: skip
    assert data_out["scored_tokens"] == n * decode
    assert [t["kl_p999"] for t in data_out["texts"]] == [t.kl_p999 for t in report.texts]
    assert data_out["texts"][1]["kl_tokens"] == list(report.texts[1].kl_tokens)
    # 1,200 tokens: p99.9 interpolates below the largest two, and the report does not warn
    text = str(report)
    assert re.search(rf"\n  p99 of tokens +{report.kl_p99:.4g}\n  p99.9 of tokens +{report.kl_p999:.4g}\n", text)
    assert "over all 1200 scored tokens)" in text and "largest two" not in text


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
    import kvpolicy_lab

    assert kvpolicy_lab.compare is compare
    assert "compare" in kvpolicy_lab.__all__ and "compare" not in kvpolicy.__all__
