"""One resolver for presets, shipped preset files and preset file paths (kvpolicy.preset_source), preset files
read as untrusted input (kvpolicy.textfile), and model folders read without running their code
(kvpolicy.model_folder)."""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpolicy import CompressedCache, preset_files, registry
from kvpolicy.cli import main
from kvpolicy.errors import ConfigError
from kvpolicy.spec import CacheSpec
from kvpolicy.tiny import random_model

SHIPPED = preset_files.path("smollm2-3bit")


@pytest.fixture(scope="module")
def model():
    return random_model("llama", 2, 0)


def _cli(argv, capsys):
    try:
        status = main(argv)
    except SystemExit as exc:
        status = exc.code
    out, err = capsys.readouterr()
    return status, out, err


def _one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if not line.startswith(("usage:", " "))]
    assert len(lines) == 1, err
    return lines[0]


# ---------------------------------------------------------------------- one resolver, one did-you-mean
@pytest.mark.parametrize(
    ("name", "suggestion"),
    [("kvpolicy-3bits", "kvpolicy-3bit"), ("logquant4bit", "logquant-4bit"), ("smollm2-3bits", "smollm2-3bit"),
     ("smollm2-8k-2.5bits", "smollm2-8k-2.5bit")],
)  # fmt: skip
def test_every_entry_point_suggests_the_same_closest_name(model, name, suggestion):
    hint = f"did you mean '{suggestion}'?"
    for build in (
        lambda: CompressedCache.for_model(model, name),
        lambda: CompressedCache.from_preset(name),
        lambda: CompressedCache.from_config(name),
        lambda: CacheSpec.from_preset(name),
    ):
        with pytest.raises(ConfigError, match=re.escape(hint)) as info:
            build()
        assert "preset files shipped with kvpolicy: gemma3-270m-3.5bit, smollm2-3bit, smollm2-8k-2.5bit" in str(
            info.value
        )


@pytest.mark.parametrize("name", preset_files.names())
def test_shipped_preset_files_load_by_name_everywhere(model, name):
    want = repr(CompressedCache.from_spec(CacheSpec.from_file(preset_files.path(name))))
    assert repr(CompressedCache.from_preset(name)) == want
    assert repr(CompressedCache.from_config(name)) == want
    cache = CompressedCache.for_model(model, name)
    assert cache.preset.kind == "shipped file" and cache.preset.path == preset_files.path(name)


def test_registered_presets_load_through_from_config_too():
    assert repr(CompressedCache.from_config("logquant")) == repr(CompressedCache.from_preset("logquant"))
    assert CompressedCache.from_preset("logquant").preset.kind == "preset"
    assert CompressedCache(policy="log", bits=2).preset is None


def test_list_shows_the_shipped_preset_files(capsys):
    status, out, _ = _cli(["list"], capsys)
    assert status == 0
    assert "preset files (load by name like presets): gemma3-270m-3.5bit, smollm2-3bit, smollm2-8k-2.5bit" in out


# ---------------------------------------------------------------------- a file named like a shipped preset
@pytest.fixture
def local_file(tmp_path, monkeypatch):
    """A working directory holding a file named ``smollm2-3bit`` (and ``kvpolicy-3bit``) of another composition."""
    monkeypatch.chdir(tmp_path)
    text = '[cache]\npolicy = "recent"\nwindow = 7\naction = "quantize"\nbits = 4\n'
    for name in ("smollm2-3bit", "kvpolicy-3bit", "my-preset"):
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize("name", ["smollm2-3bit", "kvpolicy-3bit"])
def test_the_shipped_name_wins_over_a_file_here_and_says_so(local_file, name):
    with pytest.warns(UserWarning, match=rf"the file '{name}' in the working directory was not read \(pass "
                      rf"'\./{name}' to load it instead\)"):  # fmt: skip
        cache = CompressedCache.from_preset(name)
    assert "RecentWindow" not in repr(cache)
    assert cache.preset.kind in ("preset", "shipped file")


@pytest.mark.parametrize("how", ["./smollm2-3bit", "absolute", "path"])
def test_a_path_clearly_meant_loads_the_file(local_file, how):
    given = {"./smollm2-3bit": "./smollm2-3bit", "absolute": str(local_file / "smollm2-3bit"),
             "path": Path("smollm2-3bit")}[how]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache = CompressedCache.from_config(given)
    assert "RecentWindow(window=7," in repr(cache)
    assert cache.preset.kind == "file" and cache.preset.path == (local_file / "smollm2-3bit").absolute()


def test_a_bare_unknown_name_is_refused_even_when_a_file_has_it(local_file):
    with pytest.raises(ConfigError, match=r"a file named 'my-preset' is in the working directory: pass "
                       r"'\./my-preset' to load it"):  # fmt: skip
        CompressedCache.from_config("my-preset")


# ---------------------------------------------------------------------- preset files as untrusted input
def _refused(path, match):
    with pytest.raises(ConfigError, match=match) as info:
        CompressedCache.from_config(path)
    assert len(str(info.value).splitlines()) == 1 and len(str(info.value)) < 1200


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"[cache]\npolicy = " + b"[" * 5000 + b"]" * 5000 + b"\n", "nests tables or arrays too deeply"),
        (b"[cache]\nkeep = " + b"[" * 40 + b"]" * 40 + b"\n", "more than 32 levels deep"),
        (b'[cache]\npolicy = "log"\nname = "\xff\xfe"\n', r"is not UTF-8 text \(byte 0xff at offset"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", r"is a binary file"),
        (b"[cache\n", "is not valid TOML"),
        (b"cache = 3\n", r"has no \[cache\] table of CompressedCache keywords \(its \[cache\] is a int\)"),
        (b"x" * (70 * 1024), r"is 71680 bytes; a preset file is at most 65536 bytes"),
        (b'[cache]\npolicy = 3\n', r"its \[cache\] table is not a composition kvpolicy can build: policy must be"),
        (b'[cache]\nwindow = "four"\n', r"its \[cache\] table is not a composition"),
        (b'[cache]\nlayer_bits = "x"\n', r"its \[cache\] table is not a composition"),
        (b"[cache]\ntiers = [1, 2]\naction = 'tiered'\n", r"its \[cache\] table is not a composition"),
    ],
    ids=["deep", "deep-but-parsable", "not-utf8", "binary", "malformed", "cache-not-table", "huge", "policy-int",
         "window-str", "layer-bits-str", "tiers-ints"],
)  # fmt: skip
def test_a_malformed_preset_file_is_one_clear_line(tmp_path, content, match):
    path = tmp_path / "bad.toml"
    path.write_bytes(content)
    _refused(path, rf"preset file '.*bad\.toml'.*{match}|{match}")


def test_directories_devices_pipes_and_dangling_links_are_refused_without_reading(tmp_path):
    (tmp_path / "dir.toml").mkdir()
    _refused(tmp_path / "dir.toml", "is a directory, not a file")
    (tmp_path / "zero.toml").symlink_to("/dev/zero")  # would never end if read
    _refused(tmp_path / "zero.toml", r"is not a regular file \(a device, a pipe or a socket\)")
    os.mkfifo(tmp_path / "fifo.toml")  # would block forever if opened for reading without a writer
    _refused(tmp_path / "fifo.toml", r"is not a regular file")
    (tmp_path / "dangling.toml").symlink_to(tmp_path / "nowhere.toml")
    _refused(tmp_path / "dangling.toml", "is a link to a path that does not exist")
    _refused(tmp_path / "missing.toml", "does not exist")


_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_KEYS = st.sampled_from(["policy", "action", "transform", "backend", "layout", "attention", "bits", "key_bits",
                         "window", "tiers", "keep", "layer_bits", "group_size", "scheme", "norm_bits", "sinks",
                         "key_centre", "meta_dtype", "seed", "rank"])  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_KEYS, _VALUES, max_size=5))
def test_any_cache_table_builds_or_is_refused_with_a_config_error(table):
    """Wrong types anywhere in a preset file's table: a ConfigError naming the file, never another exception."""
    try:
        CacheSpec.from_table(table, "preset file 'fuzz.toml'")
    except ConfigError as exc:
        assert str(exc).startswith("preset file 'fuzz.toml': ") or "preset file" in str(exc)


# ---------------------------------------------------------------------- model folders: no code of their own
def _evil_folder(tmp_path: Path, model_type: str) -> tuple[Path, Path]:
    """A model folder whose config names a configuration module that writes a marker file when imported."""
    folder, marker = tmp_path / "evil-model", tmp_path / "EXECUTED"
    folder.mkdir()
    config = {"model_type": model_type, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "hidden_size": 256, "head_dim": 64, "vocab_size": 128,
              "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                           "AutoModelForCausalLM": "modeling_evil.EvilModel"}}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    code = f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import LlamaConfig as EvilConfig\n"
    (folder / "configuration_evil.py").write_text(code)
    (folder / "modeling_evil.py").write_text(code)
    return folder, marker


def test_a_model_folders_code_never_runs(tmp_path, capsys, monkeypatch):
    folder, marker = _evil_folder(tmp_path, "evil")
    # a user at a terminal answering yes to transformers' question, were it ever asked
    monkeypatch.setattr("builtins.input", lambda *args: "y")
    status, out, err = _cli(["presets", "--for", str(folder)], capsys)
    assert status == 2 and out == ""
    line = _one_line(err)
    assert "needs the model's own code to be read (auto_map AutoConfig -> 'configuration_evil.EvilConfig')" in line
    assert "trust_remote_code=False" in line
    assert not marker.exists()


def test_a_known_model_type_is_read_with_transformers_own_classes(tmp_path, capsys, monkeypatch):
    folder, marker = _evil_folder(tmp_path, "llama")
    monkeypatch.setattr("builtins.input", lambda *args: "y")
    status, out, err = _cli(["presets", "--for", str(folder)], capsys)
    assert status == 0, err
    assert "no model preset is registered for model_type 'llama'" in out
    assert not marker.exists()


@pytest.mark.parametrize(("content", "match"), [(b"\xff{}", "is not UTF-8"), (b"[" * 3000 + b"]" * 3000, "too deeply"),
                                                (b"[1, 2]", "holds a JSON list")])  # fmt: skip
def test_a_malformed_model_config_is_one_clear_line(tmp_path, capsys, content, match):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_bytes(content)
    status, _, err = _cli(["presets", "--for", str(folder)], capsys)
    assert status == 2 and "Traceback" not in err and match in _one_line(err)


def test_registry_presets_and_shipped_files_do_not_collide():
    assert not set(registry.names("presets")) & set(preset_files.names())


def test_a_misspelt_preset_parameter_suggests_the_presets_own():
    with pytest.raises(ConfigError, match=r"preset 'logquant' itself takes \['bits', 'budget', 'group_size'\]; did "
                       r"you mean 'budget' for 'budgt'\?"):  # fmt: skip
        CompressedCache.from_preset("logquant", budgt=3)
