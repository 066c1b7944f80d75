"""Files saved with the research plugin's transforms: they name the plugin, load bit for bit where it is
installed, and where it is not the error says what to install."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from research_cases import CODEBOOK, teacher_forced_logits, tiny_model
from research_cases import ids as _ids
from research_parts import research_parts  # noqa: F401 - fixtures, and the plugin's parts registered

from kvpolicy import CompressedCache
from kvpolicy.fused import disable_fused, enable_fused
from kvpolicy.registry import DISABLE_ENV


@pytest.mark.parametrize("transform", ["lowrank", "query-hadamard", "calibrated-hadamard"])
def test_a_saved_file_names_the_plugin_and_loads_bit_for_bit(tmp_path, transform):
    model = tiny_model("llama")
    ids = _ids(40)
    enable_fused(model)
    try:
        cache = CompressedCache(transform=transform, **{**CODEBOOK, "window": 4})
        with torch.no_grad():
            model(ids[:, :30], cache=cache, use_cache=True)
        path = tmp_path / "c.kvc"
        cache.save(path, model=model)
        saved = cache.spec.to_dict()["transform"]
        assert saved["name"] == transform and saved["from"] == "kvpolicy-research"
        loaded = CompressedCache.load(path, model=model)
        assert loaded.transform == cache.transform
        for a, b in zip(cache.layers, loaded.layers, strict=True):
            for x, y in zip(
                a.engine.held.basis.state_dict().values(), b.engine.held.basis.state_dict().values(), strict=True
            ):
                assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        want = teacher_forced_logits(model, ids[:, 30:], 1, cache)
        assert torch.equal(teacher_forced_logits(model, ids[:, 30:], 1, loaded), want)
    finally:
        disable_fused(model)

    # without the plugin (no entry point loaded) the file is refused, naming the distribution to install
    script = textwrap.dedent(
        f"""
        from kvpolicy import CompressedCache
        from kvpolicy.errors import CacheFileError
        try:
            CompressedCache.load({str(path)!r})
        except CacheFileError as exc:
            print(str(exc))
        """
    )
    env = {**os.environ, DISABLE_ENV: "1"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"transform {transform!r}, which is not installed" in out.stdout
    assert "install it (pip install kvpolicy-research)" in out.stdout, out.stdout


def test_a_plugin_part_in_a_spec_is_saved_with_its_distribution():
    spec = CompressedCache.from_preset("kvpolicy-3bit", transform="lowrank").spec
    assert json.dumps(spec.to_dict()).count('"from": "kvpolicy-research"') == 1
    assert "from" not in CompressedCache.from_preset("kvpolicy-3bit").spec.to_dict()["transform"]
