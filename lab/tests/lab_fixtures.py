"""Fixtures of the lab's tests, imported by the test modules that use them (``from lab_fixtures import
one_thread``): the library's tests keep theirs in tests/conftest.py, and a second ``conftest`` module
would shadow that one for ``from conftest import ...`` in the same pytest process."""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest
import torch
from hypothesis import settings

#: the repository's root (the lab's tests run from a checkout: they read its scripts and committed rows)
ROOT = Path(__file__).resolve().parents[2]

# The lab's own entry point loads (its subcommands), and the research plugin's parts where it is installed (the
# committed grids, tuning spaces and analyses name them); other installed plugins stay out of the tests.
_RESEARCH = ["research-transforms", "research-formats"] if importlib.util.find_spec("kvpolicy_research") else []
os.environ.setdefault("KVPOLICY_PLUGINS", ",".join(["kvpolicy_lab", *_RESEARCH]))

# the library's hypothesis profile (see tests/conftest.py): few, deterministic examples
settings.register_profile(
    "ci", max_examples=3, stateful_step_count=10, deadline=None, derandomize=True, database=None, print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def no_model_load(monkeypatch):
    """Every bad command must stop before a model is loaded: loading one fails the test. Use with
    ``pytestmark = pytest.mark.usefixtures("no_model_load")`` (or autouse in a module)."""
    import kvpolicy_lab.bench.decode
    import kvpolicy_lab.eval.models
    import kvpolicy_lab.eval.runner

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad value was reported")

    monkeypatch.setattr(kvpolicy_lab.eval.models, "load_smollm2", refuse)
    monkeypatch.setattr(kvpolicy_lab.eval.models, "load_model", refuse)
    monkeypatch.setattr(kvpolicy_lab.eval.runner, "open_model", refuse)
    monkeypatch.setattr(kvpolicy_lab.bench.decode, "load", refuse)


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module (restored after). Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def quanto_hqq_backends():
    """The ``quanto`` and ``hqq`` backends of the kvpolicy-quanto-hqq plugin (plugins/kvpolicy-quanto-hqq, which
    the lab's tests need installed) registered for a module, whether or not its entry point is loaded, and
    quanto's CPU extension built and loaded (its cost in this fixture's setup); the registry is reset after."""
    from kvpolicy_quanto_hqq import plugin

    from kvpolicy import registry

    if "quanto" not in registry.names("backends"):
        registry.register(plugin, "quanto-hqq")
    registry.get("backends", "quanto")().load_cpu_extension()
    yield
    registry.reset()


def write_pages() -> types.ModuleType:
    """``scripts/write_pages.py`` (the maintainer script that writes docs/results.md and docs/frontier.md),
    imported as the module ``write_pages``."""
    if "write_pages" not in sys.modules:
        spec = importlib.util.spec_from_file_location("write_pages", ROOT / "scripts" / "write_pages.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["write_pages"] = module  # its dataclass resolves its annotations through sys.modules
        spec.loader.exec_module(module)
    return sys.modules["write_pages"]
