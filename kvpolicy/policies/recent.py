"""Recent-window policies: a sliding window and KIVI / HF ``QuantizedCache``'s flushed residual.

Spec: policies-spec.md (b).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpolicy.policies.base import Policy, PolicyState, check_choice, check_int

VARIANTS = ("sliding", "flush")
PROMPT_MODES = ("quantize", "keep_tail")


@dataclass(frozen=True)
class RecentWindow(Policy):
    """Keep the most recent tokens at full precision.

    The selection is data-independent and shared by every layer, head and batch row; it needs no
    attention scores.

    Two variants, both with window ``R = window``:

    ``variant="sliding"`` (default)
        ``FP(T) = [max(0, T - R), T)``: the current token plus the ``R - 1`` before it. With the
        evict action this is Mistral's ``sliding_window=R`` attention. Once ``T > R`` exactly one
        position (``T - 1 - R``) is demoted per step. A prefill of ``L`` tokens behaves exactly as
        ``L`` single appends. ``prompt`` is validated but ignored.

    ``variant="flush"`` (KIVI keys / HF ``QuantizedCache`` residual)
        Full-precision tokens accumulate and are demoted ``R`` at a time. The *first* non-empty
        ``append`` of a state is the prompt (prefill) of length ``L``:

        - ``prompt="quantize"`` (HF ``QuantizedCache``): every prompt position is demoted, in
          position order; ``FP`` is empty after the prompt;
        - ``prompt="keep_tail"`` (KIVI): the last ``L mod R`` prompt positions stay full precision,
          the first ``L - (L mod R)`` are demoted in position order.

        After the prompt, each appended position ``t`` joins ``FP``; if then ``|FP| > R`` the oldest
        ``R`` positions of ``FP`` are demoted (leaving ``FP = {t}``). So during decoding
        ``1 <= |FP| <= R``, ``FP`` is always a contiguous suffix ``[lo, T)``, and demotions come ``R``
        at a time. A later multi-token append (e.g. a second user turn) behaves exactly as single
        appends of this rule.

        Why demote at ``|FP| > R`` rather than ``|FP| == R``: HF's ``QuantizedLayer.update`` (with
        ``residual_length=R``) returns ``[dequantized, residual, new]`` for attention and only
        *then*, if ``len(residual) + 1 >= R``, quantizes all of them. So at the step where HF flushes,
        the query still sees the ``R - 1`` residual tokens plus the new one (``R`` tokens) at full
        precision; the next token then sees only itself. Our rule keeps those ``R`` positions at
        ``FP(T)`` and demotes them when the next token arrives, so at every attention step the
        full-precision set equals HF's: sizes ``1, 2, ..., R, 1, 2, ..., R, ...`` after a quantized
        prompt (tested against ``transformers.cache_utils.QuantizedLayer``).

        Interpretation choices (the spec leaves these open):

        - an ``append(0)`` is a no-op; in particular it does not consume the prompt, the prompt is
          the first append with ``n >= 1``;
        - HF itself treats a later multi-token append differently (it flushes everything whenever
          ``len(residual) + n >= R``); we follow the spec's "behaves as single appends" instead, so
          only single-token decoding is HF-identical.

    Parameters
    ----------
    window : int
        ``R >= 1`` (default 128, KIVI's residual length and HF's ``residual_length``).
    variant : {"sliding", "flush"}
        See above.
    prompt : {"quantize", "keep_tail"}
        Prompt handling of the ``flush`` variant (ignored by ``sliding``).
    """

    window: int = 128
    variant: str = "sliding"
    prompt: str = "quantize"

    name = "recent"

    @property  # type: ignore[override]
    def splits_appends(self) -> bool:
        """``sliding`` depends on the length only; ``flush`` treats its first append as the prompt."""
        return self.variant == "sliding"

    def __post_init__(self) -> None:
        check_int("window", self.window, 1, "RecentWindow")
        check_choice("variant", self.variant, VARIANTS, "RecentWindow")
        check_choice("prompt", self.prompt, PROMPT_MODES, "RecentWindow")

    def new_state(self, num_heads: int = 1) -> SlidingWindowState | FlushWindowState:
        if self.variant == "sliding":
            return SlidingWindowState(self.window)
        return FlushWindowState(self.window, self.prompt)


def _check_count(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"append: n must be an integer >= 0; got n={n!r}")


class SlidingWindowState(PolicyState):
    """Incremental state of :class:`RecentWindow` with ``variant="sliding"``: ``FP = [max(0, T - R), T)``."""

    variant = "sliding"
    fixed = ("window",)

    def __init__(self, window: int) -> None:
        self.window = window
        self.length = 0

    def _lo(self, length: int) -> int:
        return max(0, length - self.window)

    def append(self, n: int) -> list[int]:
        _check_count(n)
        before = self._lo(self.length)
        self.length += n
        return list(range(before, self._lo(self.length)))

    def full_positions(self) -> list[int]:
        return list(range(self._lo(self.length), self.length))


class FlushWindowState(PolicyState):
    """Incremental state of :class:`RecentWindow` with ``variant="flush"``: ``FP = [lo, T)``."""

    variant = "flush"
    fixed = ("window", "prompt")

    def __init__(self, window: int, prompt: str) -> None:
        self.window = window
        self.prompt = prompt
        self.length = 0
        self._lo = 0  # first full-precision position; FP = [_lo, length)
        self._prompted = False

    def append(self, n: int) -> list[int]:
        _check_count(n)
        if n == 0:
            return []
        r = self.window
        old_lo = self._lo
        if not self._prompted:
            self._prompted = True
            self.length = n
            self._lo = n if self.prompt == "quantize" else n - n % r
        else:
            # as n single appends: the size grows to m = |FP| + n without flushes; the first flush
            # happens when it would reach R + 1 and each one after every R more tokens
            m = self.length - self._lo + n
            flushes = (m - 1) // r
            self.length += n
            self._lo += flushes * r
        return list(range(old_lo, self._lo))

    def full_positions(self) -> list[int]:
        return list(range(self._lo, self.length))

    def validate(self) -> None:
        """``FP = [_lo, length)`` holds at most ``window`` positions (or a prompt's remainder), and a state
        has seen its prompt exactly when it has seen any token."""
        super().validate()
        lo = self._lo
        if isinstance(lo, bool) or not isinstance(lo, int) or not 0 <= lo <= self.length:
            raise ValueError(f"FlushWindowState._lo={lo!r:.40} is not in [0, length={self.length}]")
        if self.length - lo > self.window:
            raise ValueError(f"FlushWindowState: FP = [{lo}, {self.length}) holds more than window={self.window}")
        if self._prompted != (self.length > 0):
            raise ValueError(f"FlushWindowState._prompted={self._prompted!r} at length {self.length}")
