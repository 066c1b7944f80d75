"""LogQuant's log-distributed window (arXiv 2503.19950); spec: policies-spec.md (a)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

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
        self._full: list[int] = []

    def append(self, n: int) -> list[int]:
        w = self.window
        demoted: list[int] = []
        while n > 0:
            # append up to the step that triggers the next thinning, in one go
            k = min(n, 3 * w + 1 - len(self._full))
            self._full.extend(range(self.length, self.length + k))
            self.length += k
            n -= k
            if len(self._full) > 3 * w:
                head = self._full[: 2 * w]
                demoted.extend(head[1::2])
                self._full = head[0::2] + self._full[2 * w :]
        return demoted

    def full_positions(self) -> list[int]:
        return list(self._full)

    def validate(self) -> None:
        """``R`` must hold as many positions as ``FP(length)`` does, ascending and in range, ending with
        the newest ``min(length, W + 1)`` positions (which ``FP`` always holds); otherwise the
        thinning in :meth:`append` could never trigger."""
        super().validate()
        full, t, w = self._full, self.length, self.window
        if not all(isinstance(p, int) and not isinstance(p, bool) for p in full):
            raise ValueError("LogWindowState._full: positions must be integers")
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
