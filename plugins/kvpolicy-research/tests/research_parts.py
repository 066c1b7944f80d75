"""Set-up shared by the research plugin's test modules, imported by name (a ``conftest.py`` here would shadow
the core's ``tests/conftest.py``, which the core's tests import as ``conftest``)."""

from __future__ import annotations

import pytest
import torch
from kvpolicy_research import formats_plugin

from kvpolicy import registry


def ensure_registered() -> None:
    """Register the plugin's formats and codecs unless the registry holds them already (a lookup first, so
    that an installed plugin loads by its entry point before this decides)."""
    if "lattice" not in registry.names("formats") and not registry.plugin_manager().is_registered(formats_plugin):
        registry.register(formats_plugin, "research-formats")


@pytest.fixture(autouse=True, scope="module")
def research_parts():
    """Autouse in the modules that import it: every installed plugin loads by its entry point, as in a user's
    process (kvpolicy's own tests load none but the lab's and this one's transforms: tests/conftest.py), and
    the plugin's formats are registered even where it is not installed; the registry is reset around each
    module."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(registry.DISABLE_ENV, raising=False)
        patch.delenv(registry.ALLOW_ENV, raising=False)
        registry.reset()
        ensure_registered()
        yield
    registry.reset()


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
