"""``kvpolicy.testing.check_policy`` catches each kind of contract breach (and passes a correct policy)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from hypothesis import strategies as st

from kvpolicy.errors import ConfigError
from kvpolicy.policies.base import Policy, PolicyState
from kvpolicy.policies.h2o import HeavyHitters
from kvpolicy.policies.recent import RecentWindow
from kvpolicy.testing import check_policy, run_policy

_counter = itertools.count()


class WindowState(PolicyState):
    """A sliding window of ``w`` with a selectable defect."""

    def __init__(self, w: int, defect: str) -> None:
        self.w, self.defect, self.length = w, defect, 0
        self.full: list[int] = []

    def append(self, n: int) -> list[int]:
        self.full += list(range(self.length, self.length + n))
        self.length += n
        keep = self.w + 1 if self.defect == "over-bound" else self.w
        if self.defect == "chunk-variant" and n > 1:
            keep = self.w + 1  # keeps one more after a multi-token append, demoted at the next one
        demoted, self.full = self.full[: max(0, len(self.full) - keep)], self.full[-keep:]
        if self.defect == "comes-back" and demoted and self.length % 5 == 0:
            self.full = sorted([demoted[0], *self.full])
        if self.defect == "lies-about-demoted" and len(demoted) > 0:
            demoted = demoted[1:]
        if self.defect == "reversed" and n > 1:
            demoted = demoted[::-1]  # the same positions, in another order after a multi-token append
        if self.defect == "random":
            self.w += next(_counter) % 2  # the global counter makes two runs differ
        return demoted

    def full_positions(self) -> list[int]:
        return list(self.full)

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.defect == "forgets-on-restore":
            self.full = self.full[1:]  # a restore that loses a position

    def full_count_after(self, n: int) -> int:
        count = min(self.w, len(self.full) + n)
        return count + 1 if self.defect == "bad-count" and n > 1 else PolicyState.full_count_after(self, n)


@dataclass(frozen=True)
class Window(Policy):
    w: int = 4
    defect: str = ""

    name = "window-under-test"

    def new_state(self, num_heads: int = 1) -> WindowState:
        return WindowState(self.w, self.defect)


@dataclass(frozen=True)
class SplitWindow(Window):
    """The window, declaring that its appends split (``Policy.splits_appends``)."""

    splits_appends = True


def bound(policy, length, prompt):
    return policy.w


def test_a_correct_policy_passes():
    check_policy(st.builds(Window, w=st.integers(1, 6)), max_full=bound, chunking="any")


@pytest.mark.parametrize(
    ("defect", "chunking"),
    [
        ("over-bound", None),
        ("comes-back", None),
        ("lies-about-demoted", None),
        ("bad-count", None),
        ("random", None),
        ("chunk-variant", "any"),
        ("forgets-on-restore", None),
    ],
)
def test_each_defect_is_caught(defect, chunking):
    with pytest.raises(AssertionError):
        check_policy(st.builds(Window, w=st.integers(1, 6), defect=st.just(defect)), max_full=bound, chunking=chunking)


def test_a_policy_whose_appends_split_passes_the_split_check():
    check_policy(st.builds(SplitWindow, w=st.integers(1, 6)), max_full=bound)


@pytest.mark.parametrize("defect", ["chunk-variant", "reversed"])
def test_a_false_splits_appends_claim_is_caught(defect):
    """Without any chunking claim: declaring ``splits_appends`` alone makes the check split every append."""
    loose = lambda policy, length, prompt: policy.w + 1  # noqa: E731  (chunk-variant keeps one more)
    check_policy(st.builds(Window, w=st.integers(1, 6), defect=st.just(defect)), max_full=loose)  # no claim: passes
    with pytest.raises(AssertionError, match="declares splits_appends"):
        check_policy(st.builds(SplitWindow, w=st.integers(1, 6), defect=st.just(defect)), max_full=loose)


@pytest.mark.parametrize("answer", ["one-row", "list-of-rows"])
def test_per_head_answers_not_one_row_per_head_are_caught(answer):
    class Ragged(HeavyHitters):
        def new_state(self, num_heads=1):
            state = super().new_state(num_heads)
            full = state.full_positions

            def ragged():
                out = full()
                if out.shape[1] < 3:
                    return out
                return out[:1] if answer == "one-row" else [row[h:] for h, row in enumerate(out)]

            state.full_positions = ragged
            return state

    with pytest.raises(AssertionError, match="full_positions"):
        check_policy(Ragged(heavy=2, recent=1), max_full=lambda p, t, prompt: 3)


def test_score_policies_are_driven_with_observe():
    steps = run_policy(HeavyHitters(heavy=1, recent=1), [6, 1, 3, 1], heads=2, seed=3)
    assert [s.n for s in steps] == [6, 1, 3, 1]
    assert all(len(row) == 2 for s in steps for row in s.full)


def test_chunking_claim_refused_for_score_policies_and_bad_values():
    with pytest.raises(ConfigError, match="chunking"):
        check_policy(HeavyHitters(heavy=1, recent=1), max_full=lambda p, t, prompt: 2, chunking="any")
    with pytest.raises(ConfigError, match="chunking"):
        check_policy(RecentWindow(window=2), max_full=lambda p, t, prompt: 2, chunking="sometimes")


def test_accepts_instance_class_and_factory():
    check_policy(RecentWindow(window=3), max_full=lambda p, t, prompt: 3, max_examples=5)
    check_policy(RecentWindow, max_full=lambda p, t, prompt: p.window, max_examples=5)
    check_policy(lambda: RecentWindow(window=2), max_full=lambda p, t, prompt: 2, max_examples=5)
    with pytest.raises(ConfigError, match="policy must be"):
        check_policy(42, max_full=lambda p, t, prompt: 1)


def test_run_policy_tensor_answers():
    steps = run_policy(HeavyHitters(heavy=2, recent=1), [5], heads=3, seed=0)
    assert steps[0].predicted == 3 and all(len(row) == 3 for row in steps[0].full)
    assert torch.tensor(steps[0].demoted).shape == (3, 2)


class _Opaque:
    """Not plain data: a state holding it cannot be saved by the default state_dict."""


class OpaqueState(WindowState):
    def __init__(self, w: int, defect: str) -> None:
        super().__init__(w, defect)
        self.helper = _Opaque()


@dataclass(frozen=True)
class OpaqueWindow(Window):
    def new_state(self, num_heads: int = 1) -> OpaqueState:
        return OpaqueState(self.w, self.defect)


def test_unsavable_state_is_caught_naming_the_attribute():
    """A state the default ``state_dict`` cannot save fails the contract, naming the attribute and the fix."""
    with pytest.raises(TypeError, match=r"OpaqueState.helper is a _Opaque.*Override state_dict\(\)"):
        check_policy(OpaqueWindow(w=3), max_full=bound)
