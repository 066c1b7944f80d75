"""Entry-point loading of third-party plugins (``kvpolicy.registry``), with fake installed distributions.

Each fake distribution is a real ``*.dist-info`` folder (METADATA + entry_points.txt) and a module in
a temporary folder put on ``sys.path``: ``importlib.metadata`` finds them exactly as it finds
installed packages.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvpolicy import registry
from kvpolicy.errors import ConfigError

PLUGIN_SOURCE = """
from dataclasses import dataclass

from kvpolicy.hookspecs import hookimpl
from kvpolicy.policies.recent import RecentWindow


@dataclass(frozen=True)
class {cls}(RecentWindow):
    pass


@hookimpl
def kvpolicy_register_policies():
    return {{{names}}}
"""


class FakeSite:
    """A temporary site folder holding fake distributions."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.modules: list[str] = []
        monkeypatch.syspath_prepend(str(root))

    def add(self, dist: str, version: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
        (info / "entry_points.txt").write_text(f"[kvpolicy]\n{lines}")
        for module, source in modules.items():
            (self.root / f"{module}.py").write_text(textwrap.dedent(source))
            self.modules.append(module)

    def add_policy_plugin(self, dist: str, version: str, module: str, policy_names: list[str]) -> None:
        names = ", ".join(f"{n!r}: {module.title()}Policy" for n in policy_names)
        source = PLUGIN_SOURCE.format(cls=f"{module.title()}Policy", names=names)
        self.add(dist, version, {module: module}, {module: source})


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.delenv(registry.DISABLE_ENV, raising=False)
    monkeypatch.delenv(registry.ALLOW_ENV, raising=False)
    fake = FakeSite(tmp_path, monkeypatch)
    registry.reset()
    yield fake
    registry.reset()
    for module in fake.modules:
        sys.modules.pop(module, None)


def test_entry_points_load_lazily_on_first_lookup(site):
    site.add_policy_plugin("kvp-fake-a", "1.2.3", "fakeplug_a", ["fake-a"])
    import kvpolicy.cache  # noqa: F401 - importing kvpolicy (even the cache) loads no plugin

    registry.plugin_manager()
    assert "fakeplug_a" not in sys.modules
    assert "fake-a" in registry.names("policies")
    assert "fakeplug_a" in sys.modules
    (entry,) = [e for e in registry.entries("policies") if e[0] == "fake-a"]
    assert (entry[2].distribution, entry[2].version) == ("kvp-fake-a", "1.2.3")
    assert entry[1].__module__ == "fakeplug_a"
    # the built-ins are still there, attributed to kvpolicy
    (log,) = [e for e in registry.entries("policies") if e[0] == "log"]
    assert log[2].distribution == "kvpolicy"


def test_cache_accepts_a_plugin_policy_by_name(site):
    site.add_policy_plugin("kvp-fake-a", "1.0", "fakeplug_a", ["fake-a"])
    from kvpolicy import CompressedCache

    cache = CompressedCache(policy="fake-a", window=3, action="evict")
    assert type(cache.policy).__module__ == "fakeplug_a" and cache.policy.window == 3


def test_disable_env_loads_nothing(site, monkeypatch):
    site.add_policy_plugin("kvp-fake-a", "1.0", "fakeplug_a", ["fake-a"])
    monkeypatch.setenv(registry.DISABLE_ENV, "1")
    assert "fake-a" not in registry.names("policies")
    assert "fakeplug_a" not in sys.modules
    assert "log" in registry.names("policies")
    # "0" and "" mean not disabled
    for value in ("0", ""):
        monkeypatch.setenv(registry.DISABLE_ENV, value)
        registry.reset()
        assert "fake-a" in registry.names("policies")


def test_allow_list_env_loads_only_named_entry_points(site, monkeypatch):
    site.add_policy_plugin("kvp-fake-a", "1.0", "fakeplug_a", ["fake-a"])
    site.add_policy_plugin("kvp-fake-b", "1.0", "fakeplug_b", ["fake-b"])
    site.add_policy_plugin("kvp-fake-c", "1.0", "fakeplug_c", ["fake-c"])
    monkeypatch.setenv(registry.ALLOW_ENV, "fakeplug_a, fakeplug_c")
    names = registry.names("policies")
    assert "fake-a" in names and "fake-c" in names and "fake-b" not in names
    assert "fakeplug_b" not in sys.modules


def test_allow_list_naming_a_missing_entry_point_warns(site, monkeypatch):
    site.add_policy_plugin("kvp-fake-a", "1.0", "fakeplug_a", ["fake-a"])
    monkeypatch.setenv(registry.ALLOW_ENV, "fakeplug_a,nosuchplugin")
    with pytest.warns(registry.PluginWarning, match="nosuchplugin"):
        names = registry.names("policies")
    assert "fake-a" in names


def test_duplicate_name_names_both_distributions(site):
    site.add_policy_plugin("kvp-fake-a", "1.0", "fakeplug_a", ["twice"])
    site.add_policy_plugin("kvp-other", "2.5", "fakeplug_b", ["twice"])
    with pytest.raises(ConfigError) as info:
        registry.names("policies")
    message = str(info.value)
    assert "'twice'" in message
    assert "kvp-fake-a 1.0" in message and "kvp-other 2.5" in message


def test_plugin_taking_a_builtin_name_is_an_error_naming_kvpolicy(site):
    import kvpolicy

    site.add_policy_plugin("kvp-fake-a", "0.9", "fakeplug_a", ["log"])
    with pytest.raises(ConfigError) as info:
        registry.get("policies", "log")
    assert f"kvpolicy {kvpolicy.__version__} (built in)" in str(info.value)
    assert "kvp-fake-a 0.9" in str(info.value)


def test_broken_plugin_warns_and_the_others_work(site):
    site.add_policy_plugin("kvp-fake-a", "1.0", "fakeplug_a", ["fake-a"])
    site.add("kvp-broken", "0.1", {"broken": "fakeplug_broken"}, {"fakeplug_broken": "import no_such_module_xyz\n"})
    with pytest.warns(registry.PluginWarning) as caught:
        names = registry.names("policies")
    messages = [str(w.message) for w in caught]
    assert any("'broken'" in m and "kvp-broken 0.1" in m and "no_such_module_xyz" in m for m in messages)
    assert "fake-a" in names and "log" in names
    from kvpolicy import CompressedCache

    assert CompressedCache(policy="fake-a", window=2, action="evict").policy.window == 2


def test_plugin_whose_hook_raises_warns_and_the_others_work(site):
    site.add_policy_plugin("kvp-fake-a", "1.0", "fakeplug_a", ["fake-a"])
    lazy = """
    from kvpolicy.hookspecs import hookimpl

    @hookimpl
    def kvpolicy_register_actions():
        return {"lazy-action": object}

    @hookimpl
    def kvpolicy_register_policies():
        from no_such_module_lazy import Policy  # the usual lazy import inside the hook, broken
        return {"lazy": Policy}
    """
    site.add("kvp-lazy", "3.0", {"lazy": "fakeplug_lazy"}, {"fakeplug_lazy": lazy})
    with pytest.warns(registry.PluginWarning, match=r"'kvp-lazy:lazy'.*kvp-lazy 3\.0.*no_such_module_lazy"):
        names = registry.names("policies")
    assert "fake-a" in names and "lazy" not in names
    assert "lazy-action" not in registry.names("actions")  # nothing of a failed plugin is half-registered


def test_import_kvpolicy_imports_no_plugin_in_a_fresh_interpreter(site):
    site.add_policy_plugin("kvp-fake-a", "1.0", "fakeplug_a", ["fake-a"])
    code = (
        "import sys, kvpolicy, kvpolicy.registry as r; print('fakeplug_a' in sys.modules); "
        "print('fake-a' in r.names('policies')); print('fakeplug_a' in sys.modules)"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k not in (registry.DISABLE_ENV, registry.ALLOW_ENV)}
    env["PYTHONPATH"] = str(site.root)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["False", "True", "True"]


# --------------------------------------------------------------------------------------------------
# kvpolicy plugins
# --------------------------------------------------------------------------------------------------


def _table(out: str) -> dict[tuple[str, str], list[str]]:
    """``(kind, name) -> [distribution, version, object, origin...]`` from the command's output."""
    rows, kind = {}, ""
    for line in out.splitlines():
        if line.endswith(":") and not line.startswith(" "):
            kind = line[:-1]
        elif line.startswith("  "):
            name, *rest = line.split()
            rows[(kind, name)] = rest
    return rows


def test_cli_plugins_lists_every_part_with_its_distribution(site, capsys):
    import kvpolicy
    from kvpolicy.cli import main

    site.add_policy_plugin("kvp-fake-a", "1.2.3", "fakeplug_a", ["fake-a", "fake-a2"])
    assert main(["plugins"]) == 0
    rows = _table(capsys.readouterr().out)
    assert rows[("policies", "fake-a")][:3] == ["kvp-fake-a", "1.2.3", "fakeplug_a.Fakeplug_APolicy"]
    assert rows[("policies", "fake-a")][3:] == ["entry", "point", "'fakeplug_a'", "=", "fakeplug_a"]
    assert rows[("policies", "fake-a2")][:2] == ["kvp-fake-a", "1.2.3"]
    for kind in registry.KINDS:  # every registered name is listed under its kind
        for name in registry.names(kind):
            assert (kind, name) in rows
    assert rows[("policies", "log")] == [
        "kvpolicy",
        kvpolicy.__version__,
        "kvpolicy.policies.log.LogWindow",
        "built",
        "in",
    ]
    assert rows[("actions", "quantize")][:2] == ["kvpolicy", kvpolicy.__version__]
    assert rows[("backends", "torch")][:2] == ["kvpolicy", kvpolicy.__version__]
    assert rows[("presets", "logquant")][:3] == ["kvpolicy", kvpolicy.__version__, "kvpolicy.presets.logquant"]


def test_cli_plugins_says_when_autoload_is_off(site, capsys, monkeypatch):
    from kvpolicy.cli import main

    site.add_policy_plugin("kvp-fake-a", "1.2.3", "fakeplug_a", ["fake-a"])
    monkeypatch.setenv(registry.DISABLE_ENV, "1")
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"entry-point plugins not loaded: {registry.DISABLE_ENV} is set"
    rows = _table(out)
    assert ("policies", "log") in rows and ("policies", "fake-a") not in rows
