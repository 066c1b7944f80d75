"""The tail rule (kvpolicy_lab.eval.tail, scripts/check_tail.py): each shipped preset's relative tail against
the one-liner's at the same bits, from rows built by hand and from a real run of a tiny model."""

from __future__ import annotations

import importlib.util
import math

import pytest
from lab_fixtures import ROOT, write_pages

from kvpolicy import preset_files
from kvpolicy.cli import main
from kvpolicy_lab.eval.tail import (
    ONE_LINERS,
    RULE_FACTOR,
    Tail,
    check,
    one_liner_relative_tail,
    shipped_presets,
    tails,
    verdict_line,
)


def _rows(cache: str, bits: float, kl: float, p999: float, *, context: int = 2048, model: str = "smollm2",
          worst: float | None = None, p99: float | None = None) -> list[dict]:  # fmt: skip
    """The rows an lm cell records for the tail (the runner's keys; the values given)."""
    row = {"cache": cache, "task": "lm", "context": context, "model": model, "extra": {}, "se": None, "n": 1280}
    values = {"bits_per_element_16": bits, "kl": kl, "kl_worst": kl if worst is None else worst,
              "kl_p99": p999 / 2 if p99 is None else p99, "kl_p999": p999}  # fmt: skip
    out = [{**row, "metric": m, "value": v} for m, v in values.items()]
    out[-1]["extra"] = {"max": 2 * p999}
    return out


def _one_liners(*points: tuple[int, float, float]) -> list[dict]:
    """One-liner cells: (bits argument, bits per element, relative tail) each, with mean KL 0.1."""
    return [r for b, bits, rel in points for r in _rows(ONE_LINERS[b], bits, 0.1, 0.1 * rel)]


def test_the_one_liners_relative_tail_is_interpolated_in_bits_and_clamped_outside():
    rows = _one_liners((2, 3.0, 4.0), (3, 4.0, 6.0), (4, 5.0, 3.0)) + _rows("other", 3.5, 0.1, 9.0)
    measured = tails(rows, 2048, "smollm2")
    assert measured[ONE_LINERS[2]].relative == pytest.approx(4.0)
    assert one_liner_relative_tail(measured, 3.5)[0] == pytest.approx(5.0)
    assert one_liner_relative_tail(measured, 4.75)[0] == pytest.approx(3.75)
    assert one_liner_relative_tail(measured, 4.0)[0] == pytest.approx(6.0)
    low, high = one_liner_relative_tail(measured, 2.0), one_liner_relative_tail(measured, 9.0)
    assert low[0] == pytest.approx(4.0) and "fewest measured" in low[1] and ONE_LINERS[2] in low[1]
    assert high[0] == pytest.approx(3.0) and "most measured" in high[1] and ONE_LINERS[4] in high[1]
    # a cache that is not the one-liner never serves as the reference, and without a one-liner there is none
    assert one_liner_relative_tail(tails(_rows("other", 3.5, 0.1, 9.0), 2048, "smollm2"), 3.5) is None


def test_each_shipped_preset_is_judged_against_the_rule_and_the_target():
    one = _one_liners((2, 3.0, 4.0), (3, 4.0, 6.0))
    # at 3.5 bits the one-liner's relative tail is 5: 3x is 15; 15 passes (the rule says "more than 3x")
    rows = one + _rows("kvpolicy-3bit", 3.5, 0.01, 0.15) + _rows("kvpolicy-3.5bit", 3.5, 0.01, 0.1501)
    rows += _rows("kvpolicy-4bit", 3.0, 0.01, 0.05)
    rows += _rows("kvpolicy-3bit", 3.5, 0.01, 99.0, context=8192) + _rows("kvpolicy-4.5bit", 4, 1, 1, model="x")
    verdicts = {v.preset: v for v in check(rows)}
    assert list(verdicts) == shipped_presets("smollm2")
    three, three_half, four = verdicts["kvpolicy-3bit"], verdicts["kvpolicy-3.5bit"], verdicts["kvpolicy-4bit"]
    assert three.ratio == pytest.approx(RULE_FACTOR) and three.passes_rule
    assert not three_half.passes_rule and three_half.ratio > RULE_FACTOR
    assert four.ratio == pytest.approx(0.5 / 0.4) and four.passes_rule
    # the target: p99.9 at most 10x the mean (15x and 5x here)
    assert not three.meets_target and four.meets_target
    assert "**fails** the rule" in verdict_line(three_half) and "passes the rule" in verdict_line(three)
    assert "target p99.9 ≤ 10× the mean: **not reached**" in verdict_line(three)
    # rows of another context or model are not this preset's; no row is "not measured", never a pass
    missing = verdicts["kvpolicy-4.5bit"]
    assert missing.tail is None and not missing.passes_rule and not missing.meets_target and math.isnan(missing.ratio)
    assert verdict_line(missing).startswith("- `kvpolicy-4.5bit`: not measured")
    # without any one-liner the rule cannot be checked, and a preset does not pass it
    alone = {v.preset: v for v in check(_rows("kvpolicy-4bit", 3.0, 0.01, 0.05))}["kvpolicy-4bit"]
    assert not alone.passes_rule and alone.meets_target and "no one-liner measured" in verdict_line(alone)


def test_the_shipped_presets_are_the_kvpolicy_presets_and_the_models_preset_files():
    ours = shipped_presets("smollm2")
    assert ours[:4] == ["kvpolicy-3bit", "kvpolicy-3.5bit", "kvpolicy-4bit", "kvpolicy-4.5bit"]
    assert set(ours[4:]) == {n for n in preset_files.names() if n.startswith("smollm2-")} != set()
    assert "gemma3-270m-3.5bit" not in ours and "gemma3-270m-3.5bit" in shipped_presets("gemma3-270m")


def test_a_cell_without_the_tail_is_left_out():
    rows = [r for r in _rows("kvpolicy-3bit", 3.0, 0.01, 0.05) if r["metric"] != "kl_p999"]
    assert tails(rows, 2048, "smollm2") == {}
    t = Tail("c", 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 10)
    assert math.isnan(t.relative)


def _script():
    spec = importlib.util.spec_from_file_location("check_tail", ROOT / "scripts" / "check_tail.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tail_run(tmp_path_factory):
    """A real run of a tiny model: the one-liner at bits 2 and two of the shipped presets."""
    tmp = tmp_path_factory.mktemp("tail")
    cfg = tmp / "tail.toml"
    cfg.write_text(
        'models = ["tiny-llama"]\ncontexts = [96]\n[tasks.lm]\nsamples_per_context = 2\ntokens = 8\n'
        f'[[caches]]\nlabel = "{ONE_LINERS[2]}"\npolicy = "log"\nwindow = 42\nbits = 2\nkey_group_size = 128\n'
        'key_fit = "mse"\n'
        '[[caches]]\nlabel = "kvpolicy-3bit"\nkind = "preset"\nname = "kvpolicy-3bit"\n'
        '[[caches]]\nlabel = "kvpolicy-4bit"\nkind = "preset"\nname = "kvpolicy-4bit"\n'
    )
    run = tmp / "run"
    assert main(["ablate", "--config", str(cfg), "--out", str(run), "--no-progress"]) == 0
    return run


def test_the_script_reads_a_run_and_fails_on_a_preset_it_lacks(tail_run, tmp_path, capsys):
    """The script checks every shipped preset: the two measured get a verdict from the rows, the others are
    not measured, so it exits 1."""
    run = tail_run
    capsys.readouterr()
    assert _script().main([str(run), "--model", "tiny-llama", "--context", "96"]) == 1
    out = capsys.readouterr().out
    measured = tails(_current(run), 96, "tiny-llama")
    assert set(measured) == {ONE_LINERS[2], "kvpolicy-3bit", "kvpolicy-4bit"}
    for name in ("kvpolicy-3bit", "kvpolicy-4bit"):
        t = measured[name]
        assert t.tokens == 16 and t.kl <= t.kl_p999 <= t.kl_max
        assert f"- `{name}`: {t.bits:.2f} bits, KL {t.kl:.4f}, p99.9 {t.kl_p999:.4f}" in out
    assert "- `kvpolicy-3.5bit`: not measured" in out and "- `kvpolicy-4.5bit`: not measured" in out
    assert "shipped presets measured and within the rule; not: " in out and "kvpolicy-3.5bit" in out.splitlines()[-1]
    with pytest.raises(SystemExit) as exc:
        _script().main([str(tmp_path)])
    assert exc.value.code == 2


def _current(run):
    from kvpolicy_lab.eval.runner import current_rows

    return current_rows(run)[1]


def test_the_frontier_page_gets_the_tail_section(tail_run, tmp_path):
    """write_pages.py frontier --tail DIR: the section's table, a verdict per shipped preset, the command and
    hardware, and the tail's run among the commands that regenerate the page."""
    doc = tmp_path / "docs" / "frontier.md"
    assert write_pages().main(["frontier", "--run", str(tail_run), "--tail", str(tail_run), "--page", str(doc)]) == 0
    text = doc.read_text()
    section, made = text.index("## The tail of the per-token KL"), text.index("## How this page was made")
    assert section < made
    mine = text[section:made]
    measured = tails(_current(tail_run), 96, "tiny-llama")
    t = measured["kvpolicy-3bit"]
    assert (f"| `kvpolicy-3bit` | {t.bits:.2f} | {t.kl:.4f} | {t.kl_worst:.4f} | {t.kl_p99:.4f} | {t.kl_p999:.4f} | "
            f"{t.kl_max:.4f} | {t.relative:.1f}× |") in mine  # fmt: skip
    assert "| one-liner, `bits=2` |" in mine and "- `kvpolicy-4.5bit`: not measured" in mine
    assert f"Reproduce with `kvpolicy ablate --config examples/configs/frontier-tail.toml --out {tail_run}" in mine
    assert "2 CPU cores" in mine and "torch 2." in mine
    assert (
        f"kvpolicy ablate --config examples/configs/frontier-tail.toml --out {tail_run} --threads 2\n"
        f"python scripts/write_pages.py frontier --run {tail_run} --tail {tail_run} --page {doc}\n```"
    ) in text
    # without --tail the page has no such section
    write_pages().main(["frontier", "--run", str(tail_run), "--page", str(doc)])
    assert "## The tail" not in doc.read_text()
