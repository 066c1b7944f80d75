"""SnapKV policy without a model: the kvpolicy contract, a brute-force reference, worked examples."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kvpolicy_snapkv import SnapKV

from kvpolicy.errors import ConfigError
from kvpolicy.testing import check_policy, run_policy

snapkvs = st.builds(
    SnapKV,
    capacity=st.integers(0, 8),
    window=st.integers(1, 6),
    kernel_size=st.sampled_from([1, 3, 5]),
    pooling=st.sampled_from(["avg", "max"]),
    recent=st.one_of(st.none(), st.integers(1, 6)),
)


def bound(policy: SnapKV, length: int, prompt: int) -> int:
    generated = length - prompt
    kept = min(prompt, policy.capacity + policy.window)
    return kept + (generated if policy.recent is None else min(generated, policy.recent))


def test_contract():
    check_policy(snapkvs, max_full=bound, max_length=60)


# --------------------------------------------------------------------------------------------------
# brute-force reference, written from the paper's description
# --------------------------------------------------------------------------------------------------


def reference_prompt_selection(scores: list[float], prompt: int, policy: SnapKV) -> list[int]:
    """One head: the prompt positions kept, from per-position attention mass ``scores``."""
    if prompt <= policy.capacity + policy.window:
        return list(range(prompt))
    prefix = prompt - policy.window
    half = policy.kernel_size // 2
    pooled = []
    for i in range(prefix):
        near = [scores[j] for j in range(i - half, i + half + 1) if 0 <= j < prefix]
        # avg: padding zeros count (sum / kernel_size); sum order is the same, so compare sums exactly
        pooled.append(sum(near) if policy.pooling == "avg" else max(near))
    best = sorted(range(prefix), key=lambda i: (-pooled[i], i))[: policy.capacity]
    return sorted(best) + list(range(prefix, prompt))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=snapkvs, prompt=st.integers(1, 40), heads=st.integers(1, 3), seed=st.integers(0, 2**16))
@example(policy=SnapKV(capacity=2, window=2, kernel_size=3), prompt=12, heads=2, seed=0)
@example(policy=SnapKV(capacity=0, window=1, kernel_size=1), prompt=5, heads=1, seed=1)
def test_prompt_selection_equals_brute_force(policy, prompt, heads, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 9, (heads, prompt), generator=g).float() / 4  # exact sums, many ties
    state = policy.new_state(num_heads=heads)
    state.observe(scores, torch.arange(prompt).view(1, -1))
    demoted = state.append(prompt)
    full = state.full_positions()
    for h in range(heads):
        expected = reference_prompt_selection(scores[h].tolist(), prompt, policy)
        assert full[h].tolist() == expected
        assert sorted(demoted[h].tolist()) == sorted(set(range(prompt)) - set(expected))


@settings(max_examples=40, deadline=None)
@given(policy=snapkvs, prompt=st.integers(1, 30), decode=st.integers(0, 30))
def test_generated_tokens_kept_or_recent_window(policy, prompt, decode):
    steps = run_policy(policy, [prompt, *[1] * decode], heads=2, seed=1)
    prompt_kept = set(steps[0].full[0])
    for step in steps[1:]:
        generated = list(range(prompt, step.length))
        if policy.recent is not None:
            generated = generated[-policy.recent :]
        for row, first in zip(step.full, steps[0].full, strict=True):
            assert list(row) == [*first, *generated]  # the prompt selection never changes afterwards
    assert prompt_kept <= set(range(prompt))


# --------------------------------------------------------------------------------------------------
# examples
# --------------------------------------------------------------------------------------------------


def test_pooling_brings_the_neighbours_of_a_spike():
    """Prefix of 10, one spike at 5: with kernel 3 the neighbours 4 and 6 beat a lone smaller score."""
    scores = torch.zeros(1, 12)
    scores[0, 5] = 8.0
    scores[0, 1] = 3.0
    plain = SnapKV(capacity=3, window=2, kernel_size=1).new_state()
    plain.observe(scores, torch.arange(12).view(1, -1))
    plain.append(12)
    assert plain.full_positions().tolist() == [[0, 1, 5, 10, 11]]  # 0 wins the zero ties (earliest)
    pooled = SnapKV(capacity=3, window=2, kernel_size=3).new_state()
    pooled.observe(scores, torch.arange(12).view(1, -1))
    pooled.append(12)
    assert pooled.full_positions().tolist() == [[4, 5, 6, 10, 11]]


def test_heads_select_independently_with_equal_counts():
    scores = torch.tensor([[9.0, 8, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 8, 9, 0, 0]])
    state = SnapKV(capacity=2, window=2, kernel_size=1).new_state(num_heads=2)
    state.observe(scores, torch.arange(8).view(1, -1))
    demoted = state.append(8)
    assert state.full_positions().tolist() == [[0, 1, 6, 7], [4, 5, 6, 7]]
    assert demoted.tolist() == [[2, 3, 4, 5], [0, 1, 2, 3]]


def test_short_prompt_is_kept_whole_without_scores():
    state = SnapKV(capacity=4, window=2).new_state(num_heads=2)
    assert state.append(6).shape == (2, 0)
    assert state.full_positions().tolist() == [list(range(6))] * 2


def test_long_prompt_without_scores_raises():
    state = SnapKV(capacity=2, window=2).new_state()
    with pytest.raises(RuntimeError, match="enable_scores"):
        state.append(5)


def test_observe_for_wrong_positions_raises():
    state = SnapKV(capacity=2, window=2).new_state(num_heads=2)
    with pytest.raises(RuntimeError, match="positions"):
        state.observe(torch.ones(2, 3), torch.tensor([[1, 2, 3]]))


def test_score_queries_is_the_window():
    assert SnapKV(window=7).score_queries == 7
    assert SnapKV.per_head and SnapKV.needs_scores and SnapKV.name == "snapkv"


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(capacity=-1), "capacity=-1"),
        (dict(window=0), "window=0"),
        (dict(kernel_size=4), "kernel_size=4"),
        (dict(kernel_size=0), "kernel_size=0"),
        (dict(pooling="median"), "pooling='median'"),
        (dict(recent=0), "recent=0"),
        (dict(capacity=2.0), "capacity=2.0"),
    ],
)
def test_invalid_parameters(kwargs, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        SnapKV(**kwargs)
