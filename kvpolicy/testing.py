"""Reusable hypothesis building blocks for testing policies (needs the ``test`` extra: hypothesis)."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import example
from hypothesis import strategies as st


@st.composite
def chunkings(draw: st.DrawFn, total: int, first_nonzero: bool = False) -> list[int]:
    """Chunk sizes summing to ``total``: how a sequence of ``total`` appends may be split into calls.

    Zeros are allowed (except for the first chunk when ``first_nonzero``, e.g. to keep the prompt
    the first real append); at most about 400 chunks of at most 200.
    """
    sizes: list[int] = []
    left = total
    while left > 0:
        k = draw(st.integers(1 if first_nonzero and not sizes else 0, min(left, 200)))
        sizes.append(k)
        left -= k
        if len(sizes) > 400:  # keep draws bounded
            sizes.append(left)
            left = 0
    return sizes


def with_examples(argument: str, cases: list) -> Callable[[Callable], Callable]:
    """Decorate a ``@given`` test with ``@example(argument=case)`` for every case (edge cases that
    must always run, whatever hypothesis draws)."""

    def decorate(test: Callable) -> Callable:
        for case in cases:
            test = example(**{argument: case})(test)
        return test

    return decorate
