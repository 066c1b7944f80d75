"""The ablation runner end to end on a tiny random model: outputs, resume, plugins, errors."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass

import pytest
from lab_fixtures import one_thread  # noqa: F401  (pytest fixtures)

from kvpolicy import registry
from kvpolicy.cli import main
from kvpolicy.errors import ConfigError
from kvpolicy.hookspecs import hookimpl
from kvpolicy.policies.recent import RecentWindow
from kvpolicy_lab.eval.grid import grid_from_dict
from kvpolicy_lab.eval.runner import RESULTS, Runner, load_done

pytestmark = pytest.mark.usefixtures("one_thread")


def _grid(**over):
    d = {
        "models": ["tiny-llama"],
        "contexts": [64],
        "tasks": {"lm": {"samples_per_context": 1, "tokens": 6}, "passkey": {"depths": [0.5], "max_new_tokens": 3},
                  "speed": {"steps": 2, "contexts": [32, 64]}},
        "caches": [{"kind": "dynamic", "label": "ref"}],
        "cross": {"policies": ["log:window=8", "recent:window=16"], "actions": ["quantize", "evict"], "bits": [2]},
        "equal_bytes": "log/quantize/2b(window=8)",
        "only": {"speed": ["ref", "log/evict(window=8)"]},
    }  # fmt: skip
    d.update(over)
    return grid_from_dict(d)


def _rows(out):
    return [json.loads(line) for line in (out / RESULTS).read_text().splitlines()]


def test_run_writes_everything_and_resumes(tmp_path):
    grid = _grid()
    runner = Runner(grid, tmp_path, progress=False, log=lambda s: None)
    assert runner.run() == 0
    for name in ("config.json", "results.jsonl", "summary.md", "samples.jsonl"):
        assert (tmp_path / name).is_file(), name
    assert list(tmp_path.glob("quality_vs_bytes_*lm_64.png")) and list(tmp_path.glob("ms_vs_context_*.png"))
    config = json.loads((tmp_path / "config.json").read_text())
    assert any("LogWindow(window=8)" in c["repr"] for c in config["caches"])
    rows = _rows(tmp_path)
    cells = {r["cell"] for r in rows}
    # 5 caches + 3 equal-bytes copies on lm and passkey, 2 caches x 2 contexts on speed
    assert len(cells) == 2 * 8 + 4
    assert {r["task"] for r in rows} == {"lm", "passkey", "speed"}
    eq = {r["cache"] for r in rows if r["equal_bytes"]}
    assert len(eq) == 3 and all("@" in c for c in eq)
    summary = (tmp_path / "summary.md").read_text()
    assert "## tiny-llama · lm · context 64" in summary and "Equal bytes" in summary

    # the results page is generated from the run directory, plots copied beside it
    from kvpolicy_lab.eval.docs_report import write_results_doc

    doc = write_results_doc(tmp_path, tmp_path / "site" / "results.md", command="kvpolicy ablate --out X")
    text = doc.read_text()
    assert "kvpolicy ablate --out X" in text and "| `ref` |" in text and "Running your own ablations" in text
    assert list((tmp_path / "site" / "img" / "results").glob("quality_vs_bytes_*.png"))

    # resume: nothing recomputed
    assert Runner(grid, tmp_path, progress=False, log=lambda s: None).run() == 0
    assert len(_rows(tmp_path)) == len(rows)

    # an interrupted cell (rows cut) runs again, and only that one
    lines = (tmp_path / RESULTS).read_text().splitlines()
    last = json.loads(lines[-1])["cell"]
    kept = [line for line in lines if json.loads(line)["cell"] != last]
    (tmp_path / RESULTS).write_text("\n".join(kept) + '\n{"cell": "' + last + '", "trunc')
    assert last not in load_done(tmp_path / RESULTS)
    Runner(grid, tmp_path, progress=False, log=lambda s: None).run()
    again = _rows_lenient(tmp_path)
    assert {r["cell"] for r in again} == cells
    assert len([r for r in again if r["cell"] != last]) == len(kept)


def _rows_lenient(out):
    rows = []
    for line in (out / RESULTS).read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows


@dataclass(frozen=True)
class EveryOther(RecentWindow):
    """A plugin policy for the test (the recent window under another name)."""

    name = "test-every-other"


class _Plugin:
    @hookimpl
    def kvpolicy_register_policies(self):
        return {"test-every-other": EveryOther}


def test_plugin_policy_runs_without_code_changes(tmp_path):
    plugin = _Plugin()
    registry.register(plugin, name="test-plugin")
    try:
        grid = _grid(cross={"policies": ["test-every-other:window=8"], "actions": ["quantize"], "bits": [2]},
                     equal_bytes=False, only={}, tasks={"lm": {"samples_per_context": 1, "tokens": 4}})  # fmt: skip
        Runner(grid, tmp_path, progress=False, log=lambda s: None).run()
        caches = {r["cache"] for r in _rows(tmp_path)}
        assert "test-every-other/quantize/2b(window=8)" in caches
        # --equal-bytes cannot guess a plugin's size parameter: a clear error naming the fix
        grid = _grid(caches=[{"kind": "dynamic", "label": "ref"}, {"policy": "log", "window": 8, "bits": 2}],
                     cross={"policies": ["test-every-other:window=8"], "actions": ["quantize"], "bits": [2]},
                     equal_bytes=True, only={}, tasks={"lm": {"samples_per_context": 1, "tokens": 4}})  # fmt: skip
        with pytest.raises(ConfigError, match="size_params"):
            Runner(grid, tmp_path / "eq", progress=False, log=lambda s: None).run()
    finally:
        registry.unregister(plugin)


def test_unknown_names_fail_before_any_work(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"registered policies: \[.*'log'"):
        _grid(cross={"policies": ["nope"]})
    with pytest.raises(ConfigError, match="registered backends"):
        _grid(cross={"backends": ["nope"]})
    with pytest.raises(ConfigError, match="known tasks"):
        _grid(tasks={"nope": {}})
    with pytest.raises(ConfigError, match="unique"):
        _grid(caches=[{"kind": "dynamic", "label": "x"}, {"kind": "dynamic", "label": "x"}])
    with pytest.raises(ConfigError, match="nbits"):
        _grid(caches=[{"kind": "hf-quantized", "backend": "quanto", "nbits": 3}])
    with pytest.raises(SystemExit) as exit_:  # refused while the command line is parsed
        main(["ablate", "--out", str(tmp_path / "r"), "--model", "tiny-llama", "--policy", "nope"])
    assert exit_.value.code == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_missing_model_fails_fast_and_clearly(tmp_path, capsys):
    rc = main(["ablate", "--out", str(tmp_path / "r"), "--model", "no-such-org/no-such-model", "--baseline", "dynamic"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "no-such-org/no-such-model" in err and "--online" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exit_:  # refused while the command line is parsed
        main(["ablate", "--out", str(tmp_path / "r"), "--model", "/nonexistent/model/dir", "--baseline", "dynamic"])
    assert exit_.value.code == 2 and "does not exist" in capsys.readouterr().err


def test_config_files_toml_and_json(tmp_path):
    from kvpolicy_lab.eval.grid import load_config

    toml = tmp_path / "g.toml"
    toml.write_text('models = ["tiny-llama"]\ncontexts = [64]\n[tasks.lm]\ntokens = 4\n[[caches]]\nkind = "dynamic"\n')
    js = tmp_path / "g.json"
    js.write_text(json.dumps({"models": ["tiny-llama"], "contexts": [64], "tasks": {"lm": {"tokens": 4}},
                              "caches": [{"kind": "dynamic"}]}))  # fmt: skip
    assert grid_from_dict(load_config(toml)).to_dict() == grid_from_dict(load_config(js)).to_dict()
    with pytest.raises(ConfigError, match="unknown config key"):
        grid_from_dict({"modles": ["x"]})
    with pytest.raises(ConfigError, match=r"\.toml or \.json"):
        (tmp_path / "g.yaml").write_text("x")
        load_config(tmp_path / "g.yaml")


def test_cross_product_dedupes_and_applies_bits_only_where_accepted():
    grid = _grid(cross={"policies": ["log", "sink"], "actions": ["quantize", "evict", "none"], "bits": [2, 4]},
                 equal_bytes=False, only={})  # fmt: skip
    labels = [c.label for c in grid.caches]
    assert labels.count("none") == 0 and sum("none" in x for x in labels) == 1  # one uncompressed
    assert "log/quantize/2b" in labels and "log/quantize/4b" in labels and "log/evict" in labels
    assert len(labels) == 1 + 2 * 2 + 2 + 1  # ref + quantize x bits + evict + none


def test_fused_and_materialized_decode_measure_the_same_and_record_their_paths(tmp_path):
    """The grid's ``decode`` mode changes the path, not the measurement (up to float rounding); every
    compressed cell's rows say how its decode steps attended."""
    caches = [
        {"kind": "dynamic", "label": "ref"},
        {"label": "log-k2v2-rot", "policy": "log", "window": 4, "action": "quantize", "bits": 2,
         "transform": "hadamard"},
        {"label": "tiered-cm", "policy": "log", "window": 2, "transform": "hadamard", "action": "tiered",
         "tiers": [{"bits": 4, "scheme": "codebook", "key_centre": True},
                   {"key_bits": 3, "value_bits": 2, "scheme": "codebook", "key_centre": True}],
         "keep": [{"name": "log", "window": 8}]},
    ]  # fmt: skip
    got = {}
    for mode in ("fused", "materialized"):
        grid = _grid(tasks={"lm": {"samples_per_context": 2, "tokens": 12}}, caches=caches, cross={},
                     equal_bytes=False, only={}, decode=mode)  # fmt: skip
        out = tmp_path / mode
        assert Runner(grid, out, progress=False, log=lambda s: None).run() == 0
        got[mode] = {(r["cache"], r["metric"]): r for r in _rows(out)}
        assert f"decode attention: {mode}" in (out / "summary.md").read_text()
    fused, mat = got["fused"], got["materialized"]
    assert fused.keys() == mat.keys()
    for key, row in fused.items():
        assert row["cell"] == mat[key]["cell"]  # a quality cell's id does not depend on the path
        if key[1] in ("kl", "delta_nll", "top1", "bits_per_element"):
            assert row["value"] == pytest.approx(mat[key]["value"], abs=1e-6), key
    for label in ("log-k2v2-rot", "tiered-cm"):
        f_paths = fused[(label, "kl")]["extra"]["attention_paths"]
        m_paths = mat[(label, "kl")]["extra"]["attention_paths"]
        # 2 texts x 11 decode steps x 2 layers, every one on the path the grid asked for
        assert sum(f_paths.values()) == sum(m_paths.values()) == 2 * 11 * 2
        assert all(p.startswith("fused") for p in f_paths), f_paths
        assert all(p.startswith("materialized") for p in m_paths), m_paths
    assert "attention_paths" not in fused[("ref", "kl")]["extra"]
    # a prefill that runs (no replay) is not a decode step: the count is the same
    grid = _grid(tasks={"lm": {"samples_per_context": 2, "tokens": 12}}, caches=caches[1:2], cross={},
                 equal_bytes=False, only={}, replay=False)  # fmt: skip
    assert Runner(grid, tmp_path / "prefill", progress=False, log=lambda s: None).run() == 0
    rows = {(r["cache"], r["metric"]): r for r in _rows(tmp_path / "prefill")}
    assert rows[("log-k2v2-rot", "kl")]["extra"]["attention_paths"] == fused[("log-k2v2-rot", "kl")]["extra"][
        "attention_paths"]  # fmt: skip


def test_decode_mode_enters_only_timing_cell_ids():
    from kvpolicy_lab.eval.grid import cell_id

    fused, mat = _grid(decode="fused"), _grid(decode="materialized")
    spec = fused.caches[1]
    assert cell_id("m", spec, 64, "lm", {}, fused) == cell_id("m", spec, 64, "lm", {}, mat)
    assert cell_id("m", spec, 64, "speed", {}, fused) != cell_id("m", spec, 64, "speed", {}, mat)
    with pytest.raises(ConfigError, match=r"decode must be one of \['fused', 'materialized'\]; got decode='fast'"):
        _grid(decode="fast")


def test_a_scoring_cell_on_an_unwrappable_attention_is_that_cells_error_row():
    """H2O needs attention scores, which kvpolicy reports only through sdpa or eager: on another
    implementation its cell records the ConfigError naming it instead of stopping the run."""
    from kvpolicy_lab.eval.cells import CellGroup
    from kvpolicy_lab.eval.runner import open_model

    grid = _grid(tasks={"lm": {"samples_per_context": 1, "tokens": 4}}, cross={}, equal_bytes=False, only={},
                 caches=[{"label": "h2o", "policy": "h2o", "action": "evict"},
                         {"label": "log", "policy": "log", "window": 4, "bits": 2}])  # fmt: skip
    model, tok = open_model("tiny-llama")
    model.config._attn_implementation = "flash_attention_2"  # as loaded, never run here
    task = grid.task_objects()["lm"]
    group = CellGroup(grid, model, tok, "tiny-llama", 64, "lm", task)
    h2o, log = grid.caches
    bad = group.run("c1", h2o, False)
    assert bad.error is not None and "flash_attention_2" in bad.error and bad.rows[0]["metric"] == "error"
    assert model.config._attn_implementation == "flash_attention_2"  # left alone
    model.config._attn_implementation = "sdpa"
    ok = group.run("c2", log, False)  # the group goes on: the next cell runs (fused, on sdpa)
    assert ok.error is None and ok.rows[0]["extra"]["attention_paths"]
    assert all(p.startswith("fused") for p in ok.rows[0]["extra"]["attention_paths"])


def test_model_caches_run_each_model_on_its_own_subset_and_both_pages_cover_both_models(tmp_path):
    """``[model_caches]`` restricts the caches of one model; the frontier and results pages get one
    part per model and compare the second model's ordering with the first's."""
    from kvpolicy_lab.eval.docs_report import write_results_doc
    from kvpolicy_lab.eval.frontier_report import write_frontier_doc

    def log(label, bits, window=8):
        return {"label": label, "policy": "log", "window": window, "bits": bits, "group_size": 16}

    d = {"models": ["tiny-llama", "tiny-qwen2"], "contexts": [64],
         "tasks": {"lm": {"samples_per_context": 1, "tokens": 6}},
         "caches": [{"kind": "dynamic", "label": "ref"}, log("log-2b", 2), log("log-4b", 4), log("wide-2b", 2, 24)],
         "model_caches": {"tiny-qwen2": ["ref", "log-2b", "log-4b"]}}  # fmt: skip
    grid = grid_from_dict(d)
    assert Runner(grid, tmp_path, progress=False, log=lambda s: None).run() == 0
    rows = _rows(tmp_path)
    assert {r["cache"] for r in rows if r["model"] == "tiny-llama"} == {"ref", "log-2b", "log-4b", "wide-2b"}
    assert {r["cache"] for r in rows if r["model"] == "tiny-qwen2"} == {"ref", "log-2b", "log-4b"}

    text = write_frontier_doc(tmp_path, tmp_path / "docs" / "frontier.md", "cmd").read_text()
    assert "## tiny-llama · context 64" in text and "## tiny-qwen2 · context 64" in text
    tables = (tmp_path / "caches.md").read_text()  # the table of every cache, beside the rows
    assert "`wide-2b`" in tables.split("## tiny-qwen2")[0]
    qwen_tables = tables.split("## tiny-qwen2 · context 64")[1]
    assert "`wide-2b`" not in qwen_tables and "`log-4b`" in qwen_tables
    qwen = text.split("## tiny-qwen2 · context 64")[1].split("## How this page was made")[0]
    assert "`wide-2b`" not in qwen
    assert "### tiny-qwen2 against tiny-llama at context 64" in qwen
    assert "Rank correlation of KL over the 2 caches measured on both" in qwen
    assert (tmp_path / "docs" / "img" / "frontier" / "frontier_tiny-qwen2_64.png").is_file()

    text = write_results_doc(tmp_path, tmp_path / "docs" / "results.md", "cmd").read_text()
    lm = text.split("## Language modelling")[1].split("\n## ")[0]
    assert "### tiny-llama" in lm and "### tiny-qwen2" in lm
    assert "`wide-2b`" not in lm.split("### tiny-qwen2")[1]
    assert "## tiny-llama and tiny-qwen2 side by side" in text

    # a cell that failed on one model (transformers' QuantizedCache refuses Gemma-3's hybrid layers):
    # both pages name it under that model, with its error
    kept = [r for r in rows if not (r["model"] == "tiny-qwen2" and r["cache"] == "log-4b")]
    cell = next(r["cell"] for r in rows if r["model"] == "tiny-qwen2" and r["cache"] == "log-4b")
    error = {**kept[-1], "cell": cell, "model": "tiny-qwen2", "cache": "log-4b", "task": "lm", "metric": "error",
             "value": float("nan"), "extra": {"error": "ValueError: refused here"}}  # fmt: skip
    (tmp_path / RESULTS).write_text("".join(json.dumps(r) + "\n" for r in [*kept, error]))
    text = write_frontier_doc(tmp_path, tmp_path / "docs" / "frontier.md", "cmd").read_text()
    assert "Refused on this model (the error their cells recorded): `log-4b`: ValueError: refused here" in text
    assert "Refused" not in text.split("## tiny-qwen2")[0]
    text = write_results_doc(tmp_path, tmp_path / "docs" / "results.md", "cmd").read_text()
    qwen = text.split("### tiny-qwen2")[1]
    assert "Refused on this model (the error their cells recorded, on every task): `log-4b`: ValueError" in qwen


def test_model_contexts_and_context_caches_restrict_what_runs_where(tmp_path):
    """``[model_contexts]`` keeps a model to some of the grid's contexts, for every task (the frontier
    runs Gemma-3 at 2k only), and ``[context_caches]`` a context to some caches (the frontier's 8k runs
    the issue's grid, not every probe); the count of cells, the planned cells and the rows agree."""
    logs: list[str] = []
    d = {"models": ["tiny-llama", "tiny-qwen2"], "contexts": [40, 64],
         "tasks": {"lm": {"samples_per_context": 1, "tokens": 4}, "passkey": {"depths": [0.5]}},
         "caches": [{"kind": "dynamic", "label": "ref"},
                    {"label": "log-2b", "policy": "log", "window": 8, "bits": 2, "group_size": 16}],
         "model_contexts": {"tiny-qwen2": [64]}, "context_caches": {"40": ["ref"]}}  # fmt: skip
    grid = grid_from_dict(d)
    assert grid.runs_at("tiny-llama", 40) and grid.runs_at("tiny-qwen2", 64) and not grid.runs_at("tiny-qwen2", 40)
    runner = Runner(grid, tmp_path, progress=False, log=logs.append)
    assert runner.run() == 0
    rows = _rows(tmp_path)
    seen = {(r["model"], r["context"], r["task"], r["cache"]) for r in rows}
    runs = lambda m, c, k: (m == "tiny-llama" or c == 64) and (c == 64 or k == "ref")  # noqa: E731
    assert seen == {(m, c, t, k) for m in ("tiny-llama", "tiny-qwen2") for c in (40, 64) for t in ("lm", "passkey")
                    for k in ("ref", "log-2b") if runs(m, c, k)}  # fmt: skip
    # 2 tasks x (1 cache at 40 + 2 at 64 for tiny-llama, 2 at 64 for tiny-qwen2)
    assert any("ablation: 10 cells (10 run, 0 already done), 0 failed" in line for line in logs), logs
    assert len(json.loads((tmp_path / "config.json").read_text())["cells"]) == 10
    from kvpolicy_lab.eval.frontier_report import write_frontier_doc

    text = write_frontier_doc(tmp_path, tmp_path / "docs" / "frontier.md", "cmd").read_text()
    assert "tiny-qwen2 (context 64 only) a subset" in text
    assert "## tiny-qwen2 · context 64" in text and "## tiny-qwen2 · context 40" not in text
    assert "## tiny-llama · context 40" in text and "Not measured yet" not in text

    base = {k: v for k, v in d.items() if k != "model_contexts"}
    with pytest.raises(ConfigError, match=r"model_contexts: 'gemma' is not a model of the grid; models: "):
        grid_from_dict({**base, "model_contexts": {"gemma": [64]}})
    with pytest.raises(ConfigError, match=r"model_contexts.tiny-qwen2: context\(s\) \[128\] are not contexts of the "
                                          r"grid: \[40, 64\]"):  # fmt: skip
        grid_from_dict({**base, "model_contexts": {"tiny-qwen2": [64, 128]}})
    with pytest.raises(ConfigError, match=r"\[model_contexts\] tiny-qwen2 must be a list"):
        grid_from_dict({**base, "model_contexts": {"tiny-qwen2": 64}})
    base = {k: v for k, v in base.items() if k != "context_caches"}
    with pytest.raises(ConfigError, match=r"context_caches: '128' is not a context of the grid: \[40, 64\]"):
        grid_from_dict({**base, "context_caches": {"128": ["ref"]}})
    with pytest.raises(ConfigError, match=r"context_caches.40: unknown cache label\(s\) \['nope'\]"):
        grid_from_dict({**base, "context_caches": {"40": ["nope"]}})
    # --model drops the other models' restrictions; --context keeps a restricted model to what remains of its
    # contexts (here none: it runs nothing), and drops the other contexts' restrictions
    cfg = tmp_path / "g.toml"
    cfg.write_text(
        'models = ["tiny-llama", "tiny-qwen2"]\ncontexts = [40, 64]\n[tasks.lm]\nsamples_per_context = 1\n'
        'tokens = 4\n[model_contexts]\ntiny-qwen2 = [64]\n[context_caches]\n64 = ["ref"]\n[[caches]]\nlabel = "ref"\n'
        'kind = "dynamic"\n'
    )
    assert main(["ablate", "--config", str(cfg), "--model", "tiny-llama", "--out", str(tmp_path / "a"),
                 "--no-progress"]) == 0  # fmt: skip
    assert {(r["model"], r["context"]) for r in _rows(tmp_path / "a")} == {("tiny-llama", 40), ("tiny-llama", 64)}
    assert main(["ablate", "--config", str(cfg), "--context", "40", "--out", str(tmp_path / "b"),
                 "--no-progress"]) == 0  # fmt: skip
    assert {(r["model"], r["context"]) for r in _rows(tmp_path / "b")} == {("tiny-llama", 40)}


def test_attention_error_can_be_left_out_at_some_contexts_without_changing_anything_else(tmp_path):
    """``attention_error = [contexts]`` skips the shadow attention (a third of an 8k decode step) where it
    is off: those rows lack ``attn_error`` and have ids of their own; the other metrics are the same as
    with the probe, and the cells that keep it keep their ids (the frontier's 2k cells stay valid)."""
    from kvpolicy_lab.eval.grid import cell_id

    d = {"models": ["tiny-llama"], "contexts": [40, 64], "tasks": {"lm": {"samples_per_context": 1, "tokens": 5}},
         "caches": [{"label": "log-2b", "policy": "log", "window": 8, "bits": 2, "group_size": 16}]}  # fmt: skip
    on, partial = grid_from_dict(d), grid_from_dict({**d, "attention_error": [64]})
    assert [partial.attention_error_at(c) for c in (40, 64, None)] == [False, True, True]
    params = {"samples_per_context": 1, "tokens": 5}
    spec = on.caches[0]
    assert cell_id("tiny-llama", spec, 64, "lm", params, on) == cell_id("tiny-llama", spec, 64, "lm", params, partial)
    assert cell_id("tiny-llama", spec, 40, "lm", params, on) != cell_id("tiny-llama", spec, 40, "lm", params, partial)
    assert Runner(on, tmp_path / "on", progress=False, log=lambda s: None).run() == 0
    assert Runner(partial, tmp_path / "partial", progress=False, log=lambda s: None).run() == 0
    got = {(r["context"], r["metric"]): r["value"] for r in _rows(tmp_path / "partial")}
    ref = {(r["context"], r["metric"]): r["value"] for r in _rows(tmp_path / "on")}
    assert (40, "attn_error") not in got and (64, "attn_error") in got and (40, "attn_error") in ref
    for key, value in ref.items():
        if key != (40, "attn_error"):
            assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    with pytest.raises(ConfigError, match=r"attention_error: context\(s\) \[128\] are not in the grid's contexts"):
        grid_from_dict({**d, "attention_error": [128]})
    with pytest.raises(ConfigError, match=r"attention_error must be a list"):
        grid_from_dict({**d, "attention_error": "yes"})


def test_model_caches_name_models_and_labels_of_the_grid(tmp_path):
    base = {"models": ["tiny-llama"], "contexts": [64], "tasks": {"lm": {"samples_per_context": 1, "tokens": 4}},
            "caches": [{"kind": "dynamic", "label": "ref"}]}  # fmt: skip
    with pytest.raises(ConfigError, match=r"model_caches: 'tiny-qwen2' is not a model of the grid; models: "):
        grid_from_dict({**base, "model_caches": {"tiny-qwen2": ["ref"]}})
    with pytest.raises(ConfigError, match=r"model_caches.tiny-llama: unknown cache label\(s\) \['nope'\]"):
        grid_from_dict({**base, "model_caches": {"tiny-llama": ["nope"]}})
    with pytest.raises(ConfigError, match=r"\[model_caches\] tiny-llama must be a list"):
        grid_from_dict({**base, "model_caches": {"tiny-llama": "ref"}})
    # --model picks models of the config: the other models' restrictions go with them
    cfg = tmp_path / "g.toml"
    cfg.write_text(
        'models = ["tiny-llama", "tiny-qwen2"]\ncontexts = [64]\n[tasks.lm]\nsamples_per_context = 1\n'
        'tokens = 4\n[model_caches]\ntiny-qwen2 = ["ref"]\n[[caches]]\nlabel = "ref"\nkind = "dynamic"\n'
    )
    assert main(["ablate", "--config", str(cfg), "--model", "tiny-llama", "--out", str(tmp_path / "o"),
                 "--no-progress"]) == 0  # fmt: skip
    assert {r["model"] for r in _rows(tmp_path / "o")} == {"tiny-llama"}


def test_the_frontier_page_points_at_gemmas_needles_where_they_are_measured():
    """Gemma-3's section names the needle results another grid makes (the lab notebook's page), and the
    section it names exists there."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    page = (root / "docs" / "frontier.md").read_text()
    gemma = page[page.index("## Gemma-3-270M · context 2048") :]
    assert "`lab/notebook/results-gemma3.md`, section *Needles at 4k and 8k*" in gemma.split("\n## ")[0]
    assert "\n### Needles at 4k and 8k\n" in (root / "lab" / "notebook" / "results-gemma3.md").read_text()
