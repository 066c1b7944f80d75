"""The statistics of the lab's reports, computed with SciPy.

- :func:`mean_se`: a mean and its standard error (``scipy.stats.sem``, ``ddof=1``);
- :func:`wilson`: the Wilson score interval of a pass rate (``scipy.stats.binomtest``), which
  stays inside [0, 1] and is honest at the handful of samples a passkey or needle task runs;
- :func:`successes`: the number of passes behind a recorded pass rate;
- :func:`spearman`: Spearman's rank correlation (``scipy.stats.spearmanr``, average ranks for ties).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats

#: the confidence level of every interval the reports print
CONFIDENCE = 0.95


def mean_se(values: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """The mean of ``values`` and its standard error.

    Parameters
    ----------
    values
        One or more numbers.

    Returns
    -------
    tuple of float
        The mean, and the sample standard deviation (``ddof=1``) over the square root of the count;
        the standard error is NaN for a single value.

    Raises
    ------
    ValueError
        When ``values`` is empty.
    """
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0:
        raise ValueError("mean_se: values is empty; give at least one number")
    se = float(stats.sem(x, ddof=1)) if x.size > 1 else math.nan
    return float(x.mean()), se


def wilson(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The Wilson score interval of ``k`` passes in ``n`` trials.

    Parameters
    ----------
    k
        Passes, ``0 <= k <= n``.
    n
        Trials, at least 1.
    confidence
        The interval's confidence level, strictly between 0 and 1.

    Returns
    -------
    tuple of float
        The interval's low and high ends, both within [0, 1].

    Raises
    ------
    ValueError
        When ``n``, ``k`` or ``confidence`` is out of range.
    """
    if n < 1:
        raise ValueError(f"wilson: n={n!r} trials; n must be at least 1")
    if not 0 <= k <= n:
        raise ValueError(f"wilson: k={k!r} passes; k must be between 0 and n={n}")
    if not 0 < confidence < 1:
        raise ValueError(f"wilson: confidence={confidence!r}; it must be strictly between 0 and 1")
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def successes(rate: float, n: int | None) -> int | None:
    """The passes behind a pass rate ``rate`` over ``n`` trials, or None when ``rate * n`` is not a
    whole number (a rate averaged from scores other than 0 and 1) or ``n`` is unknown."""
    if n is None or n < 1 or rate != rate:
        return None
    k = round(rate * n)
    return k if abs(rate * n - k) < 1e-6 else None


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of two equally long sequences, ties at their average rank.

    Returns
    -------
    float
        The correlation, or NaN when either sequence holds one value only (no ranking to compare).

    Raises
    ------
    ValueError
        When the sequences differ in length or hold fewer than two values.
    """
    if len(a) != len(b):
        raise ValueError(f"spearman: sequences of {len(a)} and {len(b)} values; they must be equally long")
    if len(a) < 2:
        raise ValueError(f"spearman: {len(a)} pairs; at least 2 are needed")
    if len(set(a)) == 1 or len(set(b)) == 1:
        return math.nan
    return float(stats.spearmanr(a, b).statistic)
