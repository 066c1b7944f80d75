"""Subcommands are plugins: the core's register through ``kvpolicy_register_commands`` like any other
distribution's (the lab's ``ablate``, ``tune``, ...), and a lab command without the lab says what to install."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvpolicy import registry
from kvpolicy.cli import LAB_COMMANDS, build_parser, commands, main
from kvpolicy.hookspecs import hookimpl


@pytest.fixture
def no_plugins(monkeypatch):
    """Only the built-ins (no entry point loads), and the registry as it was afterwards."""
    monkeypatch.setenv(registry.DISABLE_ENV, "1")
    registry.reset()
    yield
    registry.reset()


class Hello:
    """A run-time plugin adding ``kvpolicy hello --name NAME``."""

    @hookimpl
    def kvpolicy_register_commands(self):
        def register(sub) -> None:
            p = sub.add_parser("hello", help="say hello")
            p.add_argument("--name", default="world")
            p.set_defaults(func=lambda args: print(f"hello {args.name}") or 0)

        return {"hello": register}


def test_the_core_commands_are_registered_through_the_hook(no_plugins):
    names = [name for name, _ in commands()]
    assert names == ["list", "plugins", "presets"]  # help order
    assert {name for name, _, source in registry.entries("commands")} == {"list", "plugins", "presets"}
    assert all(source.distribution == "kvpolicy" for _, _, source in registry.entries("commands"))


def test_a_plugin_command_joins_the_command_line(no_plugins, capsys):
    registry.register(Hello(), name="hello-plugin")
    assert [name for name, _ in commands()][-1] == "hello"
    assert main(["hello", "--name", "kv"]) == 0
    assert capsys.readouterr().out == "hello kv\n"
    assert "hello" in build_parser().format_help()


def test_a_command_that_is_not_callable_skips_its_plugin(no_plugins):
    class Broken:
        @hookimpl
        def kvpolicy_register_commands(self):
            return {"broken": "not a function"}

    registry.register(Broken(), name="broken-plugin")
    with pytest.warns(registry.PluginWarning, match=r"'broken': 'not a function' \(str\) is not callable"):
        assert "broken" not in registry.names("commands")


@pytest.mark.parametrize("command", LAB_COMMANDS)
def test_a_lab_command_without_the_lab_names_the_package(no_plugins, capsys, command):
    assert main([command, "--help"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"kvpolicy {command}: error: this command comes with the kvpolicy-lab package: pip install kvpolicy-lab "
        "(from a clone of kvpolicy: pip install ./lab)"
    ]


def test_help_without_the_lab_lists_what_it_would_add(no_plugins):
    text = " ".join(build_parser().format_help().split())
    lab = "(demo, ablate, tune, analyze, bench, estimate: pip install kvpolicy-lab)"
    assert f"one of: list, plugins, presets {lab}" in text


def test_the_missing_lab_is_one_line_and_exit_2_from_the_shell():
    env = {**os.environ, registry.DISABLE_ENV: "1"}
    proc = subprocess.run([sys.executable, "-m", "kvpolicy", "tune", "--budget", "3"], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "kvpolicy tune: error: this command comes with the kvpolicy-lab package: pip install kvpolicy-lab "
        "(from a clone of kvpolicy: pip install ./lab)"
    ]
