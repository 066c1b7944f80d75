"""The research plugin's transforms live in ``plugins/kvpolicy-research`` alone: no core module names them,
and no preset the core ships needs them (nor any other plugin)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvpolicy import CompressedCache, preset_files, registry

CORE = Path(__file__).resolve().parents[1] / "kvpolicy"
#: the names of the moved transforms, their modules and classes, in any spelling
NAMES = re.compile(r"low[-_ ]?rank|query[-_ ]?hadamard|query[-_ ]?weighted", re.IGNORECASE)


def test_no_core_module_names_a_research_transform():
    files = [p for p in CORE.rglob("*") if p.is_file() and p.suffix in {".py", ".cpp", ".h", ".toml", ".md"}]
    assert len(files) > 50
    found = [
        f"{path.relative_to(CORE.parent)}:{i}: {line.strip()[:100]}"
        for path in files
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if NAMES.search(line)
    ]
    assert found == []


def test_the_pattern_finds_each_spelling():
    for text in ("LowRank", "lowrank", "low-rank", "query-hadamard", "query_weighted", "QueryWeighted"):
        assert NAMES.search(text), text


@pytest.mark.parametrize("name", [n for n, _, s in registry.entries("presets") if s.distribution == "kvpolicy"])
def test_no_core_preset_needs_a_plugin(name):
    """Every part of a core preset's composition is registered by kvpolicy itself: its saved form names no
    other distribution (a plugin's part is saved with the distribution that registers it)."""
    spec = CompressedCache.from_preset(name).spec
    saved = json.dumps(spec.to_dict())
    assert '"from"' not in saved, saved


@pytest.mark.parametrize("name", preset_files.names())
def test_no_shipped_preset_file_needs_a_plugin(name):
    """The same for the preset files shipped with kvpolicy (a model's preset that needs a plugin ships in it)."""
    spec = CompressedCache.from_preset(name).spec
    saved = json.dumps(spec.to_dict())
    assert '"from"' not in saved, saved


def test_the_core_registers_no_model_preset():
    """Model presets come from plugins: the core's own presets serve every model by default."""
    assert [n for n, _, s in registry.entries("model_presets") if s.distribution == "kvpolicy"] == []
