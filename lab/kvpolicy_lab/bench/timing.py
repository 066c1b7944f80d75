"""Interleaved timing of several statements with ``torch.utils.benchmark.Timer``.

The benchmarks compare things measured in one run (caches, backends), and their ratios are the numbers
to read. :func:`interleaved` gives each statement its own :class:`torch.utils.benchmark.Timer` and calls
them in rounds, one measurement of every statement per round, in an order that rotates from round to
round, so slow drift of the machine (another process, the clock, the temperature) lands on all of them
alike. The timers do the rest: each measurement first runs the statement a few times untimed (the
Timer's warm-up), then times ``number`` calls in a row with garbage collection paused, with torch on a fixed
number of threads and, where an accelerator is present, synchronizing it before reading the clock.
"""

from __future__ import annotations

import timeit
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext

import torch
from torch.utils.benchmark import Measurement, Timer
from torch.utils.benchmark import timer as synchronized_clock


def device_clock(device: str | torch.device) -> Callable[[], float]:
    """A clock for timing work on ``device``: the wall clock, read after waiting for ``device`` to finish
    what was queued on it (an accelerator runs asynchronously); for ``"cpu"``, the wall clock alone.

    Parameters
    ----------
    device : str or torch.device
        Where the timed work runs (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``, ...).

    Returns
    -------
    Callable[[], float]
        Seconds, for differences only (``timeit.default_timer``).
    """
    where = torch.device(device)
    if where.type == "cpu":
        return timeit.default_timer

    def clock() -> float:
        torch.accelerator.synchronize(where)
        return timeit.default_timer()

    return clock


def warmup_calls(number: int) -> int:
    """Untimed calls of the statement that ``Timer.timeit(number)`` makes before its timed block (its own
    warm-up: a hundredth of ``number``, at least two)."""
    return max(number // 100, 2)


def interleaved(
    statements: Mapping[str, Callable[[], object]],
    *,
    number: int,
    repeats: int,
    warmup: int = 0,
    threads: int | None = None,
    around: Callable[[str], AbstractContextManager[object]] | None = None,
    clock: Callable[[], float] = synchronized_clock,
) -> dict[str, Measurement]:
    """Time each statement ``repeats`` times, alternating between statements round by round.

    Round ``r`` measures every statement once, starting at the ``r``-th (modulo their count) and
    wrapping around. Each measurement is one ``Timer.timeit(number)`` call: :func:`warmup_calls`
    untimed calls of the statement, then ``number`` timed ones. The first ``warmup`` rounds run the same way and are
    discarded.

    Parameters
    ----------
    statements : Mapping[str, Callable[[], object]]
        Name -> a function of no arguments to time (its result is dropped). A statement that changes
        state (a decode step appending to its cache) keeps changing it: it runs
        ``(warmup + repeats) * (number + warmup_calls(number))`` times in all.
    number : int
        Timed calls per measurement (>= 1); a measurement's time is their total over ``number``.
    repeats : int
        Measured rounds (>= 1).
    warmup : int
        Untimed rounds first (>= 0).
    threads : int or None
        Torch threads while a statement runs (>= 1); ``None``: the current ``torch.get_num_threads()``
        (not the Timer's default of one thread).
    around : callable or None
        Name -> a context manager entered around each measurement of that statement (outside the
        timed span): the place for mode switches such as ``torch.inference_mode()``.
    clock : callable
        The clock the timers read (:func:`device_clock`); by default torch's, which synchronizes the
        current accelerator, if any, first.

    Returns
    -------
    dict[str, Measurement]
        Name -> the ``repeats`` measurements merged into one, in seconds per call: ``.times`` (one
        per round, in round order), ``.median``, ``.iqr``; its ``num_threads`` is the thread count used.

    Raises
    ------
    ValueError
        No statements, or a count outside its range (the message names the parameter and the value).
    """
    if not statements:
        raise ValueError("interleaved: statements is empty; give at least one name -> function to time")
    for name, value, least in (("number", number, 1), ("repeats", repeats, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"interleaved: {name} must be an integer >= {least}; got {value!r}")
    if threads is None:
        threads = torch.get_num_threads()
    elif isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"interleaved: threads must be an integer >= 1 or None (torch's count); got {threads!r}")
    names = list(statements)
    timers = {
        name: Timer("statement()", globals={"statement": fn}, timer=clock, label=name, num_threads=threads)
        for name, fn in statements.items()
    }
    kept: dict[str, list[Measurement]] = {name: [] for name in names}
    for r in range(warmup + repeats):
        start = r % len(names)
        for name in names[start:] + names[:start]:
            with around(name) if around is not None else nullcontext():
                measurement = timers[name].timeit(number)
            if r >= warmup:
                kept[name].append(measurement)
    return {name: Measurement.merge(kept[name])[0] for name in names}
