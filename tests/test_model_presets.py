"""Model presets (:mod:`kvpolicy.model_presets`): entries are checked when their plugin loads, matched on the
model's config, and ``for_model(model, "auto")`` builds the one that suits the model or else the default,
saying which and why in ``repr``."""

from __future__ import annotations

import re
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from conftest import tiny_gemma3
from transformers import LlamaConfig

from kvpolicy import CompressedCache, model_presets, registry
from kvpolicy.cli import main
from kvpolicy.errors import ConfigError
from kvpolicy.model_presets import ModelPreset
from kvpolicy.tiny import random_model

#: a core-only composition, unlike any default, so that a test sees which one was built
PRESET_TOML = '[cache]\npolicy = "log"\nwindow = 6\nkey_bits = 4\nvalue_bits = 4\n'
EVIDENCE = "tiny model, made up: KL 0.01 at 4 bits"


def entry(**changes) -> str:
    """The source of a ``ModelPreset(...)`` for the fake plugin's hook."""
    fields = {"model_types": ("gemma3_text",), "package": "fakemp", "file": "presets/tiny.toml", "evidence": EVIDENCE}
    fields.update(changes)
    return "ModelPreset(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"


class Site:
    """A temporary folder on ``sys.path`` holding fake distributions, each a package with preset files."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.packages: list[str] = []

    def add(self, dist: str, package: str, entries: dict[str, str], files: dict[str, str] | None = None) -> Path:
        """A distribution ``dist`` whose package ``package`` registers ``{name: ModelPreset source}`` and holds
        ``files`` (relative path -> text; by default ``presets/tiny.toml``)."""
        info = self.root / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[kvpolicy]\n{package} = {package}\n")
        folder = self.root / package
        folder.mkdir()
        body = ", ".join(f"{name!r}: {source}" for name, source in entries.items())
        (folder / "__init__.py").write_text(
            textwrap.dedent(f"""
            from kvpolicy.hookspecs import hookimpl
            from kvpolicy.model_presets import ModelPreset

            @hookimpl
            def kvpolicy_register_model_presets():
                return {{{body}}}
            """)
        )
        for relative, text in (files if files is not None else {"presets/tiny.toml": PRESET_TOML}).items():
            (folder / relative).parent.mkdir(parents=True, exist_ok=True)
            (folder / relative).write_text(text)
        self.packages.append(package)
        return folder


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.delenv(registry.DISABLE_ENV, raising=False)
    monkeypatch.setenv(registry.ALLOW_ENV, "fakemp,fakemptwo")  # the fake distributions' entry points alone
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.reset()
    fake = Site(tmp_path)
    yield fake
    registry.reset()
    for package in fake.packages:
        sys.modules.pop(package, None)


def registered_with_warnings() -> tuple[list[str], list[str]]:
    """The registered model presets' names, and the warnings of the plugins skipped when they loaded."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names = registry.names("model_presets")
    messages = [str(w.message) for w in caught if issubclass(w.category, registry.PluginWarning)]
    return names, [m for m in messages if m.startswith("kvpolicy plugin")]  # not the unused allowed name


# --- the entry itself -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_types": ("Gemma-3",)}, r"model_types holds 'Gemma-3'"),
        ({"model_types": ()}, r"model_types must be a non-empty tuple"),
        ({"model_types": "gemma3"}, r"model_types must be a non-empty tuple.*'gemma3'"),
        ({"model_types": ("llama", 3)}, r"model_types holds 3"),
        ({"file": "/etc/x.toml"}, r"file must be a relative .*'/etc/x.toml'"),
        ({"file": "../x.toml"}, r"without '\.\.'; got '\.\./x.toml'"),
        ({"file": "presets/../../x.toml"}, r"got 'presets/\.\./\.\./x.toml'"),
        ({"file": "presets/tiny.py"}, r"ending in \.toml .*'presets/tiny.py'"),
        ({"file": "presets\\tiny.toml"}, r"'/'-separated"),
        ({"package": "not a package"}, r"package must be .*'not a package'"),
        ({"evidence": ""}, r"evidence must be one non-empty line"),
        ({"evidence": "two\nlines"}, r"evidence must be one non-empty line"),
        ({"evidence": "x" * 401}, r"at most 400 characters"),
        ({"fields": {"head_dim": [64]}}, r"fields\['head_dim'\] = \[64\]"),
        ({"fields": {"Head-Dim": 64}}, r"config field 'Head-Dim'"),
    ],
)
def test_a_bad_entry_is_refused_naming_the_parameter_and_value(changes, message):
    fields = {"model_types": ("gemma3_text",), "package": "fakemp", "file": "presets/tiny.toml", "evidence": EVIDENCE}
    with pytest.raises(ConfigError, match=message):
        ModelPreset(**{**fields, **changes})


def test_fields_are_stored_sorted_from_a_mapping():
    preset = ModelPreset(("llama",), "fakemp", "a.toml", EVIDENCE, fields={"num_hidden_layers": 2, "head_dim": 16})
    assert preset.fields == (("head_dim", 16), ("num_hidden_layers", 2))


# --- the registry checks each entry when the plugins load ---------------------------------------------------------


def test_a_good_entry_is_registered_with_its_distribution(site):
    folder = site.add("fake-mp", "fakemp", {"tiny-gemma": entry()})
    names, warned = registered_with_warnings()
    assert (names, warned) == (["tiny-gemma"], [])
    ((name, preset, source),) = registry.entries("model_presets")
    assert (name, source.distribution, source.version) == ("tiny-gemma", "fake-mp", "1.0")
    assert preset.path() == (folder / "presets" / "tiny.toml").resolve()


@pytest.mark.parametrize(
    ("entries", "files", "message"),
    [
        ({"a": entry(file="presets/missing.toml")}, None, r"'presets/missing.toml' does not exist in package 'fakemp'"),
        ({"a": entry(model_types=("Gemma3",))}, None, r"raised ConfigError: ModelPreset: model_types holds 'Gemma3'"),
        (
            {"a": entry(package="json")},
            None,
            r"in package 'json', not in the registering plugin's own package 'fakemp'",
        ),
        ({"a": "'presets/tiny.toml'"}, None, r"returned 'a': 'presets/tiny.toml' \(str\) is not a kvpolicy"),
        ({"a": entry(), "b": entry(file="nope.toml")}, None, r"'nope.toml' does not exist"),
    ],
)
def test_a_bad_registration_skips_the_plugin_naming_it_and_the_value(site, entries, files, message):
    site.add("fake-mp", "fakemp", entries, files)
    names, warned = registered_with_warnings()
    assert names == []
    assert len(warned) == 1
    assert "kvpolicy plugin 'fake-mp:fakemp' from fake-mp 1.0" in warned[0]
    assert re.search(message, warned[0]), warned[0]


def test_a_file_linked_from_outside_its_package_is_refused(site, tmp_path):
    outside = tmp_path / "elsewhere.toml"
    outside.write_text(PRESET_TOML)
    folder = site.add("fake-mp", "fakemp", {"a": entry(file="presets/link.toml")}, {"presets/x.toml": PRESET_TOML})
    (folder / "presets" / "link.toml").symlink_to(outside)
    names, warned = registered_with_warnings()
    assert names == []
    assert "resolves to" in warned[0] and "outside package 'fakemp'" in warned[0], warned


def test_the_same_name_from_two_distributions_is_a_conflict_naming_both(site):
    site.add("fake-mp", "fakemp", {"tiny-gemma": entry()})
    site.add("fake-mp-two", "fakemptwo", {"tiny-gemma": entry(package="fakemptwo")})
    assert registry.names("model_presets") == ["tiny-gemma"]
    with pytest.raises(
        ConfigError, match=r"model preset name 'tiny-gemma' is registered twice.*fake-mp 1.0.*fake-mp-two"
    ):
        registry.get("model_presets", "tiny-gemma")
    with pytest.raises(ConfigError, match=r"registered twice"):  # auto cannot choose either
        CompressedCache.for_model(tiny_gemma3(), "auto")


# --- matching and for_model(model, "auto") -----------------------------------------------------------------------


def test_matching_picks_the_gemma3_preset_and_none_for_llama(site):
    site.add("fake-mp", "fakemp", {"tiny-gemma": entry(model_types=("gemma3", "gemma3_text"))})
    gemma = tiny_gemma3()
    assert [s.name for s in model_presets.suggest(gemma)] == ["tiny-gemma"]
    assert [s.name for s in model_presets.suggest(gemma.config)] == ["tiny-gemma"]
    (only,) = model_presets.suggest(gemma)
    assert str(only).startswith("tiny-gemma (preset file presets/tiny.toml of fake-mp") and EVIDENCE in str(only)
    assert model_presets.suggest(LlamaConfig()) == []
    assert model_presets.suggest(random_model("llama")) == []


def test_fields_narrow_the_match(site):
    site.add(
        "fake-mp", "fakemp",
        {"wide": entry(fields={"head_dim": 256}), "narrow": entry(fields={"head_dim": 64, "num_hidden_layers": 6})},
    )  # fmt: skip
    assert [s.name for s in model_presets.suggest(tiny_gemma3())] == ["narrow"]  # head_dim 64, 6 layers


def test_auto_builds_the_model_preset_that_suits_and_says_so(site):
    site.add("fake-mp", "fakemp", {"tiny-gemma": entry()})
    cache = CompressedCache.for_model(tiny_gemma3(), "auto")
    assert cache.policy.window == 6 and cache.preset.kind == "model preset" and cache.preset.name == "tiny-gemma"
    assert "preset='tiny-gemma, the model preset of fake-mp for model_type gemma3_text" in repr(cache)
    assert EVIDENCE in repr(cache)
    plain = CompressedCache.for_model(tiny_gemma3(), "tiny-gemma")  # by name too
    assert plain.spec == cache.spec and "preset=" not in repr(plain)


def test_auto_builds_the_default_where_none_suits_and_says_why(site):
    site.add("fake-mp", "fakemp", {"tiny-gemma": entry()})
    model = random_model("llama")
    cache = CompressedCache.for_model(model, "auto", key_bits=3, value_bits=3)
    assert cache.spec == CompressedCache.for_model(model, key_bits=3, value_bits=3).spec
    assert "preset=\"the default composition: no model preset is registered for model_type 'llama'\"" in repr(cache)


def test_no_preset_never_switches_to_a_model_preset(site):
    site.add("fake-mp", "fakemp", {"tiny-gemma": entry()})
    model = tiny_gemma3()
    assert CompressedCache.for_model(model).spec == CompressedCache(config=model.config).spec
    assert CompressedCache.for_model(model).policy.window != 6


def test_auto_refuses_when_two_model_presets_suit(site):
    site.add("fake-mp", "fakemp", {"one": entry(), "two": entry(model_types=("gemma3_text", "gemma3"))})
    with pytest.raises(
        ConfigError, match=r"2 model presets suit model_type 'gemma3_text'.*Pass one of them by name \(one, two\)"
    ):
        CompressedCache.for_model(tiny_gemma3(), "auto")


def test_without_any_plugin_auto_is_the_default(monkeypatch):
    monkeypatch.setenv(registry.DISABLE_ENV, "1")  # no entry point loads: the core alone
    registry.reset()
    try:
        assert registry.names("model_presets") == []
        model = tiny_gemma3()
        cache = CompressedCache.for_model(model, "auto")
        assert cache.spec == CompressedCache.for_model(model).spec
        assert "no model preset is registered for model_type 'gemma3_text'" in repr(cache)
    finally:
        registry.reset()


def test_cli_lists_the_presets_for_a_model_folder(site, tmp_path, capsys):
    site.add("fake-mp", "fakemp", {"tiny-gemma": entry()})
    folder = tmp_path / "model"
    tiny_gemma3().config.save_pretrained(folder)
    assert main(["presets", "--for", str(folder)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("tiny-gemma (preset file presets/tiny.toml of fake-mp")
    assert "for_model(model, 'auto') builds: tiny-gemma, the model preset of fake-mp" in out
    assert main(["presets", "--for", "smollm2"]) == 0
    assert "no model preset is registered for model_type 'llama'" in capsys.readouterr().out
    assert main(["presets"]) == 0
    assert capsys.readouterr().out.startswith("tiny-gemma (preset file")
