"""A grid's ``batch``: teacher-forced samples decoded together measure what they measure alone."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lab_fixtures import one_thread  # noqa: F401  (pytest fixtures)

from kvpolicy.errors import ConfigError
from kvpolicy.tiny import random_model, tiny_gemma3
from kvpolicy_lab.eval.grid import cell_id, grid_from_dict
from kvpolicy_lab.eval.measure import BYTES_METRICS, batches, reference, references
from kvpolicy_lab.eval.runner import RESULTS, Runner
from kvpolicy_lab.eval.tasks import Sample

pytestmark = pytest.mark.usefixtures("one_thread")

CACHES = [
    {"kind": "dynamic", "label": "ref"},
    {"label": "log-k3v2-rot", "policy": "log", "window": 4, "key_bits": 3, "value_bits": 2, "group_size": 8,
     "transform": "hadamard"},
    {"label": "tiered-cm", "policy": "log", "window": 2, "transform": "hadamard", "action": "tiered",
     "tiers": [{"bits": 4, "scheme": "codebook", "key_centre": True},
               {"key_bits": 3, "value_bits": 2, "scheme": "codebook", "key_centre": True}],
     "keep": [{"name": "log", "window": 8}]},
    {"label": "sink-k2v2-mse", "policy": "sink", "window": 6, "bits": 2, "group_size": 8, "fit": "mse"},
    {"label": "recent-k4v2", "policy": "recent", "window": 5, "key_bits": 4, "value_bits": 2, "group_size": 16},
    {"kind": "preset", "label": "kivi", "name": "kivi", "residual": 16, "group_size": 16},
    {"kind": "preset", "label": "logquant", "name": "logquant"},
    # hqq's groups span the batch: its cells must run one sample at a time whatever the grid says
    {"kind": "hf-quantized", "label": "hqq-2b", "backend": "hqq", "nbits": 2, "q_group_size": 16,
     "residual_length": 4},
]  # fmt: skip


def _grid(batch):
    return grid_from_dict({"models": ["tiny-llama"], "contexts": [48], "batch": batch, "caches": CACHES,
                           "tasks": {"lm": {"samples_per_context": 5, "tokens": 10}}})  # fmt: skip


def _rows(out):
    return {(r["cache"], r["metric"]): r for r in map(json.loads, (out / RESULTS).read_text().splitlines())}


def test_batched_cells_measure_what_single_samples_do_in_fewer_decode_calls(tmp_path):
    got = {}
    for batch in (1, 3, 5):
        assert Runner(_grid(batch), tmp_path / str(batch), progress=False, log=lambda s: None).run() == 0
        got[batch] = _rows(tmp_path / str(batch))
    one = got[1]
    assert {m for _, m in one} >= {"kl", "delta_nll", "top1", "attn_error", *BYTES_METRICS[:4]}
    # 9 decode steps x 2 layers per forward: 5 samples alone, [0, 1, 2] and [3, 4], or all 5 together
    forwards = {1: 5, 3: 2, 5: 1}
    for batch in (3, 5):
        rows = got[batch]
        assert one.keys() == rows.keys()
        for key, row in one.items():
            assert row["cell"] == rows[key]["cell"]  # batch enters no cell id
            if key[1] in BYTES_METRICS:  # the last sample's row alone: the bytes of one sequence, exactly
                assert rows[key]["value"] == row["value"], (batch, key)
            else:
                assert rows[key]["value"] == pytest.approx(row["value"], rel=1e-5, abs=1e-6), (batch, key)
        for label in ("log-k3v2-rot", "tiered-cm", "sink-k2v2-mse", "recent-k4v2", "kivi", "logquant"):
            assert sum(one[(label, "kl")]["extra"]["attention_paths"].values()) == 5 * 9 * 2
            assert sum(rows[(label, "kl")]["extra"]["attention_paths"].values()) == forwards[batch] * 9 * 2


def _sample(n, prefill):
    return Sample(task="lm", sample_id=f"{n}-{prefill}", kind="teacher_forced", ids=[1] * n, prefill=prefill)


def test_batch_is_checked_and_enters_no_cell_id():
    one, four = _grid(1), _grid(4)
    spec = one.caches[1]
    params = {"samples_per_context": 5, "tokens": 10}
    assert cell_id("tiny-llama", spec, 48, "lm", params, one) == cell_id("tiny-llama", spec, 48, "lm", params, four)
    for bad in (0, -1, 2.5, "4", True):
        with pytest.raises(ConfigError, match=r"batch must be an integer >= 1 .*got batch="):
            _grid(bad)


@given(st.lists(st.tuples(st.integers(3, 5), st.integers(1, 2)), max_size=12), st.integers(1, 4))
def test_batches_keep_order_and_shape_and_are_maximal(shapes, batch):
    samples = [_sample(n, p) for n, p in shapes]
    groups = batches(samples, batch)
    assert [i for g in groups for i in g] == list(range(len(samples)))
    for g in groups:
        assert 1 <= len(g) <= batch
        assert len({(len(samples[i].ids), samples[i].prefill) for i in g}) == 1
    for a, b in itertools.pairwise(groups):
        same = (len(samples[a[0]].ids), samples[a[0]].prefill) == (len(samples[b[0]].ids), samples[b[0]].prefill)
        assert len(a) == batch or not same


def test_batches_never_mix_kinds():
    forced = _sample(6, 3)
    prompt = Sample(task="greedy", sample_id="g", kind="generate", ids=[1] * 6, prefill=6, max_new_tokens=2)
    assert batches([forced, forced, prompt, prompt, forced], 4) == [[0, 1], [2, 3], [4]]


def _texts(vocab, lengths, prefill, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Sample(task="lm", sample_id=str(i), kind="teacher_forced", prefill=prefill,
                   ids=torch.randint(0, vocab, (n,), generator=g).tolist()) for i, n in enumerate(lengths)]  # fmt: skip


@pytest.mark.parametrize("which", ["llama", "gemma3-sliding"])
def test_batched_references_equal_single_ones(which):
    """Prefill keys, values and last logits exactly; the decode steps' logits to float rounding. Gemma's
    sliding-window layers keep no whole prefill (no replay), so its samples decode one at a time."""
    model = random_model("llama") if which == "llama" else tiny_gemma3()
    samples = _texts(model.config.vocab_size, [30, 30, 30, 30, 24, 30], prefill=20)
    samples.append(Sample(task="greedy", sample_id="g", kind="generate", ids=samples[0].ids[:20], prefill=20,
                          max_new_tokens=5, against_reference=True))  # fmt: skip
    alone = [reference(model, s) for s in samples]
    together = references(model, samples, batch=3)
    assert (alone[0].prefill_kv is None) == (which != "llama")
    for a, b in zip(alone, together, strict=True):
        assert torch.equal(a.last_logits, b.last_logits)
        if a.prefill_kv is not None:
            for (ka, va), (kb, vb) in zip(a.prefill_kv, b.prefill_kv, strict=True):
                assert torch.equal(ka, kb) and torch.equal(va, vb)
        if a.logits is None:
            assert b.logits is None and a.tokens == b.tokens and a.tokens  # the greedy sample
        else:
            assert a.logits.shape == b.logits.shape == (len(a.nll), model.config.vocab_size)
            torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(b.nll, a.nll, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="batch must be >= 1"):
        references(model, samples, batch=0)


def test_batched_references_decode_together(monkeypatch):
    """The batch is real: 4 equal texts with batch 4 take one decode call per step, not four."""
    from kvpolicy_lab.eval import measure

    model = random_model("llama")
    calls = []
    original = measure._forward
    monkeypatch.setattr(measure, "_forward", lambda m, ids, cache: calls.append(ids.shape) or original(m, ids, cache))
    references(model, _texts(model.config.vocab_size, [30] * 4, prefill=20), batch=4)
    assert calls == [(1, 20)] * 4 + [(4, 1)] * 9
