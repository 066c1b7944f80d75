"""The registry's first lookup from several threads at once: entry points load once, under a lock.

Threads that build their first caches together must all find an installed plugin's names, and the
names must stay found afterwards. Each round resets the registry and forgets the plugin's module, so
every round is a first lookup; the rounds run in a fresh interpreter with real threads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from kvpolicy import registry

#: a plugin whose import takes a little while, so that threads starting together overlap while it loads
SLOW_PLUGIN = """
import time
from dataclasses import dataclass

from kvpolicy.hookspecs import hookimpl
from kvpolicy.policies.recent import RecentWindow

time.sleep(0.02)


@dataclass(frozen=True)
class SlowPolicy(RecentWindow):
    pass


@hookimpl
def kvpolicy_register_policies():
    return {"slow-policy": SlowPolicy}
"""

#: rounds of ``threads`` threads building their first cache of ``policy`` together (from ``module``)
RACE = """
import json, sys, threading
from kvpolicy import CompressedCache, registry

rounds, count, module, policy = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
errors, missing_after = [], 0
for _ in range(rounds):
    registry.reset()
    sys.modules.pop(module, None)
    barrier = threading.Barrier(count)

    def build():
        barrier.wait()
        try:
            CompressedCache(policy=policy, action="evict")
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=build) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    missing_after += policy not in registry.names("policies")
print(json.dumps({"errors": errors, "missing_after": missing_after}))
"""


def race(env: dict[str, str], module: str, policy: str, rounds: int = 12, threads: int = 8) -> dict:
    """Run :data:`RACE` in a fresh interpreter; its JSON report."""
    out = subprocess.run(
        [sys.executable, "-c", RACE, str(rounds), str(threads), module, policy],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def plugin_env(extra_path: str | None = None) -> dict[str, str]:
    """The environment with entry-point loading on (the tests' own setting turns it off)."""
    env = {k: v for k, v in os.environ.items() if k not in (registry.DISABLE_ENV, registry.ALLOW_ENV)}
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH")) if p)
    return env


def test_threads_making_their_first_lookup_together_all_find_the_plugin(tmp_path: Path):
    info = tmp_path / "kvp_slow-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvp-slow\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[kvpolicy]\nslowplug = slowplug\n")
    (tmp_path / "slowplug.py").write_text(textwrap.dedent(SLOW_PLUGIN))
    report = race(plugin_env(str(tmp_path)), "slowplug", "slow-policy")
    assert report == {"errors": [], "missing_after": 0}


def test_registering_and_looking_up_from_threads_loses_nothing():
    """Run-time registrations from several threads, each followed by lookups from the others: every
    plugin registered is found, and the tables are built from all of them."""
    import threading
    from dataclasses import dataclass

    from kvpolicy.hookspecs import hookimpl
    from kvpolicy.policies.recent import RecentWindow

    @dataclass(frozen=True)
    class Each(RecentWindow):
        pass

    def plugin(i: int) -> object:
        class Plugin:
            @hookimpl
            def kvpolicy_register_policies(self):
                return {f"threaded-{i}": Each}

        return Plugin()

    plugins = [plugin(i) for i in range(8)]
    barrier = threading.Barrier(len(plugins))
    errors: list[str] = []

    def work(i: int) -> None:
        barrier.wait()
        registry.register(plugins[i], name=f"threaded-{i}")
        try:
            registry.get("policies", f"threaded-{i}")
            registry.names("policies")
        except Exception as exc:  # collected: the assert below names it
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(plugins))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert {f"threaded-{i}" for i in range(8)} <= set(registry.names("policies"))
    finally:
        for p in plugins:
            registry.unregister(p)
