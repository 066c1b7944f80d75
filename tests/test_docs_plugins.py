"""docs/how-to/write-a-plugin.md's example plugin is built from the page and works: installed into a temporary
folder (pip, offline, no build isolation), its own test passes, and a fresh interpreter finds its
policy by name through the entry point."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ("pyproject.toml", "kvpolicy_stride.py", "test_stride.py")


def _blocks() -> dict[str, str]:
    text = (ROOT / "docs" / "how-to" / "write-a-plugin.md").read_text()
    return dict(re.findall(r"<!-- file: (\S+) -->\n```\w*\n(.*?)\n```", text, re.S))


def test_example_has_its_three_files_in_about_thirty_lines_of_policy():
    blocks = _blocks()
    assert sorted(blocks) == sorted(FILES)
    code = [line for line in blocks["kvpolicy_stride.py"].splitlines() if line.strip()]
    assert len(code) <= 40


def test_example_plugin_builds_passes_its_test_and_loads_by_name(tmp_path):
    package, site = tmp_path / "kvpolicy-stride", tmp_path / "site"
    package.mkdir()
    for name, source in _blocks().items():
        (package / name).write_text(source + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("KVPOLICY_DISABLE_PLUGIN_AUTOLOAD", "KVPOLICY_PLUGINS")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-build-isolation"]
    built = subprocess.run(
        [*pip, "--target", str(site), str(package)], capture_output=True, text=True, env=env, timeout=120
    )
    assert built.returncode == 0, built.stdout + built.stderr
    assert sorted(p.name for p in site.glob("kvpolicy_stride*")) == [
        "kvpolicy_stride-0.1.0.dist-info",
        "kvpolicy_stride.py",
    ]

    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # one fresh interpreter: use the policy by name (nothing imports the plugin by hand), list it,
    # then run the plugin's own test as its author would (hypothesis writes its database under tmp_path)
    code = (
        "import sys\n"
        "import torch\n"
        "from kvpolicy import CompressedCache\n"
        "from kvpolicy.cli import main\n"
        "print('loaded before:', 'kvpolicy_stride' in sys.modules)\n"
        "cache = CompressedCache(policy='stride', window=4, stride=2, action='quantize', bits=2)\n"
        "kv = torch.randn(1, 2, 11, 64)\n"
        "cache.update(kv[:, :, :10], kv[:, :, :10], 0)\n"
        "cache.update(kv[:, :, 10:], kv[:, :, 10:], 0)\n"
        "pos = cache.positions(0)\n"
        "print(type(cache.policy).__module__, pos['full'].tolist(), pos['compressed'].tolist())\n"
        "main(['plugins'])\n"
        "import pytest\n"
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'test_stride.py']))\n"
    )
    used = subprocess.run(
        [sys.executable, "-c", code], cwd=package, capture_output=True, text=True, env=env, timeout=180
    )
    assert used.returncode == 0, used.stdout + used.stderr
    lines = used.stdout.splitlines()
    assert lines[0] == "loaded before: False"
    assert lines[1] == "kvpolicy_stride [0, 2, 4, 6, 7, 8, 9, 10] [1, 3, 5]"
    (row,) = [line.split() for line in lines if line.strip().startswith("stride ")]
    assert row[:4] == ["stride", "kvpolicy-stride", "0.1.0", "kvpolicy_stride.StrideWindow"]
    assert "1 passed" in used.stdout
