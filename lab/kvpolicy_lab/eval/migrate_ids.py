"""Move a run directory from cell ids of scheme 1 (a hash of each cache's ``repr``) to scheme 2 (a hash
of its canonical dict, :data:`~kvpolicy_lab.eval.grid.CELL_IDS`), checking every cell against the grid.

Run it once per directory written before scheme 2::

    python -m kvpolicy_lab.eval.migrate_ids runs/results [--dry-run]

The grid is rebuilt from the directory's ``config.json``, and every cell it plans (the ``--equal-bytes``
copies from the recorded sizings included) gets its old id and its new one. Before anything is written:

- every result row and every sample must belong to a planned cell by its old id, and the row must say
  what that cell is (model, cache label, context, task, and the ``repr`` the old id hashed);
- no old id may stand for two cells.

A directory that fails a check is left as it was, and the error lists the rows that do not fit (rows
of caches whose ``repr`` has changed since they were written show both forms). ``results.jsonl``,
``samples.jsonl`` and then ``config.json`` are each replaced whole, so a migration cut short leaves
rows already renamed, which a second run recognises by their new ids. ``sizing.json`` is left alone:
its memo keys changed too, and the next ``--equal-bytes`` run recomputes what it misses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpolicy.errors import ConfigError
from kvpolicy_lab.eval.caches import CacheSpec
from kvpolicy_lab.eval.equal_bytes import with_size
from kvpolicy_lab.eval.grid import CELL_IDS, Grid, cell_key, digest, grid_from_dict
from kvpolicy_lab.eval.lock import hold_run_dir
from kvpolicy_lab.eval.plan import plan_groups
from kvpolicy_lab.eval.runner import CONFIG, RESULTS, RUN_KEYS, SAMPLES, scan_rows, write_whole

#: what Grid.to_dict adds to each cache entry beyond what a grid file gives
_DESCRIPTIVE = ("repr", "canonical")
#: the min-max fits a ``Quantize`` repr now names where the default fit is another (scheme-1 reprs never
#: named a min-max fit)
_NAMED_MINMAX_FIT = re.compile(r", (?:key|value)_fit='minmax'")


def scheme1_description(described: str) -> str:
    """The ``repr`` a cache had when scheme-1 ids were hashed: today's, less the min-max fits it names."""
    return _NAMED_MINMAX_FIT.sub("", described)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One planned cell: what its rows must say, and its two ids."""

    model: str
    label: str
    context: int | None
    task: str
    described: str
    old: str
    new: str


def grid_of(config: dict[str, Any]) -> Grid:
    """The grid a run directory's ``config.json`` records."""
    d = {k: v for k, v in config.items() if k not in RUN_KEYS}
    caches = d.get("caches", [])
    if not isinstance(caches, list) or not all(isinstance(c, dict) for c in caches):
        raise ConfigError(f"config.json: caches must be a list of objects; got {caches!r:.120}")
    d["caches"] = [{**{k: v for k, v in c.items() if k not in (*_DESCRIPTIVE, "args")}, **c.get("args", {})}
                   for c in caches]  # fmt: skip
    return grid_from_dict(d)


def planned_cells(grid: Grid, sizings: list[dict[str, Any]]) -> list[Cell]:
    """Every cell ``grid`` plans, the ``--equal-bytes`` copies rebuilt from ``sizings`` (rows of
    ``config.json``'s ``sizings``: context, label ``"<base>@<value>"`` and value)."""
    by_label = {c.label: c for c in grid.caches}
    tasks = grid.task_objects()
    out: list[Cell] = []
    for model in grid.models:

        def sized(context: int, steps: int) -> list[tuple[CacheSpec, bool]]:
            copies = [(with_size(by_label[s["label"].split("@")[0]], s["value"]), True)
                      for s in sizings if s.get("context") == context]  # fmt: skip
            return [(c, False) for c in grid.caches] + copies

        for group in plan_groups(grid, model, tasks, sized):
            params = group.task if isinstance(group.task, dict) else dataclasses.asdict(group.task)
            for new, spec, _ in group.cells:
                described = scheme1_description(spec.describe())
                old = digest(cell_key(model, described, group.context, group.task_name, params, grid))
                out.append(Cell(model, spec.label, group.context, group.task_name, described, old, new))
    return out


def _mismatch(row: dict[str, Any], cell: Cell | None, new_ids: set[str]) -> str | None:
    """Why ``row`` cannot be renamed to ``cell`` (``None``: it can, or it carries a new id already)."""
    if row.get("cell") in new_ids and row.get("cell_ids", CELL_IDS) == CELL_IDS:
        return None
    if cell is None:
        return f"cell {row.get('cell')!r} ({row.get('cache')!r}, {row.get('task')!r}) is not a cell of the grid"
    planned = {"model": cell.model, "cache": cell.label, "context": cell.context, "task": cell.task}
    said = {k: row[k] for k in planned if k in row}  # samples carry no model
    if said != {k: planned[k] for k in said}:
        return f"cell {cell.old!r}: the row says {said}, the grid plans {planned}"
    if "repr" in row and row["repr"] != cell.described:
        return f"cell {cell.old!r}: the row measured {row['repr']!r}, the grid builds {cell.described!r}"
    return None


def _renamed(record: dict[str, Any], cell: str, row: bool) -> dict[str, Any]:
    """``record`` under id ``cell``; a result row also records the scheme, right after its id."""
    rest = {k: v for k, v in record.items() if k not in ("cell", "cell_ids")}
    return {"cell": cell, **({"cell_ids": CELL_IDS} if row else {}), **rest}


def _lines(path: Path, rows: bool) -> list[dict[str, Any]]:
    """The records of a ``results.jsonl`` (``rows``) or ``samples.jsonl``; a line that is not one refuses."""
    if rows:
        found, bad = scan_rows(path)
    else:
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
        found, bad = [], []
        for n, line in enumerate(text.splitlines(), 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            found.append(record) if isinstance(record, dict) and isinstance(record.get("cell"), str) else bad.append(n)
    if bad:
        raise ConfigError(f"{path}: line(s) {bad[:5]} are not {'rows' if rows else 'samples'}; repair or delete them, "
                          "then migrate")  # fmt: skip
    return found


def migrate(out: Path, dry_run: bool = False, log: Callable[[str], None] = print) -> dict[str, str]:
    """Rename the cells of run directory ``out`` from scheme 1 to scheme 2; returns ``{old id: new id}``.

    Raises
    ------
    ConfigError
        ``out`` holds no run, its scheme is neither 1 nor 2, or a row or sample does not fit the grid
        (nothing is then written).
    """
    path = out / CONFIG
    if not path.is_file():
        raise ConfigError(f"{out} holds no ablation run (no {CONFIG})")
    with hold_run_dir(out):
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path} cannot be read as JSON ({exc})") from None
        if not isinstance(config, dict):
            raise ConfigError(f"{path} is not an ablation run's config")
        rows, samples = _lines(out / RESULTS, rows=True), _lines(out / SAMPLES, rows=False)
        schemes = {r.get("cell_ids", 1) for r in rows}
        if schemes <= {CELL_IDS}:
            log(f"{out}: its rows name their cells by scheme {CELL_IDS} already; nothing to do")
            return {}
        if not schemes <= {1, CELL_IDS}:
            raise ConfigError(
                f"{out / RESULTS}: cell_ids must be absent (scheme 1) or {CELL_IDS}; got {sorted(map(str, schemes))}"
            )
        grid = grid_of(config)
        cells = planned_cells(grid, config.get("sizings") or [])
        by_old: dict[str, Cell] = {}
        for cell in cells:
            if by_old.setdefault(cell.old, cell) != cell:
                raise ConfigError(f"{out}: old id {cell.old} stands for two cells ({by_old[cell.old].label!r} and "
                                  f"{cell.label!r}); the directory cannot be migrated without guessing")  # fmt: skip
        new_ids = {c.new for c in cells}
        wrong = [why for r in rows + samples if (why := _mismatch(r, by_old.get(r.get("cell")), new_ids))]
        if wrong:
            shown = "\n  ".join(dict.fromkeys(wrong))
            raise ConfigError(
                f"{out}: {len(wrong)} row(s) do not fit the grid in {CONFIG}; nothing was written:\n  {shown}"
            )
        mapping = {c.old: c.new for c in cells}
        listed = config.get("cells", [])
        unknown = [c for c in listed if c not in mapping and c not in new_ids]
        if unknown:
            raise ConfigError(
                f"{path}: cells {unknown[:5]} are listed but not planned by its grid; nothing was written"
            )
        moved = len({r["cell"] for r in rows if r["cell"] in mapping})
        log(f"{out}: {moved} cell(s) with rows, {len(listed)} listed, renamed to scheme {CELL_IDS}"
            + (" (dry run: nothing written)" if dry_run else ""))  # fmt: skip
        if dry_run:
            return mapping
        for name, lines, row in ((RESULTS, rows, True), (SAMPLES, samples, False)):
            if (out / name).exists():
                renamed = (_renamed(r, mapping.get(r["cell"], r["cell"]), row) for r in lines)
                write_whole(out / name, "".join(json.dumps(r, default=repr) + "\n" for r in renamed))
        config["cells"] = sorted(mapping.get(c, c) for c in listed)
        config["caches"] = grid.to_dict()["caches"]
        write_whole(path, json.dumps(config, indent=2, default=repr))
        return mapping


def main(argv: list[str] | None = None) -> int:
    """``python -m kvpolicy_lab.eval.migrate_ids DIR [DIR ...] [--dry-run]``."""
    parser = argparse.ArgumentParser(
        prog="python -m kvpolicy_lab.eval.migrate_ids", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="run directories (--out of kvpolicy ablate)")
    parser.add_argument("--dry-run", action="store_true", help="check and report; write nothing")
    args = parser.parse_args(argv)
    try:
        for out in args.dirs:
            migrate(out, dry_run=args.dry_run)
    except ConfigError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
