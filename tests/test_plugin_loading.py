"""Entry-point loading of third-party plugins (``kvpolicy.registry``), with fake installed distributions.

Each fake distribution is a real ``*.dist-info`` folder (METADATA + entry_points.txt) and a module in
a temporary folder put on ``sys.path``: ``importlib.metadata`` finds them exactly as it finds
installed packages.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvpolicy import registry
from kvpolicy.errors import ConfigError
from kvpolicy.hookspecs import hookimpl

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


HOOK_PLUGIN_HEADER = """
from dataclasses import dataclass

from kvpolicy.hookspecs import hookimpl
from kvpolicy.policies.recent import RecentWindow


@dataclass(frozen=True)
class GoodPolicy(RecentWindow):
    pass


def good_preset():
    return {"policy": "recent", "action": "evict"}
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

    def add_hook_plugin(self, dist: str, version: str, module: str, returns: dict[str, str]) -> None:
        """A plugin whose hook ``kvpolicy_register_{kind}`` returns the expression ``returns[kind]``
        (evaluated in a module defining ``GoodPolicy``, a valid policy class, and ``good_preset``)."""
        hooks = "".join(
            f"\n\n@hookimpl\ndef kvpolicy_register_{kind}():\n    return {expr}\n" for kind, expr in returns.items()
        )
        self.add(dist, version, {module: module}, {module: HOOK_PLUGIN_HEADER + hooks})


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
    site.add_policy_plugin("kvp-fake-a", "1.0", "fakeplug_a", ["twice", "only-a"])
    site.add_policy_plugin("kvp-other", "2.5", "fakeplug_b", ["twice", "only-b"])
    with pytest.raises(ConfigError) as info:
        registry.get("policies", "twice")
    message = str(info.value)
    assert "'twice'" in message and registry.ALLOW_ENV in message
    assert "kvp-fake-a 1.0" in message and "kvp-other 2.5" in message
    # the other names of both plugins, and the built-ins, still resolve
    assert registry.get("policies", "only-a").__module__ == "fakeplug_a"
    assert registry.get("policies", "only-b").__module__ == "fakeplug_b"
    assert registry.get("policies", "log").__module__ == "kvpolicy.policies.log"
    # the name is still listed (it is registered), but has no single entry
    assert "twice" in registry.names("policies")
    assert "twice" not in [name for name, _, _ in registry.entries("policies")]
    (conflict,) = registry.conflicts()
    assert (conflict.kind, conflict.name) == ("policies", "twice")
    assert [(s.distribution, s.version) for s in conflict.sources] == [("kvp-fake-a", "1.0"), ("kvp-other", "2.5")]
    assert registry.conflicts("actions") == []


def test_name_registered_three_times_names_every_distribution(site):
    for letter in "abc":
        site.add_policy_plugin(f"kvp-fake-{letter}", "1.0", f"fakeplug_{letter}", ["thrice"])
    with pytest.raises(
        ConfigError, match=r"registered 3 times: by kvp-fake-a 1\.0 .* by kvp-fake-b 1\.0 .* by kvp-fake-c"
    ):
        registry.get("policies", "thrice")


def test_plugin_taking_a_builtin_name_is_an_error_naming_kvpolicy(site):
    import kvpolicy

    site.add_policy_plugin("kvp-fake-a", "0.9", "fakeplug_a", ["log", "fake-a"])
    with pytest.raises(ConfigError) as info:
        registry.get("policies", "log")
    assert f"kvpolicy {kvpolicy.__version__} (built in)" in str(info.value)
    assert "kvp-fake-a 0.9" in str(info.value)
    # every other name resolves: the other built-ins, and the plugin's other names
    from kvpolicy import CompressedCache

    assert CompressedCache(policy="recent", window=4, action="evict").policy.window == 4
    assert CompressedCache(policy="fake-a", window=3, action="evict").policy.window == 3
    assert registry.get("presets", "kivi") is not None
    with pytest.raises(ConfigError, match="registered twice"):
        CompressedCache(policy="log", action="evict")


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


def _bad_plugin_warnings(caught: pytest.WarningsRecorder, plugin: str) -> list[str]:
    return [
        str(w.message) for w in caught if issubclass(w.category, registry.PluginWarning) and plugin in str(w.message)
    ]


#: id -> (hook kind, the expression the hook returns, a regex of the problem the warning must state)
MALFORMED = {
    "hook-returns-none": ("policies", "None", r"kvpolicy_register_policies returned None \(NoneType\), not a dict"),
    "hook-returns-list": (
        "policies",
        "[GoodPolicy]",
        r"kvpolicy_register_policies returned \[<class .*GoodPolicy'>\] \(list\), not a dict",
    ),
    "hook-returns-str": (
        "actions",
        "'evict'",
        r"kvpolicy_register_actions returned 'evict' \(str\), not a dict \{name: Action subclass\}",
    ),
    "preset-str": (
        "presets",
        "{'bad-preset': 'not a function'}",
        r"'bad-preset': 'not a function' \(str\) is not callable",
    ),
    "preset-none": ("presets", "{'bad-preset': None}", r"'bad-preset': None \(NoneType\) is not callable"),
    "policy-not-subclass": (
        "policies",
        "{'bad': object}",
        r"'bad': class builtins\.object is not a subclass of kvpolicy\.policies\.base\.Policy",
    ),
    "policy-instance": ("policies", "{'bad': GoodPolicy()}", r"'bad': GoodPolicy\(.*\) \(GoodPolicy\) is not a class"),
    "action-wrong-base": (
        "actions",
        "{'bad': GoodPolicy}",
        r"'bad': class fakeplug_bad\.GoodPolicy is not a subclass of kvpolicy\.actions\.base\.Action",
    ),
    "backend-not-class": (
        "backends",
        "{'bad': 'torch'}",
        r"'bad': 'torch' \(str\) is not a class; expected a subclass of kvpolicy\.backends\.base\.Backend",
    ),
    "name-int": ("policies", "{3: GoodPolicy}", r"returned the name 3 \(int\); a name must be a non-empty string"),
    "name-empty": ("presets", "{'': good_preset}", r"returned the name '' \(str\); a name must be a non-empty string"),
}


@pytest.mark.parametrize(("kind", "returned", "problem"), list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_registration_warns_once_and_the_others_work(site, kind, returned, problem):
    site.add_policy_plugin("kvp-fake-a", "1.0", "fakeplug_a", ["fake-a"])
    # the bad return comes with good names: the plugin is skipped as a whole, none of them registered
    returns = {"policies": "{'bad-good': GoodPolicy}", "presets": "{'bad-good-preset': good_preset}", kind: returned}
    site.add_hook_plugin("kvp-bad", "0.3", "fakeplug_bad", returns)
    with pytest.warns(registry.PluginWarning) as caught:
        policies = registry.names("policies")
        presets = registry.names("presets")
        registry.get("policies", "fake-a")  # later lookups do not warn again
    (message,) = _bad_plugin_warnings(caught, "fakeplug_bad")
    assert message.startswith("kvpolicy plugin 'kvp-bad:fakeplug_bad' from kvp-bad 0.3 (entry point 'fakeplug_bad'")
    assert re.search(problem, message), message
    assert "fake-a" in policies and "log" in policies and "kivi" in presets
    assert "bad-good" not in policies and "bad-good-preset" not in presets
    assert not {"bad", "bad-preset"} & {name for kind in registry.KINDS for name in registry.names(kind)}
    from kvpolicy import CompressedCache

    assert CompressedCache(policy="fake-a", window=2, action="evict").policy.window == 2
    assert CompressedCache.from_preset("kivi").policy is not None
    with pytest.raises(ConfigError, match=r"unknown policy 'bad-good'"):
        registry.get("policies", "bad-good")


def test_malformed_plugin_warning_lists_every_problem(site):
    site.add_hook_plugin(
        "kvp-bad", "0.3", "fakeplug_bad", {"policies": "{'p': object, 7: GoodPolicy}", "presets": "[]"}
    )
    with pytest.warns(registry.PluginWarning) as caught:
        registry.names("policies")
    (message,) = _bad_plugin_warnings(caught, "fakeplug_bad")
    assert "'p': class builtins.object is not a subclass" in message
    assert "the name 7 (int)" in message
    assert "kvpolicy_register_presets returned [] (list), not a dict" in message


def test_malformed_run_time_plugin_warns_naming_it(site):
    class Plugin:
        @hookimpl
        def kvpolicy_register_presets(self):
            return {"run-time-preset": 42}

    registry.register(Plugin(), name="my-run-time-plugin")
    with pytest.warns(
        registry.PluginWarning, match=r"'my-run-time-plugin' from my-run-time-plugin \(registered at run time\)"
    ):
        assert "run-time-preset" not in registry.names("presets")
    assert "kivi" in registry.names("presets")


def test_malformed_builtins_are_a_bug_not_a_warning(site, monkeypatch):
    from kvpolicy import builtins

    monkeypatch.setattr(builtins, "kvpolicy_register_presets", hookimpl(lambda: {"broken": 1}))
    registry.reset()
    with pytest.raises(TypeError, match=r"built-in registrations are malformed: .*'broken': 1 \(int\) is not callable"):
        registry.names("policies")


def test_unknown_kind_is_a_config_error_naming_the_kinds(site):
    kinds = (
        r"\['policies', 'actions', 'backends', 'transforms', 'presets', 'formats', 'codecs', 'commands', "
        r"'model_presets'\]"
    )
    with pytest.raises(ConfigError, match=rf"kind must be one of {kinds}; got kind='policy'"):
        registry.get("policy", "log")


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


def _conflict_section(out: str) -> list[str]:
    """The lines of the "conflicts" section (header first) of ``kvpolicy list`` or ``kvpolicy plugins``."""
    lines = out.splitlines()
    (start,) = [i for i, line in enumerate(lines) if line.startswith("conflicts")]
    return lines[start:]


@pytest.mark.parametrize("command", ["list", "plugins"])
def test_cli_lists_run_and_show_a_builtin_name_conflict(site, capsys, command):
    import kvpolicy
    from kvpolicy.cli import main

    site.add_policy_plugin("kvp-fake-a", "0.9", "fakeplug_a", ["log", "fake-a"])
    site.add_policy_plugin("kvp-fake-b", "2.1", "fakeplug_b", ["fake-b"])
    site.add_policy_plugin("kvp-fake-c", "3.4", "fakeplug_c", ["fake-b"])
    assert main([command]) == 0
    out = capsys.readouterr().out
    header, *rows = _conflict_section(out)
    assert registry.ALLOW_ENV in header
    assert rows == [
        "  policy name 'fake-b' is registered twice: by kvp-fake-b 2.1 (entry point 'fakeplug_b' = fakeplug_b) "
        "and by kvp-fake-c 3.4 (entry point 'fakeplug_c' = fakeplug_c)",
        f"  policy name 'log' is registered twice: by kvpolicy {kvpolicy.__version__} (built in) "
        f"and by kvp-fake-a 0.9 (entry point 'fakeplug_a' = fakeplug_a)",
    ]
    listed = out.split("conflicts")[0]
    assert "fake-a" in listed and "recent" in listed and "quantize" in listed and "kivi" in listed


def test_cli_plugins_lists_the_other_parts_of_a_conflicting_plugin(site, capsys):
    from kvpolicy.cli import main

    site.add_policy_plugin("kvp-fake-a", "0.9", "fakeplug_a", ["log", "fake-a"])
    assert main(["plugins"]) == 0
    rows = _table(capsys.readouterr().out)
    assert rows[("policies", "fake-a")][:2] == ["kvp-fake-a", "0.9"]
    assert rows[("policies", "recent")][0] == "kvpolicy"
    assert ("policies", "log") not in rows  # no single owner: shown under conflicts only


def test_cli_without_conflicts_prints_no_conflict_section(site, capsys):
    from kvpolicy.cli import main

    site.add_policy_plugin("kvp-fake-a", "1.0", "fakeplug_a", ["fake-a"])
    for command in ("list", "plugins"):
        assert main([command]) == 0
        assert "conflicts" not in capsys.readouterr().out


def test_cli_list_with_a_malformed_plugin_runs_and_warns(site):
    site.add_policy_plugin("kvp-fake-a", "1.0", "fakeplug_a", ["fake-a"])
    site.add_hook_plugin("kvp-bad", "0.3", "fakeplug_bad", {"presets": "{'bad-preset': 'x'}"})
    env = {k: v for k, v in __import__("os").environ.items() if k not in (registry.DISABLE_ENV, registry.ALLOW_ENV)}
    env["PYTHONPATH"] = str(site.root)
    for command in ("list", "plugins"):
        code = f"import sys; from kvpolicy.cli import main; sys.exit(main([{command!r}]))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        assert out.returncode == 0, out.stderr
        assert "fake-a" in out.stdout and "bad-preset" not in out.stdout
        assert "PluginWarning: kvpolicy plugin 'kvp-bad:fakeplug_bad' from kvp-bad 0.3" in out.stderr
        assert "'bad-preset': 'x' (str) is not callable" in out.stderr
