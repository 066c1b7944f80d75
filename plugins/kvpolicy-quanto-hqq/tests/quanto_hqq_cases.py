"""Set-up shared by this plugin's test modules, imported by name: a ``conftest.py`` here would shadow the core's
``tests/conftest.py``, whose tiny models and teacher-forced decoding these tests reuse (pytest puts the core's
``tests`` on the path: ``pythonpath`` in the repository's pyproject.toml)."""

from __future__ import annotations

import pytest
from conftest import teacher_forced_logits, tiny_model
from kvpolicy_quanto_hqq import plugin

from kvpolicy import registry

__all__ = ["plugin_backends", "quanto_extension", "teacher_forced_logits", "tiny_model"]

#: the plugin's backend names
BACKENDS = ("hqq", "quanto")


@pytest.fixture(autouse=True, scope="module")
def plugin_backends():
    """Autouse in the modules that import it: every installed plugin loads by its entry point, as in a user's
    process, and this plugin's backends are registered even where its entry point is not loaded (the core's
    tests load only some plugins: tests/conftest.py); the registry is reset around each module."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(registry.DISABLE_ENV, raising=False)
        patch.delenv(registry.ALLOW_ENV, raising=False)
        registry.reset()
        if "quanto" not in registry.names("backends"):
            registry.register(plugin, "quanto-hqq")
        yield
    registry.reset()


@pytest.fixture(scope="session")
def quanto_extension():
    """Build (first run in an environment: ~40 s, needs ninja and a C++ compiler) and load quanto's CPU
    extension once per session, so its cost shows up in one fixture's setup, not in a test's time."""
    from kvpolicy_quanto_hqq.quanto_backend import QuantoBackend

    QuantoBackend().load_cpu_extension()
