"""The codebook scheme's names where they were first defined: see :mod:`kvpolicy.formats.codebook`."""

from kvpolicy.formats.codebook import *  # noqa: F403
from kvpolicy.formats.codebook import (  # noqa: F401 - the private names tests and kernels read
    _ITERATIONS,
    _cdf,
    _erfinv,
    _pdf,
    _tables,
)
