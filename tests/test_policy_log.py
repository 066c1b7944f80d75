"""Property and example tests of the LogQuant log-window policy (policies-spec.md (a)).

The reference used throughout is an independent brute-force re-implementation of the spec's state
machine, written here from the spec text: ``R.append(t)``; if ``len(R) > 3W``: demote
``R[1:2W:2]`` and set ``R = R[0:2W:2] + R[2W:]``, one position at a time.
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvpolicy.errors import ConfigError
from kvpolicy.policies.log import LogWindow, log_full_positions
from kvpolicy.testing import check_policy, chunkings, with_examples

MAX_W = 64
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------------------------------
# references and helpers
# --------------------------------------------------------------------------------------------------


def brute_force(window: int, length: int) -> tuple[list[list[int]], list[list[int]]]:
    """The spec's state machine, single-token appends.

    Returns
    -------
    fps, demoted
        ``fps[T]`` is ``FP(T)`` (sorted) for ``T = 0..length``; ``demoted[T]`` is the list demoted by
        the append that made the length ``T`` (``demoted[0] == []``), in demotion order.
    """
    r: list[int] = []
    fps: list[list[int]] = [[]]
    demoted: list[list[int]] = [[]]
    for t in range(length):
        r.append(t)
        out: list[int] = []
        if len(r) > 3 * window:
            out = r[1 : 2 * window : 2]
            r = r[0 : 2 * window : 2] + r[2 * window :]
        fps.append(sorted(r))
        demoted.append(out)
    return fps, demoted


def brute_after_append(window: int, length: int) -> list[int]:
    """The list ``R`` right after appending position ``length - 1`` (before any thinning)."""
    r: list[int] = []
    for t in range(length):
        r.append(t)
        if len(r) > 3 * window and t < length - 1:
            r = r[0 : 2 * window : 2] + r[2 * window :]
    return r


def run_single(window: int, length: int) -> tuple[list[list[int]], list[list[int]]]:
    """Drive ``LogWindow(window).new_state()`` with ``length`` single appends; same shape as brute_force."""
    state = LogWindow(window=window).new_state()
    fps: list[list[int]] = [state.full_positions()]
    demoted: list[list[int]] = [[]]
    for t in range(length):
        demoted.append(list(state.append(1)))
        assert state.length == t + 1
        fps.append(state.full_positions())
    return fps, demoted


def suffix_len(fp: list[int], length: int) -> int:
    """Length of the maximal run of consecutive positions ending at ``length - 1``."""
    s = set(fp)
    n = 0
    while length - 1 - n >= 0 and (length - 1 - n) in s:
        n += 1
    return n


def is_demotion_step(window: int, length: int) -> bool:
    """``length = 3W + 1 + kW`` for some ``k >= 0``."""
    return length >= 3 * window + 1 and (length - 3 * window - 1) % window == 0


@st.composite
def w_and_t(draw, max_w: int = MAX_W, t_factor: int = 40):
    w = draw(st.integers(1, max_w))
    t = draw(st.integers(0, t_factor * w))
    return w, t


EDGES = [(1, 0), (1, 1), (1, 3), (1, 4), (1, 40), (2, 7), (3, 10), (64, 2560), (64, 193), (5, 200)]


with_edges = with_examples("wt", EDGES)


@st.composite
def w_t_prefill(draw):
    w, t = draw(w_and_t())
    return w, t, draw(st.integers(0, t))


@st.composite
def w_t_chunks(draw):
    w, t = draw(w_and_t())
    return w, t, draw(chunkings(t))


# --------------------------------------------------------------------------------------------------
# the eleven invariants of spec (a)
# --------------------------------------------------------------------------------------------------


@SETTINGS
@with_edges
@given(wt=w_and_t())
def test_invariant_1_all_full_precision_up_to_3w(wt):
    w, t = wt
    fps, demoted = run_single(w, t)
    ref, _ = brute_force(w, t)
    assert fps == ref
    for tt in range(min(t, 3 * w) + 1):
        assert fps[tt] == list(range(tt))
        assert demoted[tt] == []


@SETTINGS
@with_edges
@given(wt=w_and_t())
def test_invariant_2_count(wt):
    w, t = wt
    fps, _ = run_single(w, t)
    ref, _ = brute_force(w, t)
    for tt in range(t + 1):
        assert len(fps[tt]) == len(ref[tt])
        assert len(fps[tt]) == len(set(fps[tt]))
        if tt > 3 * w:
            assert len(fps[tt]) == 2 * w + 1 + ((tt - 3 * w - 1) % w)
            assert 2 * w + 1 <= len(fps[tt]) <= 3 * w
        else:
            assert len(fps[tt]) == tt


@SETTINGS
@with_edges
@given(wt=w_and_t())
def test_invariant_3_contiguous_suffix(wt):
    w, t = wt
    fps, _ = run_single(w, t)
    for tt in range(t + 1):
        fp = set(fps[tt])
        # the newest min(T, W+1) positions are always full precision
        assert set(range(tt - min(tt, w + 1), tt)) <= fp
        if tt > 3 * w:
            assert suffix_len(fps[tt], tt) == w + 1 + ((tt - 3 * w - 1) % w)
        else:
            assert suffix_len(fps[tt], tt) == tt


@SETTINGS
@with_edges
@given(wt=w_and_t())
def test_invariant_4_position_zero_always_full_precision(wt):
    w, t = wt
    fps, demoted = run_single(w, t)
    for tt in range(1, t + 1):
        assert 0 in fps[tt]
        assert 0 not in demoted[tt]


@SETTINGS
@with_edges
@given(wt=w_and_t())
def test_invariant_5_monotone(wt):
    w, t = wt
    fps, demoted = run_single(w, t)
    ever_demoted: set[int] = set()
    for tt in range(t + 1):
        fp = fps[tt]
        assert fp == sorted(fp), "full_positions() must be sorted ascending"
        assert all(0 <= p < tt for p in fp)
        if tt >= 1:
            # FP(T) ⊆ FP(T-1) ∪ {T-1}, and what left is exactly what was reported demoted now
            prev = set(fps[tt - 1])
            assert set(fp) <= prev | {tt - 1}
            assert sorted(demoted[tt]) == sorted((prev | {tt - 1}) - set(fp))
        # a demoted token never comes back, and is never demoted twice
        assert not (set(demoted[tt]) & ever_demoted)
        ever_demoted |= set(demoted[tt])
        assert not (set(fp) & ever_demoted)
        # FP and Q partition [0, T)
        assert set(fp) | ever_demoted == set(range(tt))


@SETTINGS
@with_edges
@given(wt=w_and_t())
def test_invariant_6_demotion_schedule(wt):
    w, t = wt
    _, demoted = run_single(w, t)
    _, ref_demoted = brute_force(w, t)
    assert demoted == ref_demoted
    for tt in range(1, t + 1):
        if is_demotion_step(w, tt):
            assert len(demoted[tt]) == w
            r_after = brute_after_append(w, tt)
            assert len(r_after) == 3 * w + 1
            assert demoted[tt] == r_after[1 : 2 * w : 2]
        else:
            assert demoted[tt] == []


@SETTINGS
@with_edges
@given(wt=w_and_t())
def test_invariant_7_sparse_part_has_w_positions(wt):
    w, t = wt
    fps, _ = run_single(w, t)
    for tt in range(3 * w + 1, t + 1):
        n_suffix = suffix_len(fps[tt], tt)
        sparse = fps[tt][: len(fps[tt]) - n_suffix]
        assert len(sparse) == w
        assert sparse[-1] < tt - n_suffix - 1  # there is a gap before the suffix


@SETTINGS
@with_edges
@given(wt=w_and_t())
def test_invariant_8_horizon(wt):
    w, t = wt
    fps, _ = run_single(w, t)
    bound = (math.ceil(math.log2(w)) + 2) * w
    for tt in range(t + 1):
        rest = [p for p in fps[tt] if p != 0]
        if rest:
            assert tt - min(rest) <= bound


def expected_power_of_two_sparse(m: int, length: int) -> list[int]:
    """Spec invariant 9 for ``W = 2^m`` in steady state, stated precisely.

    Blocks are ``[kW, (k+1)W)``; ``s = (T - W - 1) // W`` is the block where the contiguous suffix
    ``[sW, T)`` starts. Steady state means ``T > 3W`` and ``s >= m + 1`` (block 0 has been thinned
    down to position 0 alone). Then for ``j = 1..m`` block ``s - j`` keeps exactly the ``W / 2^j``
    positions ``(s - j)W + i * 2^j`` (``0 <= i < W / 2^j``: stride ``2^j`` from the block start);
    blocks ``s - j`` with ``j > m`` keep nothing except position 0 (the sink, in block 0).
    """
    w = 1 << m
    s = (length - w - 1) // w
    assert length > 3 * w and s >= m + 1
    sparse = {0}
    for j in range(1, m + 1):
        sparse |= {(s - j) * w + i * (1 << j) for i in range(w >> j)}
    return sorted(sparse)


@st.composite
def pow2_steady(draw):
    m = draw(st.integers(0, 6))
    w = 1 << m
    lo = max(3, m + 2) * w + 1
    t = draw(st.integers(lo, 40 * w))
    return m, t


@SETTINGS
@example(mt=(0, 4))
@example(mt=(2, 17))
@example(mt=(3, 41))
@example(mt=(6, 2560))
@given(mt=pow2_steady())
def test_invariant_9_power_of_two_stride_structure(mt):
    m, t = mt
    w = 1 << m
    s = (t - w - 1) // w
    fp = LogWindow(window=w).new_state()
    fp.append(t)
    got = fp.full_positions()
    sparse, suffix = got[:w], got[w:]
    assert suffix == list(range(s * w, t))
    assert sparse == expected_power_of_two_sparse(m, t)
    for j in range(1, s + 1):
        block = [p for p in sparse if (s - j) * w <= p < (s - j + 1) * w]
        if j <= m:
            assert len(block) == w >> j
            assert all(b - a == 1 << j for a, b in itertools.pairwise(block))
            assert block[0] == (s - j) * w
        else:
            assert block == ([0] if s - j == 0 else [])


@SETTINGS
@example(mt=(2, 13))
@given(mt=st.integers(1, 6).flatmap(lambda m: st.tuples(st.just(m), st.integers(3 * (1 << m) + 1, 40 * (1 << m)))))
def test_invariant_9_power_of_two_transient_blocks(mt):
    """Also outside steady state: block ``s-j`` (1 <= j < s) keeps ``W/2^j`` at stride ``2^j``, and
    block 0 keeps ``max(1, W/2^(s-1))`` positions at stride ``2^(s-1)``."""
    m, t = mt
    w = 1 << m
    s = (t - w - 1) // w
    ref, _ = brute_force(w, t)
    sparse = ref[t][:w]
    expect: set[int] = set()
    for j in range(1, s):
        expect |= {(s - j) * w + i * (1 << j) for i in range(w >> j)}
    expect |= {i * (1 << (s - 1)) for i in range(max(1, w >> (s - 1)))}
    assert sparse == sorted(expect)
    state = LogWindow(window=w).new_state()
    state.append(t)
    assert state.full_positions()[:w] == sparse


@SETTINGS
@example(wtp=(1, 40, 5))
@example(wtp=(3, 100, 10))
@example(wtp=(4, 25, 13))
@example(wtp=(64, 2560, 193))
@example(wtp=(64, 2560, 2560))
@example(wtp=(7, 50, 0))
@given(wtp=w_t_prefill())
def test_invariant_10_incremental_closed_form_prefill_agree(wtp):
    w, t, prefill = wtp
    fps, demoted = run_single(w, t)
    ref_fps, ref_demoted = brute_force(w, t)
    assert fps == ref_fps
    assert demoted == ref_demoted
    for tt in range(t + 1):
        assert log_full_positions(w, tt) == ref_fps[tt]

    # one-shot prefill of L, then single decoding appends
    state = LogWindow(window=w).new_state()
    got_demoted = list(state.append(prefill))
    assert state.length == prefill
    assert state.full_positions() == ref_fps[prefill]
    assert got_demoted == [p for d in ref_demoted[: prefill + 1] for p in d]
    for tt in range(prefill + 1, t + 1):
        out = state.append(1)
        assert out == ref_demoted[tt]
        got_demoted.extend(out)
        assert state.length == tt
        assert state.full_positions() == ref_fps[tt] == log_full_positions(w, tt)
    assert got_demoted == [p for d in ref_demoted for p in d]


@SETTINGS
@example(wtc=(1, 40, [0, 3, 1, 36]))
@example(wtc=(4, 30, [12, 1, 0, 4, 13]))
@example(wtc=(5, 200, [16, 5, 5, 174]))
@example(wtc=(64, 2560, [193, 64, 1, 2302]))
@example(wtc=(64, 2560, [2560]))
@given(wtc=w_t_chunks())
def test_invariant_11_data_independent(wtc):
    w, t, chunks = wtc
    policy = LogWindow(window=w)
    # the selection takes no data: shared by every layer, head and batch row
    assert LogWindow.per_head is False
    assert LogWindow.needs_scores is False

    ref_fps, ref_demoted = brute_force(w, t)
    ref_flat = [p for d in ref_demoted for p in d]

    # two fresh states (one from the same policy object, one from an equal one), driven in
    # lock-step with the same sequence, plus an unrelated state interleaved to catch shared state
    a, b, other = policy.new_state(), LogWindow(window=w).new_state(), policy.new_state()
    flat_a: list[int] = []
    flat_b: list[int] = []
    done = 0
    for k in chunks:
        da, db = a.append(k), b.append(k)
        other.append(1)
        done += k
        assert da == db
        assert a.full_positions() == b.full_positions() == ref_fps[done]
        assert a.length == b.length == done
        flat_a.extend(da)
        flat_b.extend(db)
    assert flat_a == flat_b == ref_flat  # same FP and same demotion order as single appends
    assert a.full_positions() == ref_fps[t]


# --------------------------------------------------------------------------------------------------
# worked examples
# --------------------------------------------------------------------------------------------------


def at_step(window: int, length: int) -> tuple[list[int], list[int]]:
    """FP(T) and the positions demoted by the append that made the length T (single appends)."""
    state = LogWindow(window=window).new_state()
    out: list[int] = []
    for _ in range(length):
        out = state.append(1)
    return state.full_positions(), out


def test_worked_example_w4_first_twelve_all_full_precision():
    state = LogWindow(window=4).new_state()
    for t in range(1, 13):
        assert state.append(1) == []
        assert state.full_positions() == list(range(t))


@pytest.mark.parametrize(
    ("length", "sparse", "demoted"),
    [
        (13, [0, 2, 4, 6], [1, 3, 5, 7]),
        (17, [0, 4, 8, 10], [2, 6, 9, 11]),
        (21, [0, 8, 12, 14], [4, 10, 13, 15]),
        (25, [0, 12, 16, 18], [8, 14, 17, 19]),
    ],
)
def test_worked_example_w4(length, sparse, demoted):
    suffix = list(range(length - 5, length))
    fp, out = at_step(4, length)
    assert fp == sparse + suffix
    assert out == demoted
    assert log_full_positions(4, length) == sparse + suffix
    ref, ref_dem = brute_force(4, length)
    assert ref[length] == sparse + suffix
    assert ref_dem[length] == demoted


def test_worked_example_w8_t41():
    sparse = [0, 8, 16, 20, 24, 26, 28, 30]
    suffix = list(range(32, 41))
    fp, _ = at_step(8, 41)
    assert fp == sparse + suffix
    assert log_full_positions(8, 41) == sparse + suffix
    state = LogWindow(window=8).new_state()
    state.append(41)
    assert state.full_positions() == sparse + suffix


# --------------------------------------------------------------------------------------------------
# validation and defaults
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_window_validation(bad):
    with pytest.raises(ConfigError) as info:
        LogWindow(window=bad)
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert "window" in msg
    assert repr(bad) in msg or str(bad) in msg


def test_default_window_is_42():
    policy = LogWindow()
    assert policy.window == 42
    assert policy.new_state().window == 42
    assert LogWindow.name == "log"
    state = policy.new_state()
    state.append(3 * 42)
    assert state.full_positions() == list(range(126))
    assert len(state.append(1)) == 42


def test_policy_contract():
    """kvpolicy.testing's generic contract: monotone, |FP| <= 3W, consistent answers, chunking-invariant."""
    check_policy(
        st.builds(LogWindow, window=st.integers(1, 16)),
        max_full=lambda policy, length, prompt: min(length, 3 * policy.window),
        chunking="any",
        max_length=200,
    )
