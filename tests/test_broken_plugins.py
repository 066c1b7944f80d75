"""A broken plugin of any kind never takes the command line down: it is skipped with a warning naming it, and
``kvpolicy --version``, ``kvpolicy list``, ``kvpolicy plugins`` and every other command still run.

A command plugin is broken when its ``register(subparsers)`` raises, adds a subcommand whose name another
command has, adds no subcommand of its name (or others beside it), or sets no ``func`` to run; a plugin of
any kind when its hook raises, returns something malformed, or registers a name another plugin (or kvpolicy)
registers too.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_command_plugins import no_plugins  # noqa: F401  (the fixture: only the built-ins)
from test_plugin_loading import FakeSite

import kvpolicy
from kvpolicy import registry
from kvpolicy.cli import build_parser, main
from kvpolicy.hookspecs import hookimpl


def _runs(sub) -> None:
    p = sub.add_parser("good", help="fine")
    p.set_defaults(func=lambda args: 0)


#: id -> (the plugin's ``register(sub)``, a regex of the problem its warning names)
BROKEN_COMMANDS = {
    "register-raises": (lambda sub: 1 / 0, r"register\(subparsers\) raised ZeroDivisionError: division by zero"),
    "reuses-a-core-name": (
        lambda sub: sub.add_parser("list").set_defaults(func=lambda args: 0),
        r"raised ArgumentError: argument COMMAND: conflicting subparser: list",
    ),
    "adds-nothing": (lambda sub: None, r"added no subcommand named 'broken'"),
    "adds-another-name": (
        lambda sub: sub.add_parser("other").set_defaults(func=lambda args: 0),
        r"added no subcommand named 'broken'",
    ),
    "adds-one-more": (
        lambda sub: [sub.add_parser(n).set_defaults(func=lambda args: 0) for n in ("broken", "extra")],
        r"also added \['extra'\], which are not its name",
    ),
    "sets-no-func": (lambda sub: sub.add_parser("broken", help="no func"), r"sets no func to run"),
    "a-subcommand-sets-no-func": (
        lambda sub: _nested(sub, with_func=("a",)),
        r"sets no func to run",
    ),
    "raises-after-adding": (lambda sub: (sub.add_parser("broken", help="half"), 1 / 0), r"raised ZeroDivisionError"),
}


def _nested(sub, with_func: tuple[str, ...]) -> None:
    """``broken a`` and ``broken b``: only those named in ``with_func`` set one."""
    inner = sub.add_parser("broken").add_subparsers(dest="what", required=True)
    for name in ("a", "b"):
        p = inner.add_parser(name)
        if name in with_func:
            p.set_defaults(func=lambda args: 0)


def _plugin(register):
    class Plugin:
        @hookimpl
        def kvpolicy_register_commands(self):
            return {"broken": register}

    return Plugin()


@pytest.mark.parametrize(("register", "problem"), list(BROKEN_COMMANDS.values()), ids=list(BROKEN_COMMANDS))
@pytest.mark.usefixtures("no_plugins")
def test_a_broken_command_plugin_is_skipped_and_every_command_runs(capsys, register, problem):
    registry.register(_plugin(register), name="broken-cmd")
    warning = rf"kvpolicy command 'broken' from broken-cmd .* skipped: .*{problem}"
    with pytest.warns(registry.PluginWarning, match=warning):
        parser = build_parser()
    assert "broken" not in parser.format_help() and "extra" not in parser.format_help()
    with pytest.warns(registry.PluginWarning), pytest.raises(SystemExit) as version:
        main(["--version"])
    assert version.value.code == 0 and capsys.readouterr().out == f"kvpolicy {kvpolicy.__version__}\n"
    for command in (["list"], ["plugins"]):
        with pytest.warns(registry.PluginWarning):
            assert main(command) == 0
        assert "policies" in capsys.readouterr().out
    with pytest.warns(registry.PluginWarning), pytest.raises(SystemExit) as refused:
        main(["broken"])
    assert refused.value.code == 2 and "invalid choice: 'broken'" in capsys.readouterr().err


@pytest.mark.usefixtures("no_plugins")
def test_a_nested_plugin_command_with_every_func_set_joins():
    registry.register(_plugin(lambda sub: _nested(sub, with_func=("a", "b"))), name="nested-cmd")
    assert main(["broken", "b"]) == 0


@pytest.mark.usefixtures("no_plugins")
def test_a_command_name_two_plugins_register_reports_the_conflict_when_run(capsys):
    class Mine:
        @hookimpl
        def kvpolicy_register_commands(self):
            return {"list": _runs}

    registry.register(Mine(), name="my-list")
    assert main(["plugins"]) == 0
    assert "command name 'list' is registered twice" in capsys.readouterr().out
    assert main(["list", "--anything", "-x", "y"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvpolicy list: error: command name 'list' is registered twice: by kvpolicy")
    assert "my-list (registered at run time)" in err and registry.ALLOW_ENV in err
    assert "list" in build_parser().format_help()


# ---------------------------------------------------------------------- plugins of every kind, from the shell
#: a name kvpolicy registers itself, per kind (a plugin registering it too is a conflict)
BUILTIN_NAME = {
    "policies": ("log", "GoodPolicy"),
    "actions": ("quantize", "GoodAction"),
    "backends": ("torch", "GoodBackend"),
    "transforms": ("hadamard", "GoodTransform"),
    "presets": ("kivi", "good_preset"),
    "formats": ("minmax", "GoodFormat"),
    "commands": ("presets", "good_command"),
}

HEADER = """
from dataclasses import dataclass

from kvpolicy.hookspecs import hookimpl
from kvpolicy.policies.recent import RecentWindow
from kvpolicy.actions.evict import Evict
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.transforms.hadamard import Hadamard
from kvpolicy.formats.packed import MinMax


@dataclass(frozen=True)
class GoodPolicy(RecentWindow):
    pass


class GoodAction(Evict):
    pass


class GoodBackend(TorchBackend):
    pass


class GoodTransform(Hadamard):
    pass


class GoodFormat(MinMax):
    pass


def good_preset():
    return {"policy": "recent", "action": "evict"}


def good_command(sub):
    sub.add_parser("presets").set_defaults(func=lambda args: 0)
"""


def _how(kind: str, failure: str) -> str:
    name, obj = BUILTIN_NAME[kind]
    return {"raises": "1 / 0", "garbage": "['not', 'a', 'dict']", "collides": f"{{{name!r}: {obj}}}"}[failure]


@pytest.mark.parametrize("failure", ["raises", "garbage", "collides"])
def test_the_command_line_runs_with_a_broken_plugin_of_every_kind(tmp_path, monkeypatch, failure):
    """One broken plugin per kind, installed together (one interpreter runs the three commands)."""
    site = FakeSite(tmp_path, monkeypatch)
    for kind in BUILTIN_NAME:
        hook = f"\n\n@hookimpl\ndef kvpolicy_register_{kind}():\n    return {_how(kind, failure)}\n"
        site.add(f"kvp-broken-{kind}", "0.1", {f"broken_{kind}": f"broken_{kind}"}, {f"broken_{kind}": HEADER + hook})
    env = {k: v for k, v in os.environ.items() if k not in (registry.DISABLE_ENV, registry.ALLOW_ENV)}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    code = (
        "import contextlib, sys\nfrom kvpolicy import registry\nfrom kvpolicy.cli import main\n"
        "for argv in (['--version'], ['list'], ['plugins']):\n"
        "    registry.reset()\n"
        f"    with open({str(tmp_path)!r} + '/' + argv[0] + '.out', 'w') as out, contextlib.redirect_stdout(out):\n"
        "        try:\n            status = main(argv)\n"
        "        except SystemExit as exc:\n            status = exc.code\n"
        "    print(argv[0], status)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.split() == ["--version", "0", "list", "0", "plugins", "0"], proc.stderr
    out = {argv: (tmp_path / f"{argv}.out").read_text() for argv in ("--version", "list", "plugins")}
    assert out["--version"] == f"kvpolicy {kvpolicy.__version__}\n"
    assert out["list"].startswith("policies: ") and "backends here" in out["list"]
    assert out["plugins"].startswith("policies:")
    for kind, (name, _) in BUILTIN_NAME.items():
        if failure == "collides":
            clash = f"{registry._SINGULAR[kind]} name {name!r} is registered twice: by kvpolicy"
            assert clash in out["list"] and clash in out["plugins"]
        else:
            assert f"kvpolicy plugin 'kvp-broken-{kind}:broken_{kind}' from kvp-broken-{kind} 0.1" in proc.stderr
