"""Cell ids hash each cache's canonical dict, not its repr; run directories of the repr-hashed ids
(scheme 1) are refused until :mod:`kvpolicy_lab.eval.migrate_ids` has renamed their cells.

A scheme-1 directory is made from a finished run by recomputing each row's id the way scheme 1 did,
spelled out here on its own: SHA-1 over the sorted JSON of the cell's fields with the cache's repr.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from lab_fixtures import one_thread  # noqa: F401  (pytest fixtures)

from kvpolicy.actions.quantize import Quantize
from kvpolicy.cli import main
from kvpolicy.errors import ConfigError
from kvpolicy_lab.eval.caches import CacheSpec
from kvpolicy_lab.eval.grid import CELL_IDS, cell_id, grid_from_dict
from kvpolicy_lab.eval.migrate_ids import main as migrate_main
from kvpolicy_lab.eval.migrate_ids import migrate
from kvpolicy_lab.eval.runner import CONFIG, RESULTS, SAMPLES, Runner, current_rows

pytestmark = pytest.mark.usefixtures("one_thread")

GRID = {
    "models": ["tiny-llama"],
    "contexts": [32],
    "tasks": {"lm": {"samples_per_context": 1, "tokens": 4}, "greedy": {"samples_per_context": 1, "tokens": 4}},
    "caches": [{"kind": "dynamic", "label": "ref"}, {"policy": "log", "window": 8, "bits": 2, "label": "log"}],
    "replay": False,
}
FLAGS = [
    "--model",
    "tiny-llama",
    "--context",
    "32",
    "--task",
    "lm:samples_per_context=1:tokens=4",
    "--baseline",
    "dynamic",
]


def _run(out):
    log: list[str] = []
    failed = Runner(grid_from_dict(GRID), out, progress=False, log=log.append).run()
    return failed, log


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _scheme1_id(row, grid_dict, task_params):
    """The id scheme 1 gave ``row``'s cell (its fields, the cache by its repr)."""
    key = {"model": row["model"], "dtype": "float32", "device": "cpu", "cache": row["repr"],
           "context": row["context"], "task": row["task"], "params": task_params[row["task"]], "seed": 0,
           "replay": grid_dict["replay"]}  # fmt: skip
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished scheme-2 run directory."""
    out = tmp_path_factory.mktemp("run")
    failed, _ = _run(out)
    assert failed == 0
    return out


@pytest.fixture
def scheme1(finished, tmp_path):
    """A copy of ``finished`` as an earlier version wrote it: scheme-1 ids, no ``cell_ids`` in rows."""
    import shutil

    out = tmp_path / "old"
    shutil.copytree(finished, out, ignore=shutil.ignore_patterns(".kvpolicy.lock"))
    grid = grid_from_dict(GRID)
    rows = _records(out / RESULTS)
    old_of = {}
    for row in rows:
        old_of[row["cell"]] = _scheme1_id(row, GRID, _asdict_params(grid))
        del row["cell_ids"]
        row["cell"] = old_of[row["cell"]]
    _write(out / RESULTS, rows)
    samples = _records(out / SAMPLES)
    for s in samples:
        s["cell"] = old_of[s["cell"]]
    _write(out / SAMPLES, samples)
    config = json.loads((out / CONFIG).read_text())
    config["cells"] = sorted(old_of[c] for c in config["cells"])
    for c in config["caches"]:
        del c["canonical"]
    (out / CONFIG).write_text(json.dumps(config, indent=2))
    return out, old_of


def _files(out):
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".kvpolicy.lock"}


def _asdict_params(grid):
    from dataclasses import asdict

    return {name: (task if isinstance(task, dict) else asdict(task)) for name, task in grid.task_objects().items()}


def test_scheme1_ids_are_those_an_earlier_version_wrote(finished, scheme1):
    """The fixture's scheme-1 ids are real ones: the migration (which plans them from the grid) finds
    every row, so the two spellings of scheme 1 agree."""
    out, old_of = scheme1
    mapping = migrate(out, dry_run=True, log=lambda _: None)
    assert {old: new for new, old in old_of.items()} == {k: v for k, v in mapping.items() if k in old_of.values()}


def test_a_run_report_and_merge_refuse_a_scheme1_directory(scheme1, tmp_path, capsys):
    out, _ = scheme1
    before = (out / RESULTS).read_bytes()
    with pytest.raises(ConfigError, match=r"cell-id scheme 1 .*python -m kvpolicy_lab.eval.migrate_ids"):
        _run(out)
    assert (out / RESULTS).read_bytes() == before  # no cell ran beside the old rows
    assert main(["ablate", "--out", str(out), "--report-only", *FLAGS]) == 2
    err = capsys.readouterr().err
    assert "migrate_ids" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert main(["ablate", "--out", str(tmp_path / "merged"), "--merge", str(out)]) == 2
    assert "migrate_ids" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="migrate_ids"):
        current_rows(out)


def test_migration_renames_every_cell_and_the_run_resumes(finished, scheme1):
    out, _ = scheme1
    assert migrate_main([str(out)]) == 0
    # the same records as the scheme-2 run wrote, byte for byte (ids, markers and order alike)
    assert (out / RESULTS).read_text() == (finished / RESULTS).read_text()
    assert (out / SAMPLES).read_text() == (finished / SAMPLES).read_text()
    assert json.loads((out / CONFIG).read_text()) == json.loads((finished / CONFIG).read_text())
    failed, log = _run(out)
    assert failed == 0 and "(0 run, 4 already done)" in next(x for x in log if x.startswith("ablation:"))
    assert migrate(out, log=lambda _: None) == {}  # a second migration has nothing to do


def test_a_row_that_does_not_fit_the_grid_refuses_and_writes_nothing(scheme1, capsys):
    out, _ = scheme1
    rows = _records(out / RESULTS)
    rows[-1]["repr"] = rows[-1]["repr"].replace("window=8", "window=9")  # measured another cache
    _write(out / RESULTS, rows)
    files = _files(out)
    assert migrate_main([str(out)]) == 2
    err = capsys.readouterr().err
    assert "the row measured" in err and "window=9" in err and "nothing was written" in err
    assert _files(out) == files


def test_a_row_of_another_model_refuses(scheme1):
    out, _ = scheme1
    rows = _records(out / RESULTS)
    rows[0]["cache"] = "log"  # the id says one cache, the label another
    _write(out / RESULTS, rows)
    with pytest.raises(ConfigError, match=r"the row says .*'cache': 'log'.* the grid plans"):
        migrate(out, log=lambda _: None)


def test_dry_run_writes_nothing(scheme1):
    out, _ = scheme1
    files = _files(out)
    assert migrate_main([str(out), "--dry-run"]) == 0
    assert _files(out) == files


def test_no_run_there_is_one_line(tmp_path, capsys):
    assert migrate_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds no ablation run" in err and len(err.strip().splitlines()) == 1


def test_a_cell_id_does_not_depend_on_how_a_cache_prints(monkeypatch):
    grid = grid_from_dict(GRID)
    spec = grid.caches[1]
    before = cell_id("tiny-llama", spec, 32, "lm", {"tokens": 4}, grid)
    monkeypatch.setattr(Quantize, "__repr__", lambda self: "Quantize(<printed otherwise>)")
    assert "printed otherwise" in spec.describe()
    assert cell_id("tiny-llama", spec, 32, "lm", {"tokens": 4}, grid) == before


@pytest.mark.parametrize(
    "other",
    [
        {"policy": "log", "window": 8, "bits": 3},
        {"policy": "log", "window": 9, "bits": 2},
        {"policy": "log", "window": 8, "bits": 2, "backend": "torch"},
    ],
)
def test_a_cell_id_changes_with_what_decides_the_result(other):
    grid = grid_from_dict(GRID)
    ids = {
        cell_id("tiny-llama", spec, 32, "lm", {"tokens": 4}, grid)
        for spec in (grid.caches[1], CacheSpec("compressed", other))
    }
    assert len(ids) == 2


def test_equal_specs_written_differently_share_an_id():
    grid = grid_from_dict(GRID)
    a = CacheSpec("compressed", {"policy": "log", "window": 8, "bits": 2})
    b = CacheSpec("compressed", {"policy": "log", "action": "quantize", "bits": 2, "window": 8}, label="other label")
    assert cell_id("m", a, 32, "lm", {}, grid) == cell_id("m", b, 32, "lm", {}, grid)


def test_the_scheme_is_recorded_in_every_row(finished):
    assert {r["cell_ids"] for r in _records(finished / RESULTS)} == {CELL_IDS}


def test_a_format_parameter_added_later_changes_no_id_at_the_value_that_computes_as_before(monkeypatch):
    """Format.added_defaults: a parameter at the value reproducing its format's earlier arithmetic is left out of
    the hashed spec (so rows measured before it existed stay matched); any other value enters the id."""
    from kvpolicy.formats.codebook import Codebook

    grid = grid_from_dict(GRID)
    args = {"policy": "log", "window": 8, "bits": 3, "scheme": "codebook", "transform": "hadamard"}
    plain, sixteen = CacheSpec("compressed", args), CacheSpec("compressed", {**args, "norm_bits": 16})
    one_byte = CacheSpec("compressed", {**args, "norm_bits": 8})
    ids = [cell_id("m", s, 32, "lm", {}, grid) for s in (plain, sixteen, one_byte)]
    assert ids[0] == ids[1] != ids[2]
    assert "norm_bits" not in json.dumps(plain.canonical()) and '"norm_bits": 8' in json.dumps(one_byte.canonical())
    # the id a spec had before the parameter existed: its dict without the parameter
    monkeypatch.setattr(Codebook, "added_defaults", {})
    assert cell_id("m", plain, 32, "lm", {}, grid) != ids[0]  # without the declaration the id moves


def test_every_committed_frontier_row_names_a_cell_its_grid_plans():
    """The committed run directory results/frontier: each row's cell id is one its config.json's grid plans with
    the code as it is, so a re-run skips every measured cell instead of measuring it again."""
    from pathlib import Path

    from kvpolicy_lab.eval.migrate_ids import grid_of, planned_cells

    out = Path(__file__).resolve().parents[2] / "results" / "frontier"
    config = json.loads((out / CONFIG).read_text())
    planned = {c.new for c in planned_cells(grid_of(config), config.get("sizings") or [])}
    stale = sorted({(r["cache"], r["task"], r["context"]) for r in _records(out / RESULTS) if r["cell"] not in planned})
    assert not stale, f"{len(stale)} measured cells would be measured again: {stale[:5]}"


def test_scheme1_descriptions_leave_out_the_min_max_fits_todays_repr_names():
    """A min-max-key cache's repr now names ``key_fit='minmax'`` (the keys' default fit is ``"mse"``, and the
    repr must build the cache it names); scheme-1 ids hashed the repr without it, as this row of an earlier
    results page recorded it, so the migration hashes that form."""
    from kvpolicy import CompressedCache
    from kvpolicy_lab.eval.migrate_ids import scheme1_description

    recorded = (
        "CompressedCache(policy=LogWindow(window=42), action=Quantize(bits=2, group_size=64, key_axis='channel', "
        "value_axis='token', check_finite=True), backend='cpu', layout='ordered', attention='auto')"
    )
    cache = CompressedCache(policy="log", bits=2, group_size=64, fit="minmax", backend="cpu")
    assert "key_fit='minmax'" in repr(cache)
    assert scheme1_description(repr(cache)) == recorded
    fitted = repr(CompressedCache(policy="log", bits=2, backend="cpu"))
    assert scheme1_description(fitted) == fitted and "key_fit='mse'" in fitted
