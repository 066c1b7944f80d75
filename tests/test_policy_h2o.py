"""Property and example tests of the H2O heavy-hitter policy (policies-spec.md (d)), without a model.

The state is driven exactly as :class:`kvpolicy.cache.CompressedLayer` drives it:

- prefill (a multi-token first forward of ``L`` tokens): ``observe(colsums, positions [0, L))``
  first (the positions are not appended yet), then ``append(L)`` at the start of the next step;
- decode step ``t``: ``append(1)`` before attention, then ``observe(scores, FP)`` with the
  attention the query at ``t`` gave to each held position.

The reference is an independent brute-force state machine written from the spec text: per head a
dict ``position -> accumulated score``; a new token enters with score 0 and gets the attention it
receives in its own step; when more than ``heavy + recent`` are held, the newest ``recent`` stay and
among the rest the ``heavy`` highest scores stay (ties: the earlier position), the others are
dropped with their scores.

Scores are multiples of 1/4 so that float32 sums are exact and ties are real ties.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvpolicy.errors import ConfigError
from kvpolicy.policies.base import PolicyState
from kvpolicy.policies.h2o import HeavyHitters
from kvpolicy.testing import check_policy

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_T = 60


# --------------------------------------------------------------------------------------------------
# constructed attention, reference and driver
# --------------------------------------------------------------------------------------------------


def attention_matrix(heads: int, length: int, seed: int, mode: str) -> torch.Tensor:
    """``A[h, q, p]``: the (nonnegative, exactly representable) attention query ``q`` gives key ``p``.

    ``mode``: ``"random"`` (values in {0, .25, .5, .75, 1}: many ties), ``"equal"`` (all 1),
    ``"zero"`` (all 0: everything ties), ``"sparse"`` (mostly 0, a few large spikes).
    """
    g = torch.Generator().manual_seed(seed)
    if mode == "random":
        a = torch.randint(0, 5, (heads, length, length), generator=g).float() / 4
    elif mode == "equal":
        a = torch.ones(heads, length, length)
    elif mode == "zero":
        a = torch.zeros(heads, length, length)
    else:
        a = (torch.rand(heads, length, length, generator=g) < 0.1).float() * torch.randint(
            1, 9, (heads, length, length), generator=g
        ).float()
    return a.tril()  # causal: query q never sees p > q


def reference(heavy: int, recent: int, a: torch.Tensor, prefill: int) -> list[list[list[int]]]:
    """Brute-force H2O. Returns ``fps[i][h]``: FP of head ``h`` after the ``i``-th append."""
    heads, length, _ = a.shape
    budget = heavy + recent
    rows = a.tolist()

    def select(held: dict[int, float]) -> dict[int, float]:
        if len(held) <= budget:
            return held
        order = sorted(held)
        newest = order[len(order) - recent :] if recent else []
        rest = order[: len(order) - recent]
        best = sorted(rest, key=lambda p: (-held[p], p))[:heavy]
        return {p: held[p] for p in sorted(best + newest)}

    fps: list[list[list[int]]] = []
    per_head: list[dict[int, float]] = [{} for _ in range(heads)]
    start = 0
    if prefill >= 2:
        for h in range(heads):
            colsum = {p: sum(rows[h][q][p] for q in range(prefill)) for p in range(prefill)}
            per_head[h] = select(colsum)
        fps.append([sorted(held) for held in per_head])
        start = prefill
    for t in range(start, length):
        for h in range(heads):
            held = dict(per_head[h])
            held[t] = 0.0
            held = select(held)
            for p in held:  # the query at t attends over what is held after the append
                held[p] += rows[h][t][p]
            per_head[h] = held
        fps.append([sorted(held) for held in per_head])
    return fps


def drive(
    heavy: int, recent: int, a: torch.Tensor, prefill: int, checks: bool = True
) -> tuple[list[list[list[int]]], list[int]]:
    """Drive ``HeavyHitters`` like the cache does. Returns FP per append (per head) and the lengths.

    With ``checks``, asserts the per-step contract: shapes and dtypes, same count in every head,
    ``full_count_after`` (vs. the base-class replay), and that the demoted positions are exactly
    what left the held set.
    """
    heads, length, _ = a.shape
    state = HeavyHitters(heavy=heavy, recent=recent).new_state(num_heads=heads)
    fps: list[list[list[int]]] = []
    lengths: list[int] = []

    def do_append(n: int) -> None:
        before = state.full_positions()
        if checks:
            predicted = state.full_count_after(n)
            assert predicted == PolicyState.full_count_after(state, n)
        demoted = state.append(n)
        after = state.full_positions()
        if checks:
            assert isinstance(demoted, torch.Tensor) and demoted.dtype == torch.int64
            assert isinstance(after, torch.Tensor) and after.dtype == torch.int64
            assert demoted.shape[0] == heads and after.shape[0] == heads
            assert after.shape[1] == predicted
            assert torch.equal(after, torch.sort(after, dim=1).values)
            new = list(range(state.length - n, state.length))
            for h in range(heads):
                candidates = set(before[h].tolist()) | set(new)
                assert sorted(demoted[h].tolist()) == sorted(candidates - set(after[h].tolist()))
                assert len(set(demoted[h].tolist())) == demoted.shape[1]
        fps.append([row.tolist() for row in after])
        lengths.append(state.length)

    start = 0
    if prefill >= 2:
        colsum = a[:, :prefill, :prefill].sum(dim=1)
        state.observe(colsum, torch.arange(prefill).view(1, -1))
        assert state.full_positions().shape == (heads, 0)  # nothing appended yet
        do_append(prefill)
        start = prefill
    for t in range(start, length):
        do_append(1)
        fp = state.full_positions()
        state.observe(a[:, t].gather(1, fp), fp)
    return fps, lengths


@st.composite
def configs(draw):
    heavy = draw(st.integers(0, 8))
    recent = draw(st.integers(1 if heavy == 0 else 0, 8))
    heads = draw(st.integers(1, 4))
    length = draw(st.integers(1, MAX_T))
    prefill = draw(st.one_of(st.just(0), st.integers(2, max(2, length))))
    prefill = prefill if prefill <= length else 0
    mode = draw(st.sampled_from(["random", "random", "equal", "zero", "sparse"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return heavy, recent, heads, length, prefill, mode, seed


# --------------------------------------------------------------------------------------------------
# properties
# --------------------------------------------------------------------------------------------------


@SETTINGS
@given(configs())
@example((2, 2, 2, 40, 0, "zero", 0))
@example((3, 0, 3, 30, 12, "equal", 0))
@example((0, 5, 1, 30, 0, "random", 1))
@example((8, 8, 4, MAX_T, MAX_T, "sparse", 2))
def test_invariants(cfg):
    heavy, recent, heads, length, prefill, mode, seed = cfg
    a = attention_matrix(heads, length, seed, mode)
    fps, lengths = drive(heavy, recent, a, prefill)
    previous: list[set[int]] | None = None
    prev_len = 0
    for fp, t in zip(fps, lengths, strict=True):
        for h in range(heads):
            # |FP| = min(T, heavy + recent), the same in every head
            assert len(fp[h]) == min(t, heavy + recent)
            assert all(0 <= p < t for p in fp[h])
            # the newest `recent` positions are always held
            assert set(range(max(0, t - recent), t)) <= set(fp[h])
            # monotone: nothing demoted comes back
            if previous is not None:
                assert set(fp[h]) <= previous[h] | set(range(prev_len, t))
        previous = [set(row) for row in fp]
        prev_len = t
    assert lengths[-1] == length


@SETTINGS
@given(configs())
@example((2, 1, 1, 12, 0, "zero", 0))
@example((2, 1, 2, 12, 0, "equal", 0))
@example((4, 4, 2, 20, 10, "equal", 0))
@example((1, 0, 1, 20, 0, "random", 3))
def test_equals_brute_force_reference(cfg):
    heavy, recent, heads, length, prefill, mode, seed = cfg
    a = attention_matrix(heads, length, seed, mode)
    got, _ = drive(heavy, recent, a, prefill, checks=False)
    assert got == reference(heavy, recent, a, prefill)


# --------------------------------------------------------------------------------------------------
# examples
# --------------------------------------------------------------------------------------------------


def test_all_zero_scores_keep_earliest():
    """Every score ties: the earliest positions win the heavy slots."""
    fps, _ = drive(2, 1, torch.zeros(1, 10, 10), prefill=0)
    assert fps[-1] == [[0, 1, 9]]
    fps, _ = drive(3, 2, torch.zeros(2, 8, 8), prefill=8)
    assert fps[0] == [[0, 1, 2, 6, 7], [0, 1, 2, 6, 7]]


def test_tie_between_two_candidates_earlier_wins():
    state = HeavyHitters(heavy=1, recent=1).new_state(num_heads=1)
    state.observe(torch.tensor([[0.0, 2.0, 1.0, 2.0, 0.5]]), torch.arange(5).view(1, -1))
    demoted = state.append(5)
    assert state.full_positions().tolist() == [[1, 4]]
    assert demoted.tolist() == [[0, 2, 3]]


def test_heads_select_independently_with_equal_counts():
    """Head 0 prefers early tokens, head 1 late ones (outside the recent window)."""
    scores = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0, 0.0, 0.0]])
    state = HeavyHitters(heavy=2, recent=2).new_state(num_heads=2)
    state.observe(scores, torch.arange(7).view(1, -1))
    state.append(7)
    assert state.full_positions().tolist() == [[0, 1, 5, 6], [3, 4, 5, 6]]


def test_prefill_selects_top_column_sums():
    """``observe`` for [0, L) before ``append(L)``: top-``heavy`` column sums below ``L - recent`` + last ``recent``."""
    heavy, recent, length = 3, 2, 12
    g = torch.Generator().manual_seed(0)
    causal = torch.ones(length, length, dtype=torch.bool).triu(1)
    logits = torch.randn(2, length, length, generator=g).masked_fill(causal, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    colsum = probs.sum(dim=1)  # (heads, L)
    state = HeavyHitters(heavy=heavy, recent=recent).new_state(num_heads=2)
    state.observe(colsum, torch.arange(length).view(1, -1))
    assert state.length == 0
    demoted = state.append(length)
    fp = state.full_positions()
    for h in range(2):
        top = torch.topk(colsum[h, : length - recent], heavy).indices.tolist()
        expected = sorted(top) + list(range(length - recent, length))
        assert fp[h].tolist() == expected
        assert sorted(demoted[h].tolist()) == sorted(set(range(length)) - set(expected))


def test_prefill_without_scores_keeps_earliest_and_new_token_enters_with_zero():
    """An ``append`` with nothing pending gives the new tokens score 0."""
    state = HeavyHitters(heavy=2, recent=0).new_state(num_heads=1)
    state.append(2)
    state.observe(torch.tensor([[0.0, 1.0]]), torch.tensor([[0, 1]]))
    state.append(1)  # position 2 enters with score 0 < 1 (position 1) and ties position 0 -> 0 wins
    assert state.full_positions().tolist() == [[0, 1]]


def test_demoted_scores_are_dropped():
    """A demoted token's score is gone; a later token is compared only with what is held."""
    state = HeavyHitters(heavy=1, recent=1).new_state(num_heads=1)
    state.append(1)
    state.observe(torch.tensor([[10.0]]), torch.tensor([[0]]))
    state.append(1)
    state.observe(torch.tensor([[0.0, 1.0]]), torch.tensor([[0, 1]]))
    state.append(1)  # 0 (10) beats 1 (1)
    assert state.full_positions().tolist() == [[0, 2]]
    assert state.acc.tolist() == [[10.0, 0.0]]


# --------------------------------------------------------------------------------------------------
# validation and misuse
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        (dict(heavy=-1, recent=4), ("heavy", "-1")),
        (dict(heavy=4, recent=-1), ("recent", "-1")),
        (dict(heavy=0, recent=0), ("heavy", "recent", "0")),
        (dict(heavy=2.5, recent=4), ("heavy", "2.5")),
        (dict(heavy=4, recent=True), ("recent", "True")),
    ],
)
def test_invalid_parameters(kwargs, needles):
    with pytest.raises(ConfigError) as info:
        HeavyHitters(**kwargs)
    for needle in needles:
        assert needle in str(info.value)


def test_invalid_parameters_through_the_cache():
    from kvpolicy import CompressedCache

    with pytest.raises(ConfigError, match="heavy"):
        CompressedCache(policy="h2o", heavy=-1, recent=4, action="evict")


def test_observe_with_mismatched_positions_raises():
    state = HeavyHitters(heavy=1, recent=1).new_state(num_heads=2)
    state.append(3)
    assert state.full_positions().tolist() == [[0, 2], [0, 2]]
    with pytest.raises(RuntimeError):  # a held position replaced by another
        state.observe(torch.ones(2, 2), torch.tensor([[0, 1]]))
    with pytest.raises(RuntimeError):  # held positions in the wrong order
        state.observe(torch.ones(2, 2), torch.tensor([[2, 0]]))
    with pytest.raises(RuntimeError):  # a held position missing
        state.observe(torch.ones(2, 1), torch.tensor([[0]]))
    state.observe(torch.ones(2, 2), torch.tensor([[0, 2]]))  # the held ones are accepted


def test_observe_with_unknown_extra_positions_raises():
    state = HeavyHitters(heavy=4, recent=4).new_state(num_heads=1)
    state.append(3)
    with pytest.raises(RuntimeError):  # 4 is not the next position (3 is)
        state.observe(torch.ones(1, 4), torch.tensor([[0, 1, 2, 4]]))


def test_observe_with_positions_of_another_head_raises():
    state = HeavyHitters(heavy=1, recent=1).new_state(num_heads=2)
    state.observe(torch.tensor([[3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 3.0, 0.0]]), torch.arange(4).view(1, -1))
    state.append(4)
    fp = state.full_positions()
    assert fp.tolist() == [[0, 3], [2, 3]]
    with pytest.raises(RuntimeError):  # head 0's positions broadcast to both heads
        state.observe(torch.ones(2, 2), fp[:1])
    state.observe(torch.ones(2, 2), fp)  # the right ones are accepted


def test_policy_contract():
    """kvpolicy.testing's generic contract, driven with random scores as the cache drives it:
    monotone, |FP| <= min(T, heavy + recent), equal counts per head, consistent, deterministic."""
    check_policy(
        st.builds(HeavyHitters, heavy=st.integers(0, 8), recent=st.integers(1, 8)),
        max_full=lambda policy, length, prompt: min(length, policy.heavy + policy.recent),
    )
