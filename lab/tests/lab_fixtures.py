"""Fixtures of the lab's tests, imported by the test modules that use them (``from lab_fixtures import
one_thread``): the library's tests keep theirs in tests/conftest.py, and a second ``conftest`` module
would shadow that one for ``from conftest import ...`` in the same pytest process."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

# Only the lab's own entry point loads (its subcommands); other installed plugins stay out of the tests.
os.environ.setdefault("KVPOLICY_PLUGINS", "kvpolicy_lab")

# the library's hypothesis profile (see tests/conftest.py): few, deterministic examples
settings.register_profile(
    "ci", max_examples=3, stateful_step_count=10, deadline=None, derandomize=True, database=None, print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module (restored after). Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def quanto_extension():
    """Build and load quanto's CPU extension once per session (its cost in one fixture's setup)."""
    from kvpolicy.backends.quanto_backend import QuantoBackend

    QuantoBackend().load_cpu_extension()
