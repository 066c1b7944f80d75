"""Every option of every command that takes a choice (a name from a list: a model, a preset, a backend, a
dtype, a device, a task...) refuses an unknown one the same way: exit status 2, one line on stderr naming the
option, and the closest allowed value; nothing printed on stdout and no model loaded first.

The options are found by walking the parser, so a new option is covered or fails
``test_every_option_is_classified``."""

from __future__ import annotations

import argparse

import pytest
from lab_fixtures import no_model_load  # noqa: F401  (pytest fixture)

from kvpolicy.cli import build_parser, main

pytestmark = pytest.mark.usefixtures("no_model_load")

#: options whose values are names checked by their own type, and a near miss of an allowed one
NAMED = {
    "--model": "smolm2",
    "--for": "smolm2",  # kvpolicy presets --for: a model named as --model names it
    "--preset": "kvpolicy-3bits",
    "--caches": "dynamc",
    "--backends": "cpuu",
    "--backend": "cpuu",
    "--task": "lm-essay",
    "--policy": "lgo",
    "--action": "quantise",
    "--baseline": "dynamc",
    "--transform": "hadamrd",
    "--dtype": "float3",
    "--device": "cdua",
    "--equal-bytes": "preset:logquan",  # a cache label of the grid (the base command runs preset:logquant)
}
#: options that take free values (paths, addresses, numbers), not choices
FREE = {"--config", "--address", "--merge", "--shard", "--plot", "--preset-file", "--out", "--json", "--shape",
        "--memory"}  # fmt: skip
#: the value types of numeric options (their own tests check the refusals)
NUMERIC = {"positive_int", "non_negative_int", "positive_float", "token_count", "prompt_length", "int"}


def _commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()):
    """``(words, parser)`` of every command that runs (the leaves of the subcommand tree)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield words, parser
    for action in subs:
        for name, sub in action.choices.items():
            yield from _commands(sub, (*words, name))


def _base(words: tuple[str, ...], tmp_path) -> list[str]:
    """The required arguments of a command, with values that pass."""
    if words == ("estimate",):
        return ["--model", "tiny-llama", "--tokens", "64"]
    if words == ("ablate",):
        return ["--out", str(tmp_path / "out"), "--preset", "logquant"]
    if words == ("tune",):
        return ["--budget-bits", "3", "--preset-file", str(tmp_path / "p.toml")]
    return []


def _cases():
    for words, parser in _commands(build_parser()):
        for action in parser._actions:
            flag = max(action.option_strings, key=len, default=None)
            if flag is None or action.nargs == 0 or flag in ("--help", "--version"):
                continue
            if action.choices is not None:
                yield pytest.param(words, flag, action.choices, id=f"{' '.join(words)} {flag}")
            elif flag in NAMED:
                yield pytest.param(words, flag, None, id=f"{' '.join(words)} {flag}")


def _near_miss(choices) -> str:
    """An unknown value close to the first allowed one (one letter dropped), or outside numeric choices."""
    first = str(next(iter(choices)))
    if first.isdigit():
        return str(max(int(c) for c in choices) + 1)
    return first[:-2] + first[-1] if len(first) > 2 else first + "x"


def _refusal(argv: list[str], capsys) -> str:
    try:
        status = main(argv)
    except SystemExit as exc:
        status = exc.code
    out, err = capsys.readouterr()
    assert status == 2, err
    assert out == "", out  # refused before any work printed anything ("Loading ...")
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if not line.startswith(("usage:", " "))]
    assert len(lines) == 1, err
    assert "online = true" not in lines[0]  # no grid-file words on the command line
    return lines[0]


@pytest.mark.parametrize(("words", "flag", "choices"), list(_cases()))
def test_an_unknown_choice_exits_2_in_one_line_with_a_suggestion(words, flag, choices, tmp_path, capsys):
    bad = NAMED[flag] if choices is None else _near_miss(choices)
    line = _refusal([*words, *_base(words, tmp_path), flag, bad], capsys)
    assert line.startswith(f"kvpolicy {' '.join(words)}: error: "), line
    assert flag in line or bad in line, line
    if choices is not None and str(next(iter(choices))).isdigit():
        assert "choose from" in line, line  # numbers: the allowed ones are listed
    else:
        assert "did you mean" in line, line


def test_every_option_is_classified():
    """A new option is either a choice (tested above through its choices or NAMED), free, or numeric."""
    unclassified = []
    for words, parser in _commands(build_parser()):
        for action in parser._actions:
            flag = max(action.option_strings, key=len, default=None)
            if flag is None or action.nargs == 0 or flag in ("--help", "--version"):
                continue
            kind = getattr(action.type, "__name__", "str")
            if action.choices is None and flag not in NAMED and flag not in FREE and kind not in NUMERIC:
                unclassified.append(f"{' '.join(words)} {flag} ({kind})")
    assert not unclassified, f"options without a bad-value case: {unclassified}"


@pytest.mark.parametrize(("argv", "suggestion"), [(["estimte"], "estimate"), (["bench", "decod"], "decode"),
                                                  (["analyze", "rotatoin"], "rotation")])  # fmt: skip
def test_a_misspelt_command_suggests_the_closest(argv, suggestion, capsys):
    assert f"did you mean '{suggestion}'" in _refusal(argv, capsys)


def test_bench_backends_refuses_an_unknown_backend_instead_of_skipping_it(capsys):
    line = _refusal(["bench", "backends", "--backends", "cpuu"], capsys)
    assert "unknown backend 'cpuu'; did you mean 'cpu'?" in line


def test_a_model_not_here_is_refused_without_grid_words(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = _refusal(["demo", "--model", "no-such-org/no-such-model"], capsys)
    assert "--online" in line


def test_a_misspelt_model_in_a_grid_file_gets_the_same_suggestion(tmp_path, capsys):
    config = tmp_path / "grid.toml"
    config.write_text('models = ["smolm2"]\n[[caches]]\nkind = "dynamic"\n')
    line = _refusal(["ablate", "--out", str(tmp_path / "run"), "--config", str(config)], capsys)
    assert "unknown model 'smolm2'; did you mean 'smollm2'?" in line
