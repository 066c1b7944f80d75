"""Attention sinks plus a recent window (StreamingLLM, arXiv 2309.17453); spec: policies-spec.md (c)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpolicy.policies.base import Policy, PolicyState, check_int


@dataclass(frozen=True)
class SinkWindow(Policy):
    """Keep the first ``S`` tokens (attention sinks) and the ``R`` most recent ones at full precision.

    ``FP(T) = [0, min(S, T)) ∪ [max(S, T - R), T)``, so ``|FP(T)| = min(T, S + R)``; positions
    ``< S`` are never demoted and once ``T > S + R`` exactly one position (``T - 1 - R``) is demoted
    per step. A prefill of ``L`` tokens behaves exactly as ``L`` single appends. The selection is
    data-independent and shared by every layer, head and batch row.

    Positions are logical: in a left-padded batch the sinks are the first ``S`` *real* tokens of each
    row, which the cache maps to logical positions ``0 .. S-1`` (pads are not positions).

    Parameters
    ----------
    sinks : int
        ``S >= 0`` (default 4, StreamingLLM's choice). ``S = 0`` is the sliding window.
    window : int
        ``R >= 1`` (default 1020, so that ``S + R = 1024``).
    """

    sinks: int = 4
    window: int = 1020

    name = "sink"
    splits_appends = True  # FP(T) depends on T only

    def __post_init__(self) -> None:
        check_int("sinks", self.sinks, 0, "SinkWindow")
        check_int("window", self.window, 1, "SinkWindow")

    def new_state(self, num_heads: int = 1) -> SinkWindowState:
        return SinkWindowState(self.sinks, self.window)


class SinkWindowState(PolicyState):
    """Incremental state of :class:`SinkWindow`; the recent part is ``[max(S, T - R), T)``."""

    fixed = ("sinks", "window")

    def __init__(self, sinks: int, window: int) -> None:
        self.sinks = sinks
        self.window = window
        self.length = 0

    def _lo(self, length: int) -> int:
        return max(self.sinks, length - self.window)

    def append(self, n: int) -> list[int]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"append: n must be an integer >= 0; got n={n!r}")
        before = self._lo(self.length)
        self.length += n
        return list(range(before, self._lo(self.length)))

    def full_positions(self) -> list[int]:
        t = self.length
        return list(range(min(self.sinks, t))) + list(range(self._lo(t), t))
