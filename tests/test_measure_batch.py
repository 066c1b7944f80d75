"""A grid's ``batch``: teacher-forced samples decoded together measure what they measure alone."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpolicy.errors import ConfigError
from kvpolicy.eval.grid import cell_id, grid_from_dict
from kvpolicy.eval.measure import BYTES_METRICS, batches
from kvpolicy.eval.runner import RESULTS, Runner
from kvpolicy.eval.tasks import Sample

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
    for batch in (1, 3):
        assert Runner(_grid(batch), tmp_path / str(batch), progress=False, log=lambda s: None).run() == 0
        got[batch] = _rows(tmp_path / str(batch))
    one, three = got[1], got[3]
    assert one.keys() == three.keys()
    assert {m for _, m in one} >= {"kl", "delta_nll", "top1", "attn_error", *BYTES_METRICS[:4]}
    for key, row in one.items():
        assert row["cell"] == three[key]["cell"]  # batch enters no cell id
        if key[1] in BYTES_METRICS:  # the last sample runs alone: the bytes of one sequence
            assert three[key]["value"] == row["value"], key
        else:
            assert three[key]["value"] == pytest.approx(row["value"], rel=1e-5, abs=1e-6), key
    for label in ("log-k3v2-rot", "tiered-cm", "sink-k2v2-mse"):
        # 9 decode steps x 2 layers per forward: 5 samples alone, or [0, 1, 2], [3], [4]
        assert sum(one[(label, "kl")]["extra"]["attention_paths"].values()) == 5 * 9 * 2
        assert sum(three[(label, "kl")]["extra"]["attention_paths"].values()) == 3 * 9 * 2


def _sample(n, prefill):
    return Sample(task="lm", sample_id=f"{n}-{prefill}", kind="teacher_forced", ids=[1] * n, prefill=prefill)


@given(st.lists(st.tuples(st.integers(3, 5), st.integers(1, 2)), max_size=12), st.integers(1, 4))
def test_batches_keep_order_and_shape_and_leave_the_last_sample_alone(shapes, batch):
    samples = [_sample(n, p) for n, p in shapes]
    groups = batches(samples, batch)
    assert [i for g in groups for i in g] == list(range(len(samples)))
    for g in groups:
        assert 1 <= len(g) <= batch
        assert len({(len(samples[i].ids), samples[i].prefill) for i in g}) == 1
    if samples:
        assert groups[-1] == [len(samples) - 1]
    # maximal: a group is cut only by a full batch, a change of shape, or the last sample
    for a, b in itertools.pairwise(groups[:-1]):
        same = (len(samples[a[0]].ids), samples[a[0]].prefill) == (len(samples[b[0]].ids), samples[b[0]].prefill)
        assert len(a) == batch or not same


def test_batch_is_checked_and_enters_no_cell_id():
    one, four = _grid(1), _grid(4)
    spec = one.caches[1]
    params = {"samples_per_context": 5, "tokens": 10}
    assert cell_id("tiny-llama", spec, 48, "lm", params, one) == cell_id("tiny-llama", spec, 48, "lm", params, four)
    for bad in (0, -1, 2.5, "4", True):
        with pytest.raises(ConfigError, match=r"batch must be an integer >= 1 .*got batch="):
            _grid(bad)
