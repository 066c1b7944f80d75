"""The ablation runner: every cell of a :class:`~kvpolicy.eval.grid.Grid`, resumable, into one directory.

Output (evaluation.md §4)::

    OUT/config.json     the grid, the exact repr of every cache, --equal-bytes sizings
    OUT/results.jsonl   one row per cell × metric (written when the cell finishes)
    OUT/samples.jsonl   per-sample generations and scores of the generation tasks
    OUT/summary.md      tables (regenerated at the end of every run)
    OUT/*.png           quality vs bytes held; ms/token vs context

A cell is model × cache × context × task. Cells whose id (a hash of everything that determines the
result) already has its rows in ``results.jsonl`` are skipped, so an interrupted run resumes where
it stopped. A cell that raises is recorded as an error row and retried by the next run.

Damaged run directories: a last line of ``results.jsonl`` (or ``samples.jsonl``) cut by an
interruption is dropped before the run appends (its cell runs again); other lines that are not
result rows are skipped with a one-line warning (the cells they belonged to run again).
``config.json`` is rewritten by every run; only ``--report-only`` needs it, and an unreadable one
is then a :class:`~kvpolicy.errors.ConfigError` that says how to recover. The ``sizing.json`` memo
of ``--equal-bytes`` is recomputed when unreadable.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from kvpolicy.errors import ConfigError
from kvpolicy.eval import measure
from kvpolicy.eval.caches import CacheSpec
from kvpolicy.eval.grid import SPEED, Grid, cell_id, check_model_available
from kvpolicy.eval.tasks import LanguageModeling, Task

RESULTS = "results.jsonl"
SAMPLES = "samples.jsonl"
CONFIG = "config.json"


def open_model(name: str, dtype: str = "float32", device: str = "cpu", online: bool = False) -> tuple[Any, Any]:
    """Load a model by name (``smollm2``, ``tiny-<family>[-layers]``, a local path or a hub id).

    Raises :class:`~kvpolicy.errors.ConfigError` with a one-line reason when it cannot be loaded.
    """
    from kvpolicy.eval.tiny import parse_tiny, tiny_model

    check_model_available(name, online)
    tiny = parse_tiny(name)
    if tiny is not None:
        model, tok = tiny_model(tiny)
        return model.to(device=device, dtype=getattr(torch, dtype)), tok
    from kvpolicy.eval.models import load_model

    try:
        return load_model(name, dtype=getattr(torch, dtype), device=device)
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


def read_rows(out: Path) -> list[dict[str, Any]]:
    """Every result row of ``out/results.jsonl`` (lines that are not rows are left out)."""
    return scan_rows(out / RESULTS)[0]


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


def _spec_fields(spec: CacheSpec) -> dict[str, Any]:
    a = spec.args
    part = lambda x: x if isinstance(x, str) or x is None else getattr(x, "name", repr(x))  # noqa: E731
    if spec.kind == "compressed":
        return {"policy": part(a.get("policy", "log")), "action": part(a.get("action", "quantize")),
                "bits": a.get("bits"), "backend": part(a.get("backend", "torch"))}  # fmt: skip
    if spec.kind == "hf-quantized":
        return {"policy": "recent:flush(hf)", "action": "quantize", "bits": a.get("nbits", 4),
                "backend": a.get("backend")}  # fmt: skip
    if spec.kind == "preset":
        return {"policy": f"preset:{a.get('name')}", "action": None, "bits": a.get("bits"), "backend": None}
    return {"policy": None, "action": "none", "bits": None, "backend": None}


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
    """

    def __init__(self, grid: Grid, out: str | Path, progress: bool = True, log: Callable[[str], None] = print):
        self.grid = grid
        self.out = Path(out)
        self.progress = progress
        self.log = log
        self.sizings: list[dict[str, Any]] = []
        self.errors = 0
        self.ran = 0
        self.skipped = 0
        self._finished: set[str] = set()
        self._warned = False
        self._model_name = ""

    # ------------------------------------------------------------------ entry
    def run(self) -> int:
        """Run every pending cell; returns the number of cells that raised."""
        grid = self.grid
        for name in grid.models:  # fail fast on names before any work
            check_model_available(name, grid.online)
        _check_device(grid.device)
        tasks = grid.task_objects()
        total = len(grid.models) * self._count_cells(tasks)
        self._make_out()
        self._write_config()
        done = self._load_results()
        bar = tqdm(total=total, desc="cells", disable=not self.progress, dynamic_ncols=True)
        t0 = time.perf_counter()
        for model_name in grid.models:
            self._run_model(model_name, tasks, done, bar)
        bar.close()
        self._verify_rows()
        self.log(f"ablation: {total} cells ({self.ran} run, {self.skipped} already done), {self.errors} failed, "
                 f"{time.perf_counter() - t0:.0f} s -> {self.out}")  # fmt: skip
        self.report()
        return self.errors

    def report(self) -> None:
        """Write summary.md and the plots from the rows of the current grid."""
        from kvpolicy.eval.plots import write_plots
        from kvpolicy.eval.summary import write_summary

        rows = self.current_rows()
        write_summary(self.out, rows, self.grid, self.sizings)
        write_plots(self.out, rows)

    def current_rows(self) -> list[dict[str, Any]]:
        """Rows of ``results.jsonl`` that belong to the cells of this grid (latest per cell and metric)."""
        ids = set(read_config(self.out).get("cells", []))
        rows, bad = scan_rows(self.out / RESULTS)
        self._warn_bad_lines(bad, "the report leaves them out")
        latest: dict[tuple[str, str], dict[str, Any]] = {}
        for row in rows:
            if row.get("cell") in ids:
                latest[(row["cell"], row["metric"])] = row
        ok = {cell for cell, metric in latest if metric != "error"}
        return [r for (cell, metric), r in latest.items() if metric != "error" or cell not in ok]

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
        rows, bad = scan_rows(self.out / RESULTS)
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

    def _count_cells(self, tasks: dict[str, Any]) -> int:
        grid = self.grid
        resized: list[CacheSpec] = []
        if grid.equal_bytes:
            from kvpolicy.eval.equal_bytes import anchor_of, resizable

            anchor = anchor_of(grid.caches, None if grid.equal_bytes is True else str(grid.equal_bytes))
            resized = [s for s in grid.caches if resizable(s, anchor)]
        n = 0
        for name, task in tasks.items():
            contexts = task["contexts"] if isinstance(task, dict) else grid.contexts if _uses_context(task) else [0]
            for context in contexts:
                quality = name != SPEED and (context in grid.contexts or not _uses_context(task))
                extra = resized if quality else []
                n += sum(grid.runs(name, s.label) for s in [*grid.caches, *extra])
        return n

    def _write_config(self, cells: list[str] | None = None) -> None:
        path = self.out / CONFIG
        old = read_config(self.out) if cells is not None and path.is_file() else {}
        d = self.grid.to_dict()
        d["cells"] = sorted(set(old.get("cells", [])) | set(cells or [])) if cells is not None else []
        d["sizings"] = self.sizings
        d["torch"] = torch.__version__
        try:
            import transformers

            d["transformers"] = transformers.__version__
        except ImportError:  # pragma: no cover
            pass
        try:
            path.write_text(json.dumps(d, indent=2, default=repr))
        except OSError as exc:
            raise ConfigError(f"{path} cannot be written ({exc.strerror}); choose another --out") from None

    def _specs_for(self, model: Any, context: int, steps: int) -> list[tuple[CacheSpec, bool]]:
        """The grid's caches, plus their equal-bytes copies at ``context``."""
        specs = [(s, False) for s in self.grid.caches]
        if not self.grid.equal_bytes:
            return specs
        from kvpolicy.eval.equal_bytes import anchor_of, equalize, resizable

        eb = self.grid.equal_bytes
        anchor = anchor_of(self.grid.caches, None if eb is True else str(eb))
        self.log(f"--equal-bytes: sizing every method to the bytes of {anchor.label!r} at context {context} ...")
        memo_path = self.out / "sizing.json"
        memo = self._read_sizing_memo(memo_path)
        mine = memo.setdefault(self._model_name, {})
        sized, report = equalize(model, anchor, self.grid.caches, context, steps, memo=mine)
        memo_path.write_text(json.dumps(memo, indent=1))
        for s in report:
            self.sizings.append({"context": context, "anchor": anchor.label, **asdict(s)})
        return specs + [(s, True) for s, orig in zip(sized, self.grid.caches, strict=True)
                        if resizable(orig, anchor)]  # fmt: skip

    def _run_model(self, model_name: str, tasks: dict[str, Any], done: set[str], bar: Any) -> None:
        grid = self.grid
        self._model_name = model_name
        self.log(f"loading {model_name} ...")
        model, tok = open_model(model_name, grid.dtype, grid.device, grid.online)
        lm_tokens = tasks["lm"].tokens if isinstance(tasks.get("lm"), LanguageModeling) else 64
        all_cells: list[str] = []
        contexts = sorted({*grid.contexts, *(c for t in tasks.values() if isinstance(t, dict) for c in t["contexts"])})
        first = True
        for context in contexts:
            quality = [n for n, t in tasks.items() if n != SPEED and context in grid.contexts]
            needs_sizing = bool(quality)
            specs = self._specs_for(model, context, lm_tokens) if needs_sizing else [(s, False) for s in grid.caches]
            for task_name, task in tasks.items():
                if task_name == SPEED:
                    if context not in task["contexts"]:
                        continue
                    ctx: int | None = context
                    run_specs = [(s, False) for s in grid.caches]
                else:
                    if context not in grid.contexts or (not _uses_context(task) and not first):
                        continue
                    ctx = context if _uses_context(task) else None
                    run_specs = specs
                params = task if isinstance(task, dict) else asdict(task)
                todo = []
                for spec, eq in run_specs:
                    if not grid.runs(task_name, spec.label):
                        continue
                    cid = cell_id(model_name, spec, ctx, task_name, params, grid)
                    all_cells.append(cid)
                    if cid in done:
                        self.skipped += 1
                        bar.update(1)
                    else:
                        todo.append((cid, spec, eq))
                self._write_config(all_cells)
                if todo:
                    self._run_cells(model, tok, model_name, ctx, task_name, task, todo, bar)
            if context in grid.contexts:
                first = False
        if grid.attention:
            self._attention(model, tok, model_name)

    def _attention(self, model: Any, tok: Any, model_name: str) -> None:
        from kvpolicy.eval.attention_analysis import analyze_attention

        out = self.out / "attention" / _slug(model_name)
        if (out / "attention_spikes.json").is_file():
            return
        self.log(f"attention analysis of {model_name} ...")
        params = {k: v for k, v in self.grid.attention.items() if k in ("context", "queries", "top_k", "window")}
        analyze_attention(model, tok, seed=self.grid.seed, out=out, progress=self.progress, name=model_name, **params)

    def _run_cells(self, model: Any, tok: Any, model_name: str, context: int | None, task_name: str, task: Any,
                   todo: list[tuple[str, CacheSpec, bool]], bar: Any) -> None:  # fmt: skip
        grid = self.grid
        if task_name == SPEED:
            samples = LanguageModeling(samples_per_context=1, tokens=1).samples(tok, context, grid.seed)
            ids = samples[0].ids[:context]
        else:
            samples = task.samples(tok, context or 0, grid.seed)
        refs: list[measure.Reference | None] | None = None
        for cid, spec, eq in todo:
            self.ran += 1
            bar.set_postfix_str(f"{spec.label} | {task_name} | ctx {context}")
            t0 = time.perf_counter()
            scores = spec.needs_scores()
            if scores or model.config._attn_implementation in ("sdpa", "eager"):
                # outputs unchanged; reports scores where a policy needs them and checks the mask, so
                # layout="agnostic" can be used (kvpolicy.handoff)
                from kvpolicy.attention import enable_scores

                enable_scores(model)
            records: list[dict[str, Any]] = []
            try:
                make = lambda spec=spec: spec.build(model)  # noqa: E731
                if task_name == SPEED:
                    metrics = measure.speed(model, ids, make, task["steps"], task["repeats"])
                else:
                    against = samples[0].against_reference
                    needs_ref = grid.replay or samples[0].kind == "teacher_forced" or against
                    if refs is None and needs_ref:
                        refs = [measure.reference(model, s) for s in samples]
                    use = refs if (grid.replay and not scores) else None
                    if samples[0].kind == "teacher_forced":
                        metrics = measure.teacher_forced(model, samples, refs, make, replay=use is not None,
                                                         progress=self.progress)  # fmt: skip
                    else:
                        given = refs if against else (use or [None] * len(samples))
                        metrics, records = measure.task_scores(
                            model, tok, task, samples, given, make, progress=self.progress, replay=use is not None
                        )
            except Exception as exc:  # recorded, retried by the next run
                self.errors += 1
                msg = f"{type(exc).__name__}: {exc}"
                self.log(f"cell {spec.label} | {task_name} | ctx {context} FAILED: {msg}")
                self._append(RESULTS, [self._row(cid, model_name, spec, eq, context, task_name, "error", 1,
                                                 value=float("nan"), extra={"error": msg,
                                                 "traceback": traceback.format_exc(limit=6)})])  # fmt: skip
                bar.update(1)
                continue
            finally:
                if scores:
                    from kvpolicy.attention import disable_scores

                    disable_scores(model)
            seconds = time.perf_counter() - t0
            rows = [self._row(cid, model_name, spec, eq, context, task_name, m.name, len(metrics), value=m.value,
                              se=m.se, n=m.n, extra={**m.extra, "seconds": round(seconds, 2)})
                    for m in metrics]  # fmt: skip
            if records:
                self._append(SAMPLES, [{"cell": cid, "cache": spec.label, "task": task_name, "context": context, **r}
                                       for r in records])  # fmt: skip
            self._append(RESULTS, rows)
            self._finished.add(cid)
            bar.update(1)

    def _row(self, cid: str, model: str, spec: CacheSpec, eq: bool, context: int | None, task: str, metric: str,
             rows_in_cell: int, value: float, se: float | None = None, n: int = 1,
             extra: dict | None = None) -> dict[str, Any]:  # fmt: skip
        return {
            "cell": cid, "model": model, "cache": spec.label, "kind": spec.kind, "repr": spec.describe(),
            **_spec_fields(spec), "equal_bytes": eq, "context": context, "task": task, "metric": metric,
            "value": value, "se": se, "n": n, "rows_in_cell": rows_in_cell, "extra": extra or {},
        }  # fmt: skip

    def _append(self, name: str, rows: list[dict[str, Any]]) -> None:
        try:
            with (self.out / name).open("a", encoding="utf-8") as fh:
                fh.write("".join(json.dumps(r, default=repr) + "\n" for r in rows))
                fh.flush()
        except OSError as exc:
            raise ConfigError(f"{self.out / name} cannot be written ({exc.strerror}); free space or choose another "
                              "--out, then run again (finished cells are kept)") from None  # fmt: skip

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
    from kvpolicy.devices import check_device

    try:
        check_device(device)
    except ConfigError as exc:
        raise ConfigError(f"device (--device): {exc}") from None


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)


def _uses_context(task: Task | dict) -> bool:
    return True if isinstance(task, dict) else type(task).uses_context
