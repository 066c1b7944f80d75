"""The docs stay true to the code; the import boundaries of the architecture hold; the CLI runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvpolicy import registry
from kvpolicy.cli import main
from kvpolicy.policies.base import Policy

ROOT = Path(__file__).resolve().parents[1]


def render(policy: Policy, lengths: list[int]) -> str:
    """One row per length ``T`` of ``lengths``: ``#`` where position ``t < T`` is at full precision, else ``.``
    (``policy`` data-independent: the same selection for every layer, head and row)."""
    state = policy.new_state()
    width = len(str(max(lengths)))
    rows = []
    for length in sorted(lengths):
        state.append(length - state.length)
        kept = set(state.full_positions())
        rows.append(f"T={length:<{width}} " + "".join("#" if t in kept else "." for t in range(length)))
    return "\n".join(rows)


def test_policies_page_pictures_match_the_code():
    import kvpolicy

    text = (ROOT / "docs" / "policies.md").read_text()
    blocks = re.findall(r"<!-- picture: (.*?) -->\n```text\n(.*?)\n```", text, re.S)
    assert len(blocks) >= 4, "picture blocks missing from docs/policies.md"
    for spec, picture in blocks:
        namespace = {name: getattr(kvpolicy, name) for name in kvpolicy.__all__}
        policy = eval(spec, namespace)  # e.g. RecentWindow(window=8)
        lengths = [int(line.split()[0][2:]) for line in picture.splitlines()]
        assert render(policy, lengths) == picture, spec


@pytest.mark.parametrize("module", ["kvpolicy.policies", "kvpolicy.actions", "kvpolicy.backends"])
def test_lower_layers_never_import_transformers(module):
    code = f"import sys, {module}; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cli_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "policies: h2o, log, recent, sink" in out
    assert "actions: evict, none, quantize" in out
    assert "transforms: " + ", ".join(registry.names("transforms")) in out
    assert {"hadamard", "none"} <= set(registry.names("transforms"))  # built in; plugins may add more
    presets = (
        "h2o, kivi, kvpolicy-3.5bit, kvpolicy-3bit, kvpolicy-4.5bit, kvpolicy-4bit, logquant, logquant-4bit, "
        "streamingllm"
    )
    assert f"presets: {presets}" in out


def test_cli_rejects_unknown_command():
    with pytest.raises(SystemExit):
        main(["frobnicate"])


def test_public_names_resolve():
    import kvpolicy

    assert set(kvpolicy.__all__) - {"__version__"} == set(kvpolicy._EXPORTS)
    for name in kvpolicy.__all__:
        assert getattr(kvpolicy, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        kvpolicy.Nope  # noqa: B018


def test_quickstart_example_runs():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "generated 20 tokens; cache length 619" in out.stdout
    assert "ratio (baseline / total)" in out.stdout
