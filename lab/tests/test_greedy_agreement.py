"""The ``greedy`` task: greedy generation compared token by token with the uncompressed cache's."""

from __future__ import annotations

import json

import pytest

from kvpolicy.cli import main
from kvpolicy_lab.eval.tasks import GreedyAgreement, make_task


@pytest.mark.parametrize(
    ("tokens", "reference", "identical", "first"),
    [
        ([1, 2, 3, 4], [1, 2, 3, 4], 1.0, 4),
        ([1, 2, 9, 4], [1, 2, 3, 4], 0.75, 2),
        ([5, 2, 3, 4], [1, 2, 3, 4], 0.75, 0),
        ([1, 2], [1, 2, 3, 4], 0.5, 2),  # stopped early: the divergence is where it stopped
        ([], [], 1.0, 0),
    ],
)
def test_score_tokens(tokens, reference, identical, first):
    got = GreedyAgreement.score_tokens(tokens, reference)
    assert got == {"identical": identical, "first_divergence": float(first)}


def test_the_task_samples_prompts_of_the_context_length():
    from kvpolicy.tiny import ByteTokenizer

    task = make_task("greedy", samples_per_context=2, tokens=7)
    samples = task.samples(ByteTokenizer(96), 50, 0)
    assert [len(s.ids) for s in samples] == [50, 50]
    assert all(s.kind == "generate" and s.against_reference and s.max_new_tokens == 7 for s in samples)


def test_ablate_scores_the_uncompressed_cache_identical_and_compression_below(tmp_path):
    cfg = tmp_path / "g.toml"
    cfg.write_text(
        'models = ["tiny-llama"]\ncontexts = [64]\n[tasks.greedy]\nsamples_per_context = 2\ntokens = 12\n'
        '[[caches]]\nlabel = "uncompressed"\nkind = "dynamic"\n'
        '[[caches]]\nlabel = "none"\naction = "none"\n'
        '[[caches]]\nlabel = "log-2b"\npolicy = "log"\nwindow = 8\ngroup_size = 16\nbits = 2\n'
    )
    assert main(["ablate", "--config", str(cfg), "--out", str(tmp_path / "run")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    got = {(r["cache"], r["metric"]): r["value"] for r in rows if r["task"] == "greedy"}
    for label in ("uncompressed", "none"):
        assert got[(label, "identical")] == 1.0 and got[(label, "first_divergence")] == 12
    assert got[("log-2b", "identical")] < 1.0  # 2-bit on a tiny random model: it diverges
