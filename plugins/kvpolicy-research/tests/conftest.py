"""Fixtures of the research plugin's tests (helpers: research_cases.py)."""

from __future__ import annotations

import pytest
import torch

from kvpolicy import registry


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


@pytest.fixture(autouse=True, scope="module")
def installed_plugins():
    """Every installed plugin loads by its entry point, as in a user's process (kvpolicy's own tests load
    none but the lab's: tests/conftest.py), this plugin included; the registry is reset around each module."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(registry.DISABLE_ENV, raising=False)
        patch.delenv(registry.ALLOW_ENV, raising=False)
        registry.reset()
        yield
    registry.reset()
