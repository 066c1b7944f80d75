"""The plugin as a user meets it: registered through its entry point, listed by ``kvpolicy list`` with each
backend's own usability, and loading neither library before a cache uses its backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvpolicy_quanto_hqq.hqq_backend import HQQBackend
from kvpolicy_quanto_hqq.quanto_backend import QuantoBackend
from quanto_hqq_cases import BACKENDS, plugin_backends  # noqa: F401

from kvpolicy import registry
from kvpolicy.backends import _optional
from kvpolicy.backends.base import Usability
from kvpolicy.commands.list import backend_lines


def test_the_entry_point_registers_both_backends():
    """In a process that loads every installed plugin, as a user's does."""
    code = (
        "import json; from kvpolicy import registry\n"
        "print(json.dumps({n: registry.provider('backends', n) for n in ('quanto', 'hqq')}))"
    )
    env = {k: v for k, v in os.environ.items() if k not in (registry.DISABLE_ENV, registry.ALLOW_ENV)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == {"quanto": "kvpolicy-quanto-hqq", "hqq": "kvpolicy-quanto-hqq"}


def test_looking_the_backends_up_imports_neither_library():
    code = (
        "import json, sys; from kvpolicy import registry\n"
        "classes = [registry.get('backends', n).__name__ for n in ('quanto', 'hqq')]\n"
        "print(json.dumps([classes, [m for m in ('optimum.quanto', 'hqq') if m in sys.modules]]))"
    )
    env = {k: v for k, v in os.environ.items() if k not in (registry.DISABLE_ENV, registry.ALLOW_ENV)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == [["QuantoBackend", "HQQBackend"], []]


def test_each_backend_states_its_usability_and_list_shows_it(monkeypatch):
    lines = {line.split()[0]: line.split(None, 1)[1] for line in backend_lines()[1:-1]}
    assert lines["hqq"] == "yes" and HQQBackend.usability() == Usability(True)
    assert lines["quanto"] == (
        "yes" if _optional.ninja() else "yes  CUDA/MPS tensors only: CPU tensors need ninja (pip install ninja)"
    )
    # without ninja quanto runs on GPU tensors only; without its library neither runs, and the note says what
    # to install
    from kvpolicy_quanto_hqq import hqq_backend, quanto_backend

    monkeypatch.setattr(quanto_backend, "ninja", lambda: False)
    assert QuantoBackend.usability() == Usability(
        True, "CUDA/MPS tensors only: CPU tensors need ninja (pip install ninja)"
    )
    monkeypatch.setattr(quanto_backend, "installed", lambda module: module != "optimum.quanto")
    monkeypatch.setattr(hqq_backend, "installed", lambda module: module != "hqq")
    install = "pip install ./plugins/kvpolicy-quanto-hqq"
    assert QuantoBackend.usability() == Usability(False, f"needs the optimum-quanto package: {install}")
    assert HQQBackend.usability() == Usability(False, f"needs the hqq package: {install}")
    lines = {line.split()[0]: line.split(None, 1)[1] for line in backend_lines()[1:-1]}
    assert lines["hqq"] == f"no   needs the hqq package: {install}"
    assert set(BACKENDS) <= set(lines)
