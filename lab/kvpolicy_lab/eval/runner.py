"""The ablation runner: every cell of a :class:`~kvpolicy_lab.eval.grid.Grid`, resumable, into one directory.

Output (evaluation.md §4)::

    OUT/config.json     the grid, the exact repr of every cache, --equal-bytes sizings
    OUT/results.jsonl   one row per cell × metric (written when the cell finishes)
    OUT/samples.jsonl   per-sample generations and scores of the generation tasks
    OUT/summary.md      tables (regenerated at the end of every run)
    OUT/*.png           quality vs bytes held; ms/token vs context
    OUT/.kvpolicy.lock  held by the run writing OUT (:mod:`kvpolicy_lab.eval.lock`)

A cell is model × cache × context × task. Cells whose id (a hash of everything that determines the
result) already has its rows in ``results.jsonl`` are skipped, so an interrupted run resumes where
it stopped. A cell that raises is recorded as an error row and retried by the next run. The datasets
the tasks read (:mod:`kvpolicy_lab.eval.data`) are fetched into the user cache before any model is
loaded; one that cannot be fetched stops the run with a :class:`~kvpolicy.errors.ConfigError` that
says what to fetch and how.

Cells run in this process by default, or elsewhere through an executor
(:mod:`kvpolicy_lab.eval.executors`: Ray workers); either way only this process writes ``OUT``. With a
:class:`~kvpolicy_lab.eval.plan.Shard` the run takes only its share of the cells (``--shard i/n``);
:mod:`kvpolicy_lab.eval.merge` combines the shards' directories.

Damaged run directories: a last line of ``results.jsonl`` (or ``samples.jsonl``) cut by an
interruption is dropped before the run appends (its cell runs again); other lines that are not
result rows are skipped with a one-line warning (the cells they belonged to run again).
``config.json`` and ``sizing.json`` are replaced whole (:func:`write_whole`), so an interruption
leaves the old file or the new one. ``config.json`` is rewritten by every run; only
``--report-only`` needs it, and an unreadable one is then a :class:`~kvpolicy.errors.ConfigError`
that says how to recover. The ``sizing.json`` memo of ``--equal-bytes`` is recomputed when
unreadable. The commands that write a run directory hold its lock (:mod:`kvpolicy_lab.eval.lock`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm

from kvpolicy import persist
from kvpolicy.errors import ConfigError
from kvpolicy_lab.eval.caches import CacheSpec
from kvpolicy_lab.eval.cells import CellGroup, CellResult
from kvpolicy_lab.eval.grid import CELL_IDS, DTYPES, Grid, check_model_available
from kvpolicy_lab.eval.lock import hold_run_dir
from kvpolicy_lab.eval.plan import Group, Shard, equal_specs, plan_groups
from kvpolicy_lab.eval.tasks import Task

RESULTS = "results.jsonl"
SAMPLES = "samples.jsonl"
CONFIG = "config.json"
#: what :meth:`Runner._write_config` adds to the grid's own settings in ``config.json``
RUN_KEYS = ("cells", "sizings", "shard", "torch", "transformers")


def open_model(name: str, dtype: str = "float32", device: str = "cpu", online: bool = False) -> tuple[Any, Any]:
    """Load a model by name (``smollm2``, ``tiny-<family>[-layers]``, a local path or a hub id).

    Raises :class:`~kvpolicy.errors.ConfigError` with a one-line reason when it cannot be loaded.
    """
    from kvpolicy.tiny import parse_tiny, tiny_model

    if dtype not in DTYPES:
        raise ConfigError(f"open_model: dtype must be one of {list(DTYPES)}; got dtype={dtype!r:.40}")
    torch_dtype = persist.dtype_of(dtype)
    check_model_available(name, online)
    tiny = parse_tiny(name)
    if tiny is not None:
        model, tok = tiny_model(tiny)
        return model.to(device=device, dtype=torch_dtype), tok
    from kvpolicy_lab.eval.models import load_model

    try:
        return load_model(name, dtype=torch_dtype, device=device)
    except (FileNotFoundError, ValueError, ImportError, OSError) as exc:
        raise ConfigError(f"model {name!r} could not be loaded: {exc}") from exc


def _is_row(row: Any) -> bool:
    """Whether ``row`` (a parsed line) is a result row: an object with a cell id and a metric."""
    return isinstance(row, dict) and isinstance(row.get("cell"), str) and isinstance(row.get("metric"), str)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read ({exc.strerror}); fix its permissions or use a new --out") from None


def scan_rows(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """The result rows of a ``results.jsonl`` and the numbers of the lines that are not rows.

    Parameters
    ----------
    path : Path
        A JSON-lines file; missing means empty.

    Returns
    -------
    rows : list of dict
        Every line that parses as an object with ``cell`` and ``metric``, in file order.
    bad : list of int
        1-based numbers of the other non-blank lines (garbage, a row cut by an interruption).

    Raises
    ------
    ConfigError
        The file exists but cannot be read.
    """
    if not path.exists():
        return [], []
    rows, bad = [], []
    for number, line in enumerate(_read_bytes(path).split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            row = None
        if _is_row(row):
            rows.append(row)
        else:
            bad.append(number)
    return rows, bad


def done_cells(rows: list[dict[str, Any]]) -> set[str]:
    """Ids of the cells whose every row is among ``rows`` (error rows do not count)."""
    counts: dict[str, int] = {}
    expected: dict[str, int] = {}
    for row in rows:
        if row["metric"] == "error":
            continue
        cid = row["cell"]
        n = row.get("rows_in_cell", 0)
        counts[cid] = counts.get(cid, 0) + 1
        expected[cid] = n if isinstance(n, int) else 0
    return {c for c, n in counts.items() if n >= expected[c]}


def load_done(path: Path) -> set[str]:
    """Ids of finished cells in ``results.jsonl`` (every row of the cell present, no error)."""
    return done_cells(scan_rows(path)[0])


def run_rows(out: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """:func:`scan_rows` of ``out/results.jsonl``, refused (:func:`check_cell_ids`) when its cells are
    named by an older scheme of ids; every reader of a run directory but the migration reads through it."""
    rows, bad = scan_rows(out / RESULTS)
    check_cell_ids(out, rows)
    return rows, bad


def read_rows(out: Path) -> list[dict[str, Any]]:
    """Every result row of ``out/results.jsonl`` (lines that are not rows are left out)."""
    return run_rows(out)[0]


def current_rows(out: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``out``'s config and the latest row of each (cell, metric) of the cells that config lists
    (rows of cells no longer in the grid, and error rows, left out)."""
    config = read_config(out)
    ids = set(config.get("cells", []))
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    for r in read_rows(out):
        if r.get("cell") in ids and r["metric"] != "error":
            latest[(r["cell"], r["metric"])] = r
    return config, list(latest.values())


def report_rows(rows: list[dict[str, Any]], ids: set[str]) -> list[dict[str, Any]]:
    """The rows a report shows: the latest per (cell, metric) of the cells ``ids``, and the error row
    of a cell only while it has no other row."""
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        if row.get("cell") in ids:
            latest[(row["cell"], row["metric"])] = row
    ok = {cell for cell, metric in latest if metric != "error"}
    return [r for (cell, metric), r in latest.items() if metric != "error" or cell not in ok]


def repair_tail(path: Path) -> int:
    """Make ``path`` end with a complete line, as an interrupted append may not have.

    A last line without its newline is kept (newline added) when it is a whole JSON object, and
    cut off otherwise, so that the next append starts on a line of its own.

    Parameters
    ----------
    path : Path
        A JSON-lines file; nothing happens when it is missing or ends with a newline.

    Returns
    -------
    int
        Bytes cut off (0 when nothing was).
    """
    if not path.exists():
        return 0
    data = _read_bytes(path)
    if not data or data.endswith(b"\n"):
        return 0
    start = data.rfind(b"\n") + 1
    try:
        whole = isinstance(json.loads(data[start:].decode("utf-8")), dict)
    except (UnicodeDecodeError, json.JSONDecodeError):
        whole = False
    try:
        if whole:
            with path.open("ab") as fh:
                fh.write(b"\n")
            return 0
        os.truncate(path, start)
    except OSError as exc:
        raise ConfigError(
            f"{path} cannot be repaired ({exc.strerror}); fix its permissions or use a new --out"
        ) from None
    return len(data) - start


def write_whole(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one step: an interruption leaves the old file or the new one.

    The text goes to ``<name>.tmp`` beside it first, then :func:`os.replace` puts it in place.

    Raises
    ------
    ConfigError
        The file cannot be written (the message names it and the system's reason).
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        raise ConfigError(f"{path} cannot be written ({exc.strerror}); choose another --out") from None


def read_config(out: Path) -> dict[str, Any]:
    """``out/config.json`` as written by :class:`Runner`.

    Raises
    ------
    ConfigError
        The file is missing, unreadable, not JSON or not a run's config; the message names the file
        and how to recover.
    """
    path = out / CONFIG
    recover = "run the grid again without --report-only (it rewrites config.json and skips finished cells)"
    if not path.is_file():
        raise ConfigError(f"{path} not found: {out} holds no ablation run; {recover}")
    try:
        config = json.loads(_read_bytes(path).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); {recover}") from None
    if not isinstance(config, dict) or not isinstance(config.get("cells", []), list):
        raise ConfigError(f"{path} is not an ablation run's config (no list of cells); {recover}")
    return config


def check_cell_ids(out: Path, rows: list[dict[str, Any]]) -> None:
    """Refuse rows whose cells are named by another scheme of ids than
    :data:`~kvpolicy_lab.eval.grid.CELL_IDS` (each row records its scheme as ``cell_ids``; rows without it
    hashed each cache's ``repr``). A run would not find them and would run the same cells again beside
    them; a report would show them beside cells they duplicate."""
    old = [r for r in rows if r.get("cell_ids") != CELL_IDS]
    if old:
        schemes = sorted({str(r.get("cell_ids", 1)) for r in old})
        raise ConfigError(
            f"{out / RESULTS}: {len(old)} of {len(rows)} rows name their cells by cell-id scheme {', '.join(schemes)} "
            f"(written by an earlier version, ids hashed from each cache's repr); this version reads scheme "
            f"{CELL_IDS} only. Migrate the directory once: python -m kvpolicy_lab.eval.migrate_ids {out} "
            "(or choose another --out)"
        )


class Executor(Protocol):
    """Where a :class:`Runner`'s cells run (see :mod:`kvpolicy_lab.eval.executors`)."""

    def check(self, grid: Grid) -> None:
        """Refuse, before any work, a grid or setting this executor cannot run."""

    def run(self, runner: Runner, tasks: dict[str, Any], done: set[str], bar: Any) -> None:
        """Run the pending cells of ``runner``'s grid, handing each result to :meth:`Runner.record`."""


class Runner:
    """Runs a grid into ``out`` (see the module docstring).

    Parameters
    ----------
    grid : Grid
    out : str or Path
        Run directory (created).
    progress : bool
        Show tqdm bars (over cells, and within long cells).
    log : callable
        Where messages go.
    executor : Executor, optional
        Where the cells run (default: here, one model at a time).
    shard : Shard, optional
        Run only this shard's share of the cells (default: all).
    """

    def __init__(self, grid: Grid, out: str | Path, progress: bool = True, log: Callable[[str], None] = print,
                 executor: Executor | None = None, shard: Shard | None = None):  # fmt: skip
        self.grid = grid
        self.out = Path(out)
        self.progress = progress
        self.log = log
        self.executor = executor
        self.shard = shard
        self.sizings: list[dict[str, Any]] = []
        self.errors = 0
        self.ran = 0
        self.skipped = 0
        self._finished: set[str] = set()
        self._warned = False
        self._model_name = ""
        self._index = 0  # cells numbered so far, in grid order (shards)
        self._cells: list[str] = []  # ids of the cells of this run (this shard's when sharded)

    # ------------------------------------------------------------------ entry
    def run(self) -> int:
        """Run every pending cell; returns the number of cells that raised.

        ``OUT``'s lock is held from when the checks have passed until the report is written: a
        :class:`~kvpolicy.errors.ConfigError` names the process when another one holds it.
        """
        grid = self.grid
        if self.executor is None:
            for name in grid.models:  # fail fast on names before any work
                check_model_available(name, grid.online)
            _check_device(grid.device)
        else:
            self.executor.check(grid)
        tasks = grid.task_objects()
        for task in tasks.values():  # the datasets the tasks read, before any model is loaded (fails fast offline)
            if isinstance(task, Task):
                task.fetch(progress=self.progress)
        total = sum(self._count_cells(tasks, model) for model in grid.models)
        if self.shard is not None:
            total = self.shard.size(total)
        self._make_out()
        with hold_run_dir(self.out):  # one run at a time writes OUT; a second is refused here, before any cell
            self._run_cells_of(tasks, total)
        return self.errors

    def _run_cells_of(self, tasks: dict[str, Any], total: int) -> None:
        """:meth:`run` once the checks are done and ``OUT`` is held: every pending cell, then the report."""
        # every cell the run can name before loading a model, so that a report after an interruption
        # still covers the finished cells of the groups the run did not reach (a shard numbers its
        # cells as it goes: its list grows group by group)
        done = self._load_results()  # refuses rows of older cell ids before anything is written
        self._write_config(self._planned_cells(tasks) if self.shard is None else None, fresh=True)
        bar = tqdm(total=total, desc="cells", disable=not self.progress, dynamic_ncols=True)
        t0 = time.perf_counter()
        try:
            if self.executor is None:
                for model_name in self.grid.models:
                    self.run_model(model_name, tasks, done, bar)
            else:
                self.executor.run(self, tasks, done, bar)
        finally:
            bar.close()
        self._verify_rows()
        self.log(f"ablation: {total} cells ({self.ran} run, {self.skipped} already done), {self.errors} failed, "
                 f"{time.perf_counter() - t0:.0f} s -> {self.out}")  # fmt: skip
        self.report()

    def report(self) -> None:
        """Write summary.md and the plots from the rows of the current grid."""
        from kvpolicy_lab.eval.plots import write_plots
        from kvpolicy_lab.eval.summary import write_summary

        rows = self.current_rows()
        write_summary(self.out, rows, self.grid, self.sizings)
        write_plots(self.out, rows)

    def current_rows(self) -> list[dict[str, Any]]:
        """Rows of ``results.jsonl`` that belong to the cells of this grid (latest per cell and metric)."""
        ids = set(read_config(self.out).get("cells", []))
        rows, bad = run_rows(self.out)
        self._warn_bad_lines(bad, "the report leaves them out")
        return report_rows(rows, ids)

    # ------------------------------------------------------------------ for executors
    def plan(self, model_name: str, tasks: dict[str, Any], model: Any) -> Iterator[Group]:
        """The groups of cells of ``model_name`` (``tasks``: the grid's task objects; ``model``: loaded, used
        only to size ``--equal-bytes`` copies, whose sizings go to ``sizing.json`` and :attr:`sizings`)."""
        self._model_name = model_name
        return plan_groups(self.grid, model_name, tasks, lambda context, steps: self._specs_for(model, context, steps))

    def take_pending(self, group: Group, done: set[str], bar: Any) -> list[tuple[str, CacheSpec, bool]]:
        """Number ``group``'s cells, keep this run's (its shard's), count the finished ones as skipped
        and return the others; call once per group, in plan order."""
        todo = []
        for cid, spec, eq in group.cells:
            index = self._index
            self._index += 1
            if self.shard is not None and not self.shard.owns(index):
                continue
            self._cells.append(cid)
            if cid in done:
                self.skipped += 1
                bar.update(1)
            else:
                todo.append((cid, spec, eq))
        return todo

    def record(self, result: CellResult, bar: Any) -> None:
        """Write a cell's result (its rows, or its error row and a message) and count it."""
        if result.error is not None:
            self.errors += 1
            self.log(f"cell {result.cache} | {result.task} | ctx {result.context} FAILED: {result.error}")
            self._append(RESULTS, result.rows)
        else:
            if result.samples:
                self._append(SAMPLES, result.samples)
            self._append(RESULTS, result.rows)
            self._finished.add(result.cid)
        bar.update(1)

    def write_cells(self) -> None:
        """Add the cells numbered so far to ``config.json``."""
        self._write_config(self._cells)

    def runs_attention(self) -> bool:
        """Whether this run does the grid's attention analysis (the first shard does it)."""
        return bool(self.grid.attention) and (self.shard is None or self.shard.index == 0)

    def attention_params(self) -> dict[str, Any]:
        """Keyword arguments of :func:`~kvpolicy_lab.eval.attention_analysis.analyze_attention` from the grid."""
        return {k: v for k, v in self.grid.attention.items() if k in ("context", "queries", "top_k", "window")}

    def attention_dir(self, model_name: str) -> Path:
        """Where the attention analysis of ``model_name`` goes."""
        return self.out / "attention" / _slug(model_name)

    # ------------------------------------------------------------------ internals
    def _make_out(self) -> None:
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"run directory {str(self.out)!r} cannot be created ({exc.strerror}); "
                              "choose another --out") from None  # fmt: skip

    def _load_results(self) -> set[str]:
        """Repair a cut last line, warn about lines that are not rows; the ids of finished cells."""
        for name in (RESULTS, SAMPLES):
            cut = repair_tail(self.out / name)
            if cut:
                self.log(f"warning: {self.out / name}: dropped its last line ({cut} bytes), cut by an interrupted "
                         "run; that cell runs again")  # fmt: skip
        rows, bad = run_rows(self.out)
        self._warn_bad_lines(bad, "cells missing rows run again")
        return done_cells(rows)

    def _warn_bad_lines(self, bad: list[int], consequence: str) -> None:
        """One warning per runner for the lines of results.jsonl that are not rows."""
        if not bad or self._warned:
            return
        self._warned = True
        shown = ", ".join(str(n) for n in bad[:5]) + (", ..." if len(bad) > 5 else "")
        self.log(f"warning: {self.out / RESULTS}: skipped {len(bad)} line(s) that are not result rows (line {shown}); "
                 f"{consequence}. Delete those lines to silence this warning")  # fmt: skip

    def _verify_rows(self) -> None:
        """Count as failed any cell that ran without error but whose rows are not all in results.jsonl."""
        lost = self._finished - load_done(self.out / RESULTS)
        if lost:
            self.log(f"warning: {len(lost)} cell(s) ran but their rows are incomplete in {self.out / RESULTS}; "
                     "they are counted as failed and run again next time")  # fmt: skip
            self.errors += len(lost)

    def _count_cells(self, tasks: dict[str, Any], model: str) -> int:
        grid = self.grid
        resized: list[CacheSpec] = []
        if grid.equal_bytes:
            from kvpolicy_lab.eval.equal_bytes import anchor_of, resizable

            anchor = anchor_of(grid.caches, None if grid.equal_bytes is True else str(grid.equal_bytes))
            resized = [s for s in grid.caches if resizable(s, anchor)]
        # the planner's own groups, with each quality context's caches followed by their unsized copies
        copies = [(s, False) for s in grid.caches] + [(s, True) for s in resized]
        return sum(len(g.cells) for g in plan_groups(grid, model, tasks, lambda context, steps: copies))

    def _planned_cells(self, tasks: dict[str, Any]) -> list[str]:
        """The ids of every model's cells but the ``--equal-bytes`` copies (sizing those needs the model)."""
        ids = []
        for model_name in self.grid.models:
            plain = [(s, False) for s in self.grid.caches]
            for group in plan_groups(self.grid, model_name, tasks, lambda context, steps, plain=plain: plain):
                ids += [cid for cid, _, _ in group.cells]
        return ids

    def _write_config(self, cells: list[str] | None = None, fresh: bool = False) -> None:
        """Write ``config.json``: the grid, and ``cells`` added to the cells already listed there (in
        place of them when ``fresh``)."""
        path = self.out / CONFIG
        old = read_config(self.out) if cells is not None and not fresh and path.is_file() else {}
        d = self.grid.to_dict()
        d["cells"] = sorted(set(old.get("cells", [])) | set(cells or []))
        d["sizings"] = self.sizings
        if self.shard is not None:
            d["shard"] = str(self.shard)
        d["torch"] = torch.__version__
        try:
            import transformers

            d["transformers"] = transformers.__version__
        except ImportError:  # pragma: no cover
            pass
        write_whole(path, json.dumps(d, indent=2, default=repr))

    def _specs_for(self, model: Any, context: int, steps: int) -> list[tuple[CacheSpec, bool]]:
        """The grid's caches, plus their equal-bytes copies at ``context``."""
        if not self.grid.equal_bytes:
            return [(s, False) for s in self.grid.caches]
        from kvpolicy_lab.eval.plan import anchor

        self.log(f"--equal-bytes: sizing every method to the bytes of {anchor(self.grid).label!r} at context "
                 f"{context} ...")  # fmt: skip
        memo_path = self.out / "sizing.json"
        memo = self.read_sizing_memo()
        specs, sizings = equal_specs(self.grid, model, context, steps, memo.setdefault(self._model_name, {}))
        write_whole(memo_path, json.dumps(memo, indent=1))
        self.sizings.extend({"model": self._model_name, **row} for row in sizings)
        return specs

    def run_model(self, model_name: str, tasks: dict[str, Any], done: set[str], bar: Any) -> None:
        """Load ``model_name`` here and run its pending cells, group by group."""
        grid = self.grid
        self.log(f"loading {model_name} ...")
        model, tok = open_model(model_name, grid.dtype, grid.device, grid.online)
        for group in self.plan(model_name, tasks, model):
            todo = self.take_pending(group, done, bar)
            self.write_cells()
            if todo:
                self._run_cells(model, tok, group, todo, bar)
        if self.runs_attention():
            self._attention(model, tok, model_name)

    def _attention(self, model: Any, tok: Any, model_name: str) -> None:
        from kvpolicy_lab.eval.attention_analysis import analyze_attention

        out = self.attention_dir(model_name)
        if (out / "attention_spikes.json").is_file():
            return
        self.log(f"attention analysis of {model_name} ...")
        analyze_attention(model, tok, seed=self.grid.seed, out=out, progress=self.progress, name=model_name,
                          **self.attention_params())  # fmt: skip

    def _run_cells(self, model: Any, tok: Any, group: Group, todo: list[tuple[str, CacheSpec, bool]],
                   bar: Any) -> None:  # fmt: skip
        cells = CellGroup(self.grid, model, tok, group.model, group.context, group.task_name, group.task,
                          progress=self.progress)  # fmt: skip
        for cid, spec, eq in todo:
            self.ran += 1
            bar.set_postfix_str(f"{spec.label} | {group.task_name} | ctx {group.context}")
            self.record(cells.run(cid, spec, eq), bar)

    def _append(self, name: str, rows: list[dict[str, Any]]) -> None:
        try:
            with (self.out / name).open("a", encoding="utf-8") as fh:
                fh.write("".join(json.dumps(r, default=repr) + "\n" for r in rows))
                fh.flush()
        except OSError as exc:
            raise ConfigError(f"{self.out / name} cannot be written ({exc.strerror}); free space or choose another "
                              "--out, then run again (finished cells are kept)") from None  # fmt: skip

    def read_sizing_memo(self) -> dict[str, Any]:
        """``OUT/sizing.json``: the ``--equal-bytes`` sizings of earlier runs (model -> key -> sizing)."""
        return self._read_sizing_memo(self.out / "sizing.json")

    def _read_sizing_memo(self, path: Path) -> dict[str, Any]:
        """The ``--equal-bytes`` sizing memo; an unreadable one is discarded (the sizings are recomputed)."""
        if not path.is_file():
            return {}
        try:
            memo = json.loads(_read_bytes(path).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            memo = None
        if not isinstance(memo, dict) or not all(isinstance(v, dict) for v in memo.values()):
            self.log(f"warning: {path} is not a sizing memo; ignored, the sizings are recomputed")
            return {}
        return memo


def _check_device(device: str) -> None:
    from kvpolicy_lab.devices import check_device

    try:
        check_device(device)
    except ConfigError as exc:
        raise ConfigError(f"device (--device): {exc}") from None


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)
