"""The backend contract: the public check (:func:`kvpolicy.testing.check_backend`) on the core's backends, the
documented capability table, each backend's own usability (``kvpolicy list``), and the backends that plugins
register (the core names none of their modules; without the plugin, asking for one names it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import core_lines_matching

from kvpolicy import CompressedCache, registry
from kvpolicy.backends.base import Backend, Usability
from kvpolicy.errors import ConfigError


def test_docs_capability_table_matches_the_code():
    text = (Path(__file__).resolve().parents[1] / "docs" / "explanation" / "backends.md").read_text()
    table = text.split("<!-- capabilities -->\n", 1)[1].split("<!-- /capabilities -->", 1)[0]
    rows = {}
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1:]
    registered = registry.names("backends")
    assert set(registered) <= set(rows)
    for name, cells in rows.items():
        if name not in registered:  # a plugin's backend, not installed here: the table says which plugin
            assert name in registry.MOVED["backends"], name
            continue
        caps = registry.get("backends", name).capabilities
        assert cells == [
            ", ".join(map(str, caps.bits)),
            ", ".join(caps.axes),
            str(caps.group_size_multiple),
            ", ".join(caps.devices),
            ", ".join(str(d).removeprefix("torch.") for d in caps.dtypes),
            ", ".join(caps.meta_dtypes),
            "yes" if caps.fused else "no",
        ], name


# --------------------------------------------------------------------------------------------------
# the public contract check, on every built-in backend that runs here
# --------------------------------------------------------------------------------------------------

#: built-in backend -> how check_backend compares its reconstruction with the reference (see its docstring)
CONTRACT = {"torch": "minmax", "cpu": "minmax"}


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_builtin_backends_pass_check_backend(name, cpu_kernel):
    from kvpolicy.testing import check_backend

    check_backend(registry.get("backends", name)(), bound=CONTRACT[name])


def test_triton_interpreted_passes_check_backend(monkeypatch):
    """Every format the triton backend declares (min-max groups at each width and axis, codebook indices at
    each width with 16-bit and one-byte scales), under the interpreter."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kvpolicy.backends.triton_backend import TritonBackend
    from kvpolicy.formats import Codebook, MinMax
    from kvpolicy.testing import backend_formats, check_backend

    be = TritonBackend()
    declared = backend_formats(be)
    assert {MinMax(b, 32, a) for b in (2, 3, 4, 8) for a in ("token", "channel")} <= set(declared)
    assert {Codebook(b, norm_bits=n) for b in (2, 3, 4) for n in (8, 16)} <= set(declared)
    check_backend(be)


def test_a_broken_backend_fails_check_backend():
    """A backend whose attention kernel drops a term, and one whose dequantize is off by a step, fail."""
    from kvpolicy.backends.torch_backend import TorchBackend
    from kvpolicy.formats import MinMax, PackedTensor
    from kvpolicy.testing import check_backend

    class WrongLse(TorchBackend):
        name = "wrong-lse"

        def _attend(self, query, keys, values, scale):
            out, lse = self.attend_without_kernel(query, keys, values, scale)
            return out, lse + 0.1

        attention_kernels = {(PackedTensor, PackedTensor): _attend}  # noqa: RUF012

    class OffByAStep(TorchBackend):
        name = "off-by-a-step"

        def _dequantize(self, q):
            return (q.dequantize().float() + 2 * q.scales.float().amax()).to(q.dtype)

        dequantizers = {PackedTensor: _dequantize}  # noqa: RUF012

    formats = [MinMax(4, 32, "channel"), MinMax(4, 32, "token")]
    with pytest.raises(AssertionError, match=r"backend 'wrong-lse': attend over keys"):
        check_backend(WrongLse(), formats=formats)
    with pytest.raises(AssertionError, match=r"backend 'off-by-a-step'.*more than one step"):
        check_backend(OffByAStep(), formats=formats)


# --------------------------------------------------------------------------------------------------
# backends from plugins
# --------------------------------------------------------------------------------------------------

#: what would name the modules of the quanto and hqq backends (plugins/kvpolicy-quanto-hqq) or their libraries
PLUGIN_MODULES = re.compile(r"quanto_backend|hqq_backend|kvpolicy_quanto_hqq|optimum\.quanto|hqq\.core|import hqq")


def test_no_core_module_names_the_quanto_or_hqq_modules():
    hits = core_lines_matching(PLUGIN_MODULES)
    assert not hits, "core modules name the quanto/hqq plugin's modules:\n" + "\n".join(hits)


def test_the_core_registers_neither_quanto_nor_hqq():
    from kvpolicy import builtins

    assert not {"quanto", "hqq"} & set(builtins.kvpolicy_register_backends())


@pytest.mark.parametrize("name", sorted(registry.MOVED["backends"]))
def test_a_backend_of_a_plugin_not_installed_names_the_plugin(monkeypatch, name):
    """As without the plugin: the name is not registered, and the lookup's error says what to install."""
    monkeypatch.setattr(registry, "_collect", _without(registry._collect, name))
    with pytest.raises(ConfigError, match=r"unknown backend") as info:
        CompressedCache(policy="log", bits=2, backend=name)
    message = str(info.value)
    assert message.endswith(
        f"(backend {name!r} comes from the plugin kvpolicy-quanto-hqq: pip install ./plugins/kvpolicy-quanto-hqq)"
    )
    # a name no plugin registers gets no such note
    with pytest.raises(ConfigError) as other:
        CompressedCache(policy="log", bits=2, backend="no-such-backend")
    assert "plugin" not in str(other.value)


def _without(collect, name):
    """``registry._collect`` with the backend ``name`` dropped from the tables it returns (a copy)."""

    def collect_without():
        tables = collect()
        copy = registry._Tables(dict(tables.parts), dict(tables.conflicts))
        copy.parts["backends"] = {n: v for n, v in tables.parts["backends"].items() if n != name}
        return copy

    return collect_without


# --------------------------------------------------------------------------------------------------
# usability: each backend says whether it runs here
# --------------------------------------------------------------------------------------------------


def test_the_default_usability_constructs_the_backend():
    class Fine(Backend):
        name = "fine"

    class Refuses(Backend):
        name = "refuses"

        def __init__(self):
            raise ConfigError("needs the thing: pip install thing")

    class Breaks(Backend):
        name = "breaks"

        def __init__(self):
            raise RuntimeError("boom")

    assert Fine.usability() == Usability(True)
    assert Refuses.usability() == Usability(False, "needs the thing: pip install thing")
    assert Breaks.usability() == Usability(False, "constructing it raised RuntimeError: boom")


def test_usability_is_validated():
    with pytest.raises(ConfigError, match=r"usable must be True or False; got usable='yes'"):
        Usability("yes")
    with pytest.raises(ConfigError, match=r"note must be a string; got note=3"):
        Usability(True, 3)


def test_list_shows_a_plugin_backends_own_usability_and_survives_a_broken_one(monkeypatch):
    """A backend registered by a plugin states its usability on its class; one whose check raises, or returns
    something else, is shown as not usable with the reason, and the other lines are still printed."""
    from kvpolicy.commands.list import backend_lines
    from kvpolicy.hookspecs import hookimpl

    class OwnCheck(Backend):
        name = "own-check"

        @classmethod
        def usability(cls):
            return Usability(False, "needs the frobnicator: pip install frob")

    class RaisingCheck(Backend):
        name = "raising-check"

        @classmethod
        def usability(cls):
            raise OSError("disk on fire")

    class WrongCheck(Backend):
        name = "wrong-check"

        @classmethod
        def usability(cls):
            return True

    class Plugin:
        @hookimpl
        def kvpolicy_register_backends(self):
            return {cls.name: cls for cls in (OwnCheck, RaisingCheck, WrongCheck)}

    plugin = Plugin()
    registry.register(plugin, "usability-checks")
    try:
        lines = {line.split()[0]: line for line in backend_lines()[1:-1]}
    finally:
        registry.unregister(plugin)
    assert lines["own-check"].split(None, 1)[1] == "no   needs the frobnicator: pip install frob"
    assert "its usability check raised OSError: disk on fire" in lines["raising-check"]
    assert "its usability check returned True, not a kvpolicy.backends.base.Usability" in lines["wrong-check"]
    assert lines["torch"].split(None, 1)[1] == "yes"
