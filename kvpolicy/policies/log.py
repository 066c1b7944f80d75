"""LogQuant's log-distributed window (arXiv 2503.19950); spec: policies-spec.md (a)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from kvpolicy.policies.base import Policy, PolicyState, check_int


@dataclass(frozen=True)
class LogWindow(Policy):
    """Keep a log-spaced set of past tokens plus a recent window at full precision.

    The full-precision list ``R`` grows by one per token; whenever it exceeds ``3 * window``
    entries, its first ``2 * window`` entries are thinned to every other one. Older blocks of
    ``window`` tokens thus keep 1/2, 1/4, 1/8 ... of their tokens. ``2W + 1 <= |FP(T)| <= 3W`` once
    ``T > 3W``; position 0 is always kept. The selection is data-independent: the same for every
    layer, head and batch row.

    Parameters
    ----------
    window : int
        ``W >= 1``. The paper sizes it from a reserved-token budget as ``budget // 3``
        (128 -> 42, the default).
    """

    window: int = 42

    name = "log"
    splits_appends = True  # LogWindowState.append steps through the same thinnings whatever the split

    def __post_init__(self) -> None:
        check_int("window", self.window, 1, "LogWindow")

    def new_state(self, num_heads: int = 1) -> LogWindowState:
        return LogWindowState(self.window)


class LogWindowState(PolicyState):
    """Incremental state of :class:`LogWindow` (the ordered list ``R``)."""

    fixed = ("window",)

    def __init__(self, window: int) -> None:
        self.window = window
        self.length = 0
        # R is ``_full ++ [length - _tail, length)``: a step that thins nothing only counts (two ints
        # change), so a compiled decode step reads no list whose length changes every step
        self._full: list[int] = []
        self._tail = 0

    def append(self, n: int) -> list[int]:
        w = self.window
        demoted: list[int] = []
        while n > 0:
            # append up to the step that triggers the next thinning, in one go
            k = min(n, 3 * w + 1 - len(self._full) - self._tail)
            self.length += k
            self._tail += k
            n -= k
            if len(self._full) + self._tail > 3 * w:
                demoted.extend(self._thin())
        return demoted

    @torch.compiler.disable
    def _thin(self) -> list[int]:
        """Thin ``R``'s oldest ``2W`` positions to every other one; return those it drops. Eager under
        ``torch.compile`` (a step that thins demotes, and the compiler never specialises on positions)."""
        w = self.window
        full = self.full_positions()
        head = full[: 2 * w]
        self._full, self._tail = head[0::2] + full[2 * w :], 0
        return head[1::2]

    def full_positions(self) -> list[int]:
        return self._full + list(range(self.length - self._tail, self.length))

    def state_dict(self) -> dict[str, Any]:
        """``window``, ``length`` and ``_full``, the whole of ``R`` (as a state without ``_tail`` is saved)."""
        return {"window": self.window, "length": self.length, "_full": self.full_positions()}

    def validate(self) -> None:
        """``R`` must hold as many positions as ``FP(length)`` does, ascending and in range, ending with
        the newest ``min(length, W + 1)`` positions (which ``FP`` always holds); otherwise the
        thinning in :meth:`append` could never trigger."""
        super().validate()
        t, w, tail = self.length, self.window, self._tail
        if isinstance(tail, bool) or not isinstance(tail, int) or not 0 <= tail <= t:
            raise ValueError(f"LogWindowState._tail={tail!r:.40} is not a count in [0, {t}]")
        if not all(isinstance(p, int) and not isinstance(p, bool) for p in self._full):
            raise ValueError("LogWindowState._full: positions must be integers")
        full = self.full_positions()
        expected = self.full_count_after(0)
        if len(full) != expected:
            raise ValueError(
                f"LogWindowState: {len(full)} full-precision positions at length {t}; LogWindow({w}) holds {expected}"
            )
        newest = min(t, w + 1)
        if (
            any(b <= a for a, b in itertools.pairwise(full))
            or (full and full[0] < 0)
            or full[len(full) - newest :] != list(range(t - newest, t))
        ):
            raise ValueError(
                f"LogWindowState._full is not ascending in [0, {t}) ending with the newest {newest} positions"
            )

    def full_count_after(self, n: int) -> int:
        t, w = self.length + n, self.window
        return t if t <= 3 * w else 2 * w + 1 + (t - 3 * w - 1) % w


def log_full_positions(window: int, length: int) -> list[int]:
    """Closed form of ``FP(T)`` for :class:`LogWindow` (policies-spec.md (a)).

    ``s = max(0, (T - W - 1) // W)``; ``S_1 = [0, W)``; ``S_{k+1} = (S_k ++ [kW, (k+1)W))[0::2]``;
    ``FP(T) = S_s ++ [sW, T)``.
    """
    w, t = window, length
    s = max(0, (t - w - 1) // w)
    sparse: list[int] = []
    if s >= 1:
        sparse = list(range(w))
        for k in range(1, s):
            sparse = (sparse + list(range(k * w, (k + 1) * w)))[0::2]
    return sparse + list(range(s * w, t))
