"""The research formats and file codecs live in the research plugin (plugins/kvpolicy-research): no module of
the core names them, so that re-adding one edits no core file; no shipped preset needs the plugin; and
importing the core (the one-liner's policy) loads no format, coder or file code it does not use."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import core_lines_matching

from kvpolicy import CompressedCache, registry

ROOT = Path(__file__).resolve().parent.parent
#: the names of the research formats and codecs, and of the library behind the coder
NAMES = re.compile(r"lattice|entropy|constriction", re.IGNORECASE)


def test_no_core_module_names_a_research_format_or_codec():
    hits = core_lines_matching(NAMES)
    assert not hits, "core modules name a research part:\n" + "\n".join(hits)


def test_the_core_registers_no_research_format_or_codec():
    """In a process that loads no plugin (the test process may load the research plugin for the lab's tests)."""
    code = (
        "import json; from kvpolicy import registry\n"
        "print(json.dumps([registry.names('formats'), registry.names('codecs')]))"
    )
    env = {**os.environ, registry.DISABLE_ENV: "1"}
    env.pop(registry.ALLOW_ENV, None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    formats, codecs = json.loads(out.strip().splitlines()[-1])
    assert "minmax" in formats and "codebook" in formats
    assert not [n for n in [*formats, *codecs] if NAMES.search(n)], (formats, codecs)


@pytest.mark.parametrize("name", [p for p in registry.names("presets") if p != "snapkv"])
def test_no_shipped_preset_needs_the_research_plugin(name):
    """Each built-in preset's formats are the core's (its repr names no research part)."""
    cache = CompressedCache.from_preset(name)
    assert not NAMES.search(repr(cache)), repr(cache)


@pytest.mark.parametrize("path", sorted((ROOT / "kvpolicy" / "preset_files").glob("*.toml")), ids=lambda p: p.stem)
def test_no_shipped_preset_file_needs_the_research_plugin(path):
    assert not NAMES.search(path.read_text()), path
    cache = CompressedCache.from_preset(str(path))
    assert not NAMES.search(repr(cache)), repr(cache)


def test_importing_the_one_liner_loads_no_format_coder_or_file_code_it_does_not_use():
    """``import kvpolicy.policies.log`` and building the one-liner load neither the file format, nor a coder,
    nor the codebook (its blocks are min-max ones), nor a research part."""
    code = (
        "import sys, json\n"
        "import kvpolicy.policies.log\n"
        "after_import = sorted(sys.modules)\n"
        "from kvpolicy import CompressedCache\n"
        "CompressedCache(policy='log', action='quantize', bits=2)\n"
        "print(json.dumps([after_import, sorted(sys.modules)]))\n"
    )
    env = {"PATH": "/usr/bin:/bin"}  # plugins load by entry point, as for a user
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=ROOT)
    after_import, after_build = json.loads(out.stdout.strip().splitlines()[-1])
    for loaded in (after_import, after_build):
        # the registry loads the research plugin's hook module where it is installed (it names its classes by
        # module, so neither the lattice format nor the coder comes with it)
        unwanted = [m for m in loaded if m in ("kvpolicy.persist", "kvpolicy.cache_io", "constriction")
                    or (m.startswith("kvpolicy") and NAMES.search(m))]  # fmt: skip
        assert not unwanted, unwanted
    assert "kvpolicy.formats.codebook" not in after_build
