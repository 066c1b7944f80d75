"""Property and example tests of the attention-sink policy (StreamingLLM; policies-spec.md (c)).

The reference used throughout is an independent brute-force state machine written here from the
spec text: keep a list of full-precision positions; append ``t``; while it holds more than
``S + R`` positions, demote the oldest one that is not a sink (the entry at index ``S``).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvpolicy.errors import ConfigError
from kvpolicy.policies.recent import RecentWindow
from kvpolicy.policies.sink import SinkWindow
from kvpolicy.testing import check_policy, chunkings, with_examples

MAX_R = 64
MAX_S = 8
SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------------------------------
# reference and helpers
# --------------------------------------------------------------------------------------------------


def brute_force(sinks: int, window: int, length: int) -> tuple[list[list[int]], list[list[int]]]:
    """Single-append state machine.

    Returns
    -------
    fps, demoted
        ``fps[T]`` is ``FP(T)`` for ``T = 0..length``; ``demoted[T]`` what the append that made the
        length ``T`` demoted (``demoted[0] == []``), in demotion order.
    """
    fp: list[int] = []
    fps: list[list[int]] = [[]]
    demoted: list[list[int]] = [[]]
    for t in range(length):
        fp.append(t)
        out: list[int] = []
        while len(fp) > sinks + window:
            out.append(fp.pop(sinks))
        fps.append(list(fp))
        demoted.append(out)
    return fps, demoted


def formula(sinks: int, window: int, length: int) -> list[int]:
    """The spec's closed form ``[0, min(S, T)) ∪ [max(S, T - R), T)``, as a sorted list."""
    return sorted(set(range(min(sinks, length))) | set(range(max(sinks, length - window), length)))


def run_single(sinks: int, window: int, length: int) -> tuple[list[list[int]], list[list[int]]]:
    state = SinkWindow(sinks=sinks, window=window).new_state()
    fps: list[list[int]] = [state.full_positions()]
    demoted: list[list[int]] = [[]]
    for t in range(length):
        out = state.append(1)
        assert isinstance(out, list)
        demoted.append(out)
        assert state.length == t + 1
        fps.append(state.full_positions())
    return fps, demoted


@st.composite
def srt(draw, max_s: int = MAX_S, max_r: int = MAX_R, t_factor: int = 40):
    s = draw(st.integers(0, max_s))
    r = draw(st.integers(1, max_r))
    return s, r, draw(st.integers(0, t_factor * r + s))


EDGES = [
    (0, 1, 0),
    (0, 1, 5),
    (1, 1, 5),
    (4, 1, 10),
    (4, 4, 4),
    (4, 4, 8),
    (4, 4, 9),
    (8, 64, 2568),
    (8, 1, 3),
    (3, 5, 100),
]


with_edges = with_examples("srt", EDGES)


# --------------------------------------------------------------------------------------------------
# invariants of spec (c)
# --------------------------------------------------------------------------------------------------


@SETTINGS
@with_edges
@given(srt=srt())
def test_exact_sets_vs_reference_and_closed_form(srt):
    s, r, t = srt
    fps, demoted = run_single(s, r, t)
    ref_fps, ref_dem = brute_force(s, r, t)
    assert fps == ref_fps
    assert demoted == ref_dem
    for tt in range(t + 1):
        assert fps[tt] == formula(s, r, tt)


@SETTINGS
@with_edges
@given(srt=srt())
def test_count(srt):
    s, r, t = srt
    fps, _ = run_single(s, r, t)
    for tt in range(t + 1):
        assert len(fps[tt]) == min(tt, s + r)
        if tt <= s + r:
            assert fps[tt] == list(range(tt))


@SETTINGS
@with_edges
@given(srt=srt())
def test_sinks_and_newest_always_full_precision(srt):
    s, r, t = srt
    fps, demoted = run_single(s, r, t)
    for tt in range(t + 1):
        fp = set(fps[tt])
        assert set(range(min(s, tt))) <= fp
        assert set(range(tt - min(tt, r), tt)) <= fp
        assert all(p >= s for p in demoted[tt])


@SETTINGS
@with_edges
@given(srt=srt())
def test_one_demotion_per_step_once_full(srt):
    s, r, t = srt
    _, demoted = run_single(s, r, t)
    for tt in range(1, t + 1):
        assert demoted[tt] == ([tt - 1 - r] if tt > s + r else [])


@SETTINGS
@with_edges
@given(srt=srt())
def test_monotone(srt):
    s, r, t = srt
    fps, demoted = run_single(s, r, t)
    ever: set[int] = set()
    for tt in range(t + 1):
        fp = fps[tt]
        assert fp == sorted(fp)
        assert len(set(fp)) == len(fp)
        assert all(0 <= p < tt for p in fp)
        if tt >= 1:
            prev = set(fps[tt - 1]) | {tt - 1}
            assert set(fp) <= prev  # FP(T) ⊆ FP(T-1) ∪ {T-1}
            assert set(demoted[tt]) == prev - set(fp)
        assert not (set(demoted[tt]) & ever)
        ever |= set(demoted[tt])
        assert not (set(fp) & ever)
        assert set(fp) | ever == set(range(tt))


@st.composite
def srt_chunks(draw):
    s, r, t = draw(srt())
    return s, r, t, draw(chunkings(t))


@SETTINGS
@example(case=(4, 4, 30, [0, 30]))
@example(case=(4, 4, 30, [3, 0, 1, 5, 21]))
@example(case=(0, 1, 12, [1, 1, 10]))
@example(case=(4, 1020, 9000, [8192, 1, 807]))
@example(case=(8, 64, 2568, [2568]))
@given(case=srt_chunks())
def test_chunked_appends_and_prefill_equal_single_appends(case):
    """Prefill of L = L single appends; any chunking gives the same FP and demotion order."""
    s, r, t, chunks = case
    ref_fps, ref_dem = brute_force(s, r, t)
    state = SinkWindow(sinks=s, window=r).new_state()
    flat: list[int] = []
    done = 0
    for k in chunks:
        out = state.append(k)
        done += k
        assert state.length == done
        assert state.full_positions() == ref_fps[done]
        flat.extend(out)
    assert flat == [p for d in ref_dem for p in d]


@SETTINGS
@given(srt=srt(t_factor=10), data=st.data())
def test_deterministic(srt, data):
    s, r, t = srt
    chunks = data.draw(chunkings(t))
    policy = SinkWindow(sinks=s, window=r)
    a, b, other = policy.new_state(), SinkWindow(sinks=s, window=r).new_state(), policy.new_state(num_heads=4)
    for k in chunks:
        assert a.append(k) == b.append(k)
        other.append(3)  # an unrelated state of the same policy, to catch shared state
        assert a.full_positions() == b.full_positions()
        assert a.length == b.length


@SETTINGS
@given(rt=st.integers(1, MAX_R).flatmap(lambda r: st.tuples(st.just(r), st.integers(0, 20 * r))))
def test_zero_sinks_is_the_sliding_window(rt):
    r, t = rt
    a = SinkWindow(sinks=0, window=r).new_state()
    b = RecentWindow(window=r, variant="sliding").new_state()
    for _ in range(t):
        assert a.append(1) == b.append(1)
        assert a.full_positions() == b.full_positions()


# --------------------------------------------------------------------------------------------------
# worked examples
# --------------------------------------------------------------------------------------------------


def test_worked_example_s2_r3():
    state = SinkWindow(sinks=2, window=3).new_state()
    assert state.append(5) == []
    assert state.full_positions() == [0, 1, 2, 3, 4]
    assert state.append(1) == [2]
    assert state.full_positions() == [0, 1, 3, 4, 5]
    assert state.append(1) == [3]
    assert state.append(3) == [4, 5, 6]
    assert state.full_positions() == [0, 1, 7, 8, 9]
    assert state.append(0) == []
    assert state.length == 10


def test_worked_example_prompt_shorter_than_sinks():
    state = SinkWindow(sinks=4, window=2).new_state()
    assert state.append(3) == []
    assert state.full_positions() == [0, 1, 2]
    assert state.append(3) == []
    assert state.full_positions() == [0, 1, 2, 3, 4, 5]
    assert state.append(1) == [4]
    assert state.full_positions() == [0, 1, 2, 3, 5, 6]


def test_large_prefill_is_cheap():
    state = SinkWindow().new_state()
    out = state.append(1_000_000)
    assert out == list(range(4, 1_000_000 - 1020))
    assert state.full_positions() == [0, 1, 2, 3, *range(1_000_000 - 1020, 1_000_000)]


# --------------------------------------------------------------------------------------------------
# validation and defaults
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("param", "bad"), [("sinks", -1), ("sinks", 1.0), ("sinks", True), ("sinks", "4")])
def test_sinks_validation(param, bad):
    with pytest.raises(ConfigError) as info:
        SinkWindow(**{param: bad})
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert param in msg
    assert repr(bad) in msg


@pytest.mark.parametrize("bad", [0, -2, 2.5, False, None])
def test_window_validation(bad):
    with pytest.raises(ConfigError) as info:
        SinkWindow(window=bad)
    msg = str(info.value)
    assert "window" in msg
    assert repr(bad) in msg


def test_defaults_and_class_attributes():
    policy = SinkWindow()
    assert (policy.sinks, policy.window) == (4, 1020)
    assert SinkWindow.name == "sink"
    assert SinkWindow.per_head is False
    assert SinkWindow.needs_scores is False
    state = policy.new_state()
    assert (state.sinks, state.window, state.length) == (4, 1020, 0)
    assert state.full_positions() == []
    state.append(1024)
    assert state.full_positions() == list(range(1024))
    assert state.append(1) == [4]
    assert SinkWindow(sinks=0, window=1).sinks == 0  # S = 0 and R = 1 are the smallest valid values
    with pytest.raises(Exception):  # noqa: B017 - frozen dataclass
        policy.sinks = 1  # type: ignore[misc]


@pytest.mark.parametrize("bad", [-1, 1.0, True])
def test_append_rejects_bad_counts(bad):
    state = SinkWindow(sinks=2, window=4).new_state()
    with pytest.raises(ValueError):
        state.append(bad)


def test_policy_contract():
    """kvpolicy.testing's generic contract: monotone, |FP| <= min(T, S + R), consistent, chunking-invariant."""
    check_policy(
        st.builds(SinkWindow, sinks=st.integers(0, 6), window=st.integers(1, 16)),
        max_full=lambda policy, length, prompt: min(length, policy.sinks + policy.window),
        chunking="any",
    )
