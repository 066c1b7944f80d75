"""Fixtures of the research plugin's tests (helpers: research_cases.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def cpu_kernel():
    """The ``cpu`` backend's C++ attention kernel, built and loaded once per session."""
    from kvpolicy.kernels import cpu_attention

    return cpu_attention.load()


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
