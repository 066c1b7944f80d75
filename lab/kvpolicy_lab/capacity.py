"""How long a prompt fits in a memory budget, from the model's config alone (``kvpolicy estimate --memory``).

:func:`longest_prompt` finds, for a composition, the longest prompt whose cache holds at most a budget of bytes
after the prefill, with :func:`kvpolicy_lab.estimate` as the measure. Estimates cost time in proportion to the
prompt (they quantize a one-head probe of it), so the search does not probe long prompts one after another:

- it estimates the bytes at ``P``, ``2P`` and ``3P`` tokens (:data:`STEP` = ``P``: 5,376 = 2^8 x 3 x 7, a
  multiple of the windows and group sizes compositions use: 4, 16, 32, 42, 64, 128...). A cache whose windows
  and groups repeat within ``P`` tokens holds the same number of bytes more for every ``P`` tokens more once
  it is past them; when the two steps agree, the bytes at ``kP + r`` tokens are those at ``P + r`` plus
  ``k - 1`` steps;
- it then finds the longest ``r`` by interpolation and bisection over exact estimates at ``P + r`` tokens
  (a few estimates of at most ``2P`` tokens), and checks the step once more at ``2P + r``;
- when the steps differ (bytes that do not grow in a straight line, or windows that do not divide ``P``),
  or the budget is reached before ``P`` tokens, every figure is an exact estimate at that length, found by
  doubling and bisection.

The result says which way it was found (:attr:`Fit.extrapolated`). A cache whose bytes stop growing (eviction:
``h2o``, ``streamingllm``) fits whatever the prompt when its plateau does (:attr:`Fit.unbounded`). The bytes are
not quite monotone in the prompt length (a log window's thinning and a staged group's quantization move tokens
between full precision and codes), so within a window or a group of the answer other lengths may fit or not: the
answer is a length that fits followed by one that does not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpolicy.errors import ConfigError

#: the search step of the search (see the module docstring)
STEP = 5376
#: the longest prompt a cache can hold (the largest int32 position, plus one)
MAX_PROMPT = (1 << 31) - 1
#: the composition :func:`longest_prompt` takes for transformers' ``DynamicCache``
DYNAMIC = "DynamicCache"


@dataclass(frozen=True)
class Fit:
    """The longest prompt whose cache fits a budget (see :func:`longest_prompt`).

    Attributes
    ----------
    budget : int
        The budget, in bytes.
    tokens : int
        The longest prompt that fits (0: not even one token); :data:`MAX_PROMPT` when :attr:`unbounded`.
    bytes_held : int
        What the cache holds after that prompt (with :attr:`unbounded`: what it holds at most).
    unbounded : bool
        The cache stops growing below the budget, so any prompt fits.
    extrapolated : bool
        :attr:`tokens` is past the lengths estimated directly: its bytes are those at ``P + r`` tokens plus the
        per-``P``-token step the search checked (see the module docstring).
    """

    budget: int
    tokens: int
    bytes_held: int
    unbounded: bool = False
    extrapolated: bool = False


class Curve:
    """The bytes a composition's cache holds after a prompt, as a function of its length (see the module
    docstring): exact estimates, each made once, extended along the search step where it holds.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config (as :func:`kvpolicy_lab.estimate` takes it).
    composition : str, mapping, CacheSpec or CompressedCache
        What :func:`kvpolicy_lab.estimate` takes, or :data:`DYNAMIC` for transformers' ``DynamicCache`` in ``dtype``.
    batch : int, optional
        Batch rows, each holding the whole prompt.
    dtype : torch.dtype or str, optional
        The dtype of the model's keys and values.
    on_probe : callable, optional
        Called with the prompt length of each estimate made (a progress bar's update).

    Raises
    ------
    ConfigError
        Whatever :func:`kvpolicy_lab.estimate` refuses (checked at construction, with a one-token estimate).
    """

    def __init__(
        self,
        config: Any,
        composition: Any,
        *,
        batch: int = 1,
        dtype: Any = "bfloat16",
        on_probe: Callable[[int], None] | None = None,
    ) -> None:
        from kvpolicy_lab.estimation import estimate

        self.dynamic = isinstance(composition, str) and composition == DYNAMIC
        self._what = {"policy": "log", "action": "none"} if self.dynamic else composition
        self._config, self._batch, self._dtype, self._on_probe = config, batch, dtype, on_probe
        self._seen: dict[int, int] = {}
        estimate(config, 1, self._what, batch=batch, dtype=dtype)  # a bad composition is refused here

    def held(self, n: int) -> int:
        """The bytes held after a prompt of ``n`` tokens, an exact estimate (at most
        :data:`kvpolicy_lab.estimation.MAX_TOKENS`)."""
        from kvpolicy_lab.estimation import MAX_TOKENS, estimate

        if n not in self._seen:
            if n > MAX_TOKENS:
                raise _TooLong(n)
            if self._on_probe is not None:
                self._on_probe(n)
            e = estimate(self._config, n, self._what, batch=self._batch, dtype=self._dtype)
            self._seen[n] = e.dynamic_bytes if self.dynamic else e.total_bytes
        return self._seen[n]

    def step(self) -> int | None:
        """The bytes every :data:`STEP` tokens add past the first, when the estimates at one, two and three
        steps agree on it (``None`` when they do not)."""
        p = STEP
        f1, f2, f3 = self.held(p), self.held(2 * p), self.held(3 * p)
        return f2 - f1 if f2 - f1 == f3 - f2 and f2 >= f1 else None

    def at_step(self, k: int) -> int:
        """The bytes held after ``k * STEP`` tokens (``k >= 1``): an exact estimate up to three steps, then
        extended along :meth:`step`, or an exact estimate where the step does not hold."""
        step = self.step() if k > 3 else None
        if step is None:
            return self.held(k * STEP)
        return self.held(STEP) + (k - 1) * step


def longest_prompt(
    config: Any,
    budget: int,
    composition: Any,
    *,
    batch: int = 1,
    dtype: Any = "bfloat16",
    on_probe: Callable[[int], None] | None = None,
) -> Fit:
    """The longest prompt whose cache holds at most ``budget`` bytes after the prefill.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config (as :func:`kvpolicy_lab.estimate` takes it).
    budget : int
        Bytes, >= 1.
    composition : str, mapping, CacheSpec, CompressedCache or Curve
        What :func:`kvpolicy_lab.estimate` takes, :data:`DYNAMIC` for transformers' ``DynamicCache`` in ``dtype``, or
        a :class:`Curve` (whose estimates are then reused).
    batch : int, optional
        Batch rows, each holding the whole prompt.
    dtype : torch.dtype or str, optional
        The dtype of the model's keys and values.
    on_probe : callable, optional
        Called with the prompt length of each estimate the search makes (a progress bar's update).

    Returns
    -------
    Fit

    Raises
    ------
    ConfigError
        A bad budget, or whatever :func:`kvpolicy_lab.estimate` refuses.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ConfigError(f"longest_prompt: budget must be a number of bytes >= 1; got budget={budget!r}")
    curve = (
        composition
        if isinstance(composition, Curve)
        else Curve(config, composition, batch=batch, dtype=dtype, on_probe=on_probe)
    )
    return _search(curve, budget)


class _TooLong(Exception):
    """An exact estimate past :data:`kvpolicy_lab.estimation.MAX_TOKENS` was needed."""


def _search(curve: Curve, budget: int) -> Fit:
    p, held = STEP, curve.held
    if held(1) > budget:
        return Fit(budget, 0, 0)
    if held(p) > budget:
        n = _bisect(held, budget, 1, p)
        return Fit(budget, n, held(n))
    f1, f3 = held(p), held(3 * p)
    step = curve.step()
    if step == 0:
        return Fit(budget, MAX_PROMPT, f3, unbounded=True)
    if step is not None:
        k = 1 + (budget - f1) // step  # the last step that fits: k * p tokens
        if k * p >= MAX_PROMPT:
            return Fit(budget, MAX_PROMPT, f1 + (MAX_PROMPT // p - 1) * step, extrapolated=True)
        offset = (k - 1) * step
        r = _bisect(lambda m: held(m) + offset, budget, p, 2 * p) - p
        if held(2 * p + r) - held(p + r) == step:  # the step holds at this offset too
            n = k * p + r
            return Fit(budget, n, held(p + r) + offset, extrapolated=n > 3 * p)
    try:
        lo, hi = next(((a, b) for a, b in ((p, 2 * p), (2 * p, 3 * p)) if held(b) > budget), (3 * p, 6 * p))
        while held(hi) <= budget:
            lo, hi = hi, 2 * hi
        n = _bisect(held, budget, lo, hi)
        return Fit(budget, n, held(n))
    except _TooLong as exc:
        raise ConfigError(
            f"the budget holds a prompt longer than the longest estimate ({exc.args[0]} tokens needed), and this "
            "composition's bytes do not grow by the same step every few thousand tokens, so they cannot be "
            "extended; give a smaller budget"
        ) from None


def _bisect(held: Callable[[int], int], budget: int, lo: int, hi: int) -> int:
    """The largest ``n`` in ``[lo, hi)`` with ``held(n) <= budget``, given ``held(lo) <= budget < held(hi)``:
    regula falsi (the Illinois variant: an end kept twice has its bytes halved towards the budget in the
    interpolation), which lands next to the answer where the bytes grow in a straight line, with a bisection
    step whenever two steps have not halved the interval."""
    f_lo, f_hi = held(lo) - budget, held(hi) - budget  # <= 0 and > 0
    w_lo, w_hi = f_lo, f_hi  # the weights of the interpolation
    kept, widths = 0, [hi - lo]
    while hi - lo > 1:
        if len(widths) >= 3 and widths[-1] > widths[-3] // 2:
            mid = (lo + hi) // 2
        else:  # where the straight line between the (weighted) ends crosses the budget
            mid = lo + int(-w_lo * (hi - lo) / (w_hi - w_lo))
        mid = min(max(mid, lo + 1), hi - 1)
        f_mid = held(mid) - budget
        if f_mid <= 0:
            lo, f_lo, w_lo = mid, f_mid, f_mid
            kept = kept + 1 if kept > 0 else 1
            if kept >= 2:
                w_hi /= 2
        else:
            hi, f_hi, w_hi = mid, f_mid, f_mid
            kept = kept - 1 if kept < 0 else -1
            if kept <= -2:
                w_lo /= 2
        widths.append(hi - lo)
    return lo
