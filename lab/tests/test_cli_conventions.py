"""The conventions every ``kvpolicy`` subcommand shares: ``--version`` and ``python -m kvpolicy``, one list
syntax, torch's dtype names, defaults in ``--help``, ``did you mean`` for misspelt names, the public
``dir(kvpolicy)``, ``list``'s per-backend usability, tune's offline message, and the models bench takes."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest
import torch

import kvpolicy
from kvpolicy.cli import build_parser, main
from kvpolicy.commands._types import DTYPES
from kvpolicy.errors import ConfigError


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """``(command words, parser)`` of ``parser`` and every subparser below it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def _leaves() -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """The parsers of runnable commands (no further subcommands)."""
    found = []
    for path, parser in _parsers(build_parser()):
        if path and not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
            found.append((path, parser))
    return found


def _refused(argv: list[str], capsys) -> str:
    """The last stderr line of an argv that argparse refuses (exit status 2)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


# ---------------------------------------------------------------------- --version, python -m kvpolicy
def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvpolicy {kvpolicy.__version__}"


def test_python_dash_m_kvpolicy_is_the_kvpolicy_command():
    run = subprocess.run([sys.executable, "-m", "kvpolicy", "--help"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: kvpolicy ")
    for command in ("demo", "list", "plugins", "ablate", "tune", "analyze", "bench"):
        assert re.search(rf"^\s+{command}\s", run.stdout, re.MULTILINE), command
    version = subprocess.run([sys.executable, "-m", "kvpolicy", "--version"], capture_output=True, text=True)
    assert version.stdout.strip() == f"kvpolicy {kvpolicy.__version__}"
    bad = subprocess.run([sys.executable, "-m", "kvpolicy", "ablat"], capture_output=True, text=True)
    assert bad.returncode == 2 and "did you mean 'ablate'?" in bad.stderr


# ---------------------------------------------------------------------- one list syntax
#: (command words, other required flags, list flag, two values, what the parsed values are)
LISTS = [
    (["ablate", "--out", "{tmp}/o"], "--bits", ["2", "4"], [2, 4]),
    (["ablate", "--out", "{tmp}/o"], "--context", ["2048", "4096"], [2048, 4096]),
    (["ablate", "--out", "{tmp}/o"], "--task", ["lm", "passkey"], ["lm", "passkey"]),
    (["ablate", "--out", "{tmp}/o"], "--model", ["tiny-llama", "tiny-qwen2"], ["tiny-llama", "tiny-qwen2"]),
    (["ablate", "--out", "{tmp}/o"], "--policy", ["log", "recent"], ["log", "recent"]),
    (["tune", "--budget-bits", "3", "--preset-file", "{tmp}/p.toml"], "--windows", ["8", "4"], [8, 4]),
    (["tune", "--budget-bits", "3", "--preset-file", "{tmp}/p.toml"], "--key-fits", ["mse", "minmax"],
     ["mse", "minmax"]),
    (["bench", "decode"], "--lengths", ["1k", "96"], [1024, 96]),
    (["bench", "decode"], "--batch", ["1", "2"], [1, 2]),
    (["bench", "decode"], "--caches", ["dynamic", "hf-quanto-2"], ["dynamic", "hf-quanto-2"]),
    (["bench", "memory"], "--lengths", ["8k", "64"], [8192, 64]),
    (["bench", "backends"], "--backends", ["torch", "cpu"], ["torch", "cpu"]),
]  # fmt: skip


def _dest(parser: argparse.ArgumentParser, argv: list[str], flag: str):
    """The parsed value of ``flag`` in ``argv``."""
    command = tuple(argv[:2]) if argv[0] == "bench" else (argv[0],)
    dest = next(a.dest for a in dict(_leaves())[command]._actions if flag in a.option_strings)
    return getattr(parser.parse_args(argv), dest)


@pytest.mark.parametrize("prefix, flag, values, parsed", LISTS, ids=[f"{p[0]}-{f}" for p, f, _, _ in LISTS])
def test_a_list_flag_takes_spaces_or_repeats_and_refuses_commas(prefix, flag, values, parsed, tmp_path, capsys):
    prefix = [w.replace("{tmp}", str(tmp_path)) for w in prefix]
    parser = build_parser()
    assert _dest(parser, [*prefix, flag, *values], flag) == parsed
    assert _dest(parser, [*prefix, flag, values[0], flag, values[1]], flag) == parsed
    line = _refused([*prefix, flag, ",".join(values)], capsys)
    assert f"argument {flag}: {','.join(values)!r} is comma-separated" in line
    assert line.endswith(f"{flag} {' '.join(values)}")


def test_commas_inside_a_spec_parameter_stay_one_value(tmp_path, capsys):
    """``name:key=a,b`` specs (a task's contexts) keep their commas; a comma between names is refused."""
    argv = ["ablate", "--out", str(tmp_path / "o"), "--task", "lm", "speed:contexts=1024,4096"]
    assert build_parser().parse_args(argv).task == ["lm", "speed:contexts=1024,4096"]
    line = _refused(["ablate", "--out", str(tmp_path / "o"), "--policy", "log,recent:window=8"], capsys)
    assert "argument --policy: 'log,recent:window=8' is comma-separated" in line


def test_a_list_flag_replaces_its_default_then_extends():
    args = build_parser().parse_args(["tune", "--budget-bits", "3", "--preset-file", "p.toml", "--windows", "8"])
    assert args.windows == [8]  # not the default [16, 42] plus 8
    again = build_parser().parse_args(["tune", "--budget-bits", "3", "--preset-file", "p.toml"])
    assert again.windows == [16, 42]


def test_the_benchmark_shape_is_four_space_separated_integers(capsys):
    args = build_parser().parse_args(["bench", "backends", "--shape", "1", "2", "64", "32"])
    assert args.shape == (1, 2, 64, 32)
    assert "--shape 1 8 4096 128" in _refused(["bench", "backends", "--shape", "1,8,4096,128"], capsys)
    assert "must be four integers" in _refused(["bench", "backends", "--shape", "1", "8", "64"], capsys)


def test_every_list_flag_refuses_a_comma_separated_value():
    """Every flag that takes several values is space-separated: each refuses ``a,b`` with the form to type."""
    seen = 0
    for path, parser in _leaves():
        for action in parser._actions:
            if action.nargs in ("+", "*"):
                flag = action.option_strings[0]
                with pytest.raises(argparse.ArgumentTypeError, match=f"comma-separated; {flag} takes"):
                    action.type("2,4")
                assert "comma" not in (action.help or "").lower(), (path, flag)
                seen += 1
    assert seen >= 20


# ---------------------------------------------------------------------- one dtype vocabulary
def _dtype_commands() -> list[tuple[str, ...]]:
    return [path for path, parser in _leaves() if any("--dtype" in a.option_strings for a in parser._actions)]


def test_every_dtype_flag_takes_torch_names():
    commands = _dtype_commands()
    assert {("ablate",), ("tune",), ("bench", "decode"), ("bench", "memory"), ("bench", "backends"),
            ("analyze", "attention")} <= set(commands)  # fmt: skip
    for path, parser in _leaves():
        for action in parser._actions:
            if "--dtype" in action.option_strings:
                assert action.choices is None or tuple(action.choices) == DTYPES, path
                assert [action.type(name) for name in DTYPES] == list(DTYPES), path
                assert action.default in (None, *DTYPES), path
                assert getattr(torch, action.default or "float32").is_floating_point


@pytest.mark.parametrize("old, new", [("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16"),
                                      ("half", "float16"), ("float23", "float32")])  # fmt: skip
def test_an_old_dtype_spelling_is_refused_with_the_torch_name(old, new, capsys):
    for path in _dtype_commands():
        extra = {"ablate": ["--out", "o"], "tune": ["--budget-bits", "3", "--preset-file", "p.toml"]}.get(path[0], [])
        line = _refused([*path, *extra, "--dtype", old], capsys)
        assert f"argument --dtype: must be one of float32, bfloat16, float16 (torch's names); got {old!r}" in line
        assert line.endswith(f"did you mean {new!r}?"), (path, line)


def test_bench_decode_takes_bfloat16():
    assert build_parser().parse_args(["bench", "decode", "--dtype", "bfloat16"]).dtype == "bfloat16"


# ---------------------------------------------------------------------- output flags
def test_out_is_always_a_directory_and_file_flags_name_what_they_write():
    for path, parser in _leaves():
        for action in parser._actions:
            if "--out" in action.option_strings:
                assert action.metavar == "DIR", path
            if action.metavar == "FILE" and action.type is not None and action.type.__name__ == "out_file":
                assert action.option_strings[0] in ("--preset-file", "--json"), path
    tune = build_parser().parse_args(["tune", "--budget-bits", "3", "--preset-file", "x.toml", "--out", "runs"])
    assert (str(tune.preset), str(tune.out)) == ("x.toml", "runs")


def test_tune_refuses_a_preset_file_given_as_out(tmp_path, capsys):
    rc = main(["tune", "--budget-bits", "3", "--preset-file", str(tmp_path / "p.toml"),
               "--out", str(tmp_path / "q.toml")])  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err
    assert "--out is the directory of the runs; the preset file is --preset-file" in err
    assert not (tmp_path / "q.toml").exists()


# ---------------------------------------------------------------------- help: defaults and texts
def test_every_help_shows_the_defaults_and_every_flag_has_a_help_text(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per flag: no wrapping inside a default
    checked = 0
    for path, parser in _parsers(build_parser()):
        text = parser.format_help()
        for action in parser._actions:
            if action.help is argparse.SUPPRESS:
                continue
            assert action.help, (path, action.option_strings or action.dest)
            default = action.default
            if default in (None, False, argparse.SUPPRESS) or not action.option_strings:
                continue
            shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
            rendered = parser._get_formatter()._expand_help(action)  # the flag's text as --help prints it
            assert rendered.endswith(f"(default: {shown})"), (path, rendered)
            assert rendered.count("default") == 1, (path, rendered)  # no second, hand-written default
            assert rendered in " ".join(text.split()), (path, rendered)
            checked += 1
    assert checked > 60


# ---------------------------------------------------------------------- did you mean
def test_an_unknown_registry_name_suggests_the_closest_one():
    with pytest.raises(ConfigError, match=r"unknown policy 'lgo'; registered policies: \[.*\]; did you mean 'log'\?$"):
        kvpolicy.CompressedCache(policy="lgo")
    with pytest.raises(ConfigError, match=r"unknown backend 'trch'.*did you mean 'torch'\?$"):
        kvpolicy.CompressedCache(policy="log", action="quantize", bits=2, backend="trch")
    with pytest.raises(ConfigError) as far:
        kvpolicy.CompressedCache(policy="zzzzzz")
    assert "did you mean" not in str(far.value)


def test_an_unknown_keyword_suggests_the_closest_parameter():
    with pytest.raises(ConfigError, match=r"unknown keyword\(s\) \['windw'\].*did you mean 'window' for 'windw'\?$"):
        kvpolicy.CompressedCache(policy="log", action="quantize", bits=2, windw=16)
    with pytest.raises(ConfigError, match=r"did you mean 'group_size' for 'grup_size'\?$"):
        kvpolicy.CompressedCache(policy="log", action="quantize", bits=2, grup_size=32)


def test_an_unknown_preset_suggests_the_closest_one():
    with pytest.raises(ConfigError, match=r"unknown preset 'kivy'; did you mean 'kivi'\? \(presets: .*kivi"):
        kvpolicy.CompressedCache.from_preset("kivy")


def test_a_misspelt_cli_choice_suggests_the_closest_one(capsys):
    line = _refused(["bench", "decode", "--mode", "latncy"], capsys)
    assert "invalid choice: 'latncy' (choose from 'latency', 'capacity'); did you mean 'latency'?" in line
    assert _refused(["bench", "decod"], capsys).endswith("did you mean 'decode'?")
    assert "did you mean 'materialized'?" in _refused(["ablate", "--out", "o", "--decode", "materialised"], capsys)


# ---------------------------------------------------------------------- dir(kvpolicy)
def test_dir_shows_only_the_public_api():
    names = dir(kvpolicy)
    for private in ("Any", "TYPE_CHECKING", "importlib", "annotations"):
        assert private not in names
    assert set(names) == set(kvpolicy.__all__)
    for name in names:
        getattr(kvpolicy, name)


# ---------------------------------------------------------------------- list: can each backend run here
def _backend_rows(out: str) -> dict[str, str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("backends here"))
    rows = {}
    for line in lines[start + 1 :]:
        if not line.startswith("  ") or line.startswith("  ("):
            break
        name, rest = line.strip().split(None, 1)
        rows[name] = rest
    return rows


def test_list_shows_whether_each_backend_runs_here_and_why_not(monkeypatch, capsys):
    from kvpolicy.backends import triton_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["list"]) == 0
    rows = _backend_rows(capsys.readouterr().out)
    assert set(rows) == set(kvpolicy.registry.names("backends"))
    assert rows["torch"] == "yes"
    if triton_backend.installed("triton"):
        assert rows["triton"].startswith("no ") and "TRITON_INTERPRET=1" in rows["triton"]
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert main(["list"]) == 0
        assert _backend_rows(capsys.readouterr().out)["triton"].startswith("yes  CPU tensors under Triton's interp")
    monkeypatch.setattr(triton_backend, "installed", lambda module: False)  # as if triton were not installed
    assert main(["list"]) == 0
    row = _backend_rows(capsys.readouterr().out)["triton"]
    assert row == 'no   needs the triton package: pip install "kvpolicy[triton]"'


def test_list_says_the_cpu_backend_needs_a_compiler(monkeypatch, capsys):
    from kvpolicy.kernels import cpu_attention

    monkeypatch.setattr(cpu_attention, "is_verified", lambda *args, **kwargs: False)  # as if never built
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    assert main(["list"]) == 0
    row = _backend_rows(capsys.readouterr().out)["cpu"]
    assert row.startswith("no ") and "C++ compiler" in row and "'no-such-compiler-xyz' is not on PATH" in row


def test_list_and_plugins_say_how_they_differ():
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert "for each backend whether it can run on this machine" in commands["list"].description
    assert "kvpolicy plugins" in commands["list"].description
    assert "distribution" in commands["plugins"].description and "kvpolicy list" in commands["plugins"].description


# ---------------------------------------------------------------------- tune offline
def test_tune_offline_message_names_only_real_tune_flags(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # restored afterwards (tune sets it when unset)
    rc = main(["tune", "--budget-bits", "3", "--model", "no-such-org/no-such-model",
               "--preset-file", str(tmp_path / "p.toml")])  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err
    assert "not in the local Hugging Face cache" in err and "--online" in err
    tune = dict(_leaves())[("tune",)]
    flags = {flag for action in tune._actions for flag in action.option_strings}
    assert set(re.findall(r"--[a-z][a-z-]+", err)) <= flags
    assert build_parser().parse_args(["tune", "--budget-bits", "3", "--preset-file", "p.toml", "--online"]).online


# ---------------------------------------------------------------------- models bench and demo take
@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A 2-layer random Llama (2 kv heads of 64 channels) saved with save_pretrained, no tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("saved-llama")
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


def test_bench_decode_runs_a_saved_model_directory(saved_model, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc = main(["bench", "decode", "--model", str(saved_model), "--lengths", "24", "--batch", "1", "--steps", "2",
               "--reps", "1", "--warmup", "0", "--window", "4", "--threads", "1",
               "--caches", "dynamic", "log-2-torch-ordered-fused", "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    data = json.loads((tmp_path / "decode.json").read_text())
    assert data["meta"]["model"] == str(saved_model) and data["meta"]["dtype"] == "float32"
    rows = {r["variant"]: r for r in data["rows"]}
    # float32 DynamicCache of this model: (24 + 2 untimed + 2 timed steps) tokens x 2 layers x 2 kv heads x 64
    # x (k, v) x 4 bytes
    assert rows["dynamic"]["tokens_held"] == 24 + 2 + 2
    assert rows["dynamic"]["bytes_held"] == (24 + 2 + 2) * 2 * 2 * 64 * 2 * 4
    assert 0 < rows["log-2-torch-ordered-fused"]["bytes_held"] < rows["dynamic"]["bytes_held"]


def test_bench_and_demo_take_the_models_ablate_takes(saved_model, capsys):
    parser = build_parser()
    for model in ("smollm2", "gemma3-270m", "tiny-llama", "tiny-qwen2-3", str(saved_model), "org/some-model"):
        assert parser.parse_args(["bench", "decode", "--model", model]).model == model
        assert parser.parse_args(["bench", "memory", "--model", model]).model == model
        assert parser.parse_args(["demo", "--model", model]).model == model
    assert "model path './no-such-dir' does not exist" in _refused(["bench", "decode", "--model", "./no-such-dir"],
                                                                    capsys)  # fmt: skip
    empty = saved_model.parent / "empty-dir"
    empty.mkdir(exist_ok=True)
    assert "directory without config.json" in _refused(["demo", "--model", str(empty)], capsys)


def test_bench_loads_other_names_as_ablate_does(monkeypatch):
    from kvpolicy_lab.bench.decode import load

    model = load("tiny-qwen2-3", torch.float32, "cpu")  # kvpolicy.tiny, as `ablate --model tiny-qwen2-3`
    assert model.config.model_type == "qwen2" and model.config.num_hidden_layers == 3
    with pytest.raises(ConfigError, match="not in the local Hugging Face cache"):
        from kvpolicy_lab.bench.decode import check_model

        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        check_model(argparse.Namespace(model="no-such-org/no-such-model", online=False))


def test_the_demo_runs_a_tiny_model_with_its_byte_tokenizer(capsys):
    from kvpolicy_lab.eval.demo import run_demo

    rows = run_demo("tiny-llama", max_new_tokens=2, context_tokens=32, continuation_tokens=4, threads=1,
                    configs={"none": dict(policy="log", action="none")})  # fmt: skip
    assert len(rows) == 1 and rows[0].prompt_tokens > 1000  # the source file, one id per byte
    assert rows[0].kl == pytest.approx(0.0, abs=1e-6)  # the reference against itself
