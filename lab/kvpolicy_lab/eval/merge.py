"""``kvpolicy ablate --merge``: combine the run directories of shards (``--shard i/n``) into one.

Every source must be a run of the same grid (``config.json`` equal but for the cells, the sizings, the
shard, ``online`` and the library versions). For each cell the rows of the first source in which it is
finished (every row, no error) are kept, the latest row of each metric; a cell finished nowhere keeps
the rows of the first source that has any (its error row, say), and a later ``kvpolicy ablate`` into
the merged directory runs it again. The merged directory gets ``results.jsonl``, ``samples.jsonl``
(the kept cells' lines), ``config.json`` (every source's cells), ``sizing.json`` and the attention
analyses (:func:`merge_runs`), then its report (:func:`write_report`: ``summary.md``, plots). An
existing run in the output directory is one more source, so merging again is harmless.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpolicy.errors import ConfigError
from kvpolicy_lab.eval.lock import hold_run_dir
from kvpolicy_lab.eval.runner import (
    CONFIG,
    RESULTS,
    RUN_KEYS,
    SAMPLES,
    done_cells,
    read_config,
    report_rows,
    run_rows,
    write_whole,
)

#: config keys that may differ between the shards of one grid (``batch`` changes float rounding only)
_PER_SHARD = (*RUN_KEYS, "online", "batch")


@dataclass
class _Source:
    """One run directory to merge: its config and the rows of its cells, by cell."""

    path: Path
    config: dict[str, Any]
    rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)


def _load(path: Path) -> _Source:
    if not (path / CONFIG).is_file():
        raise ConfigError(f"--merge: {str(path)!r} holds no ablation run (no {CONFIG}); give the --out directories "
                          "of the shards")  # fmt: skip
    source = _Source(path, read_config(path))
    rows, _ = run_rows(path)
    source.done = done_cells(rows)
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        latest[(row["cell"], row["metric"])] = row
    for (cell, _), row in latest.items():
        source.rows.setdefault(cell, []).append(row)
    return source


def _grid_part(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in _PER_SHARD}


def _check_same_grid(sources: list[_Source]) -> None:
    first = sources[0]
    want = _grid_part(first.config)
    for other in sources[1:]:
        got = _grid_part(other.config)
        if got != want:
            key = sorted(k for k in {*want, *got} if want.get(k) != got.get(k))[0]
            raise ConfigError(
                f"--merge: {str(other.path)!r} is a run of another grid than {str(first.path)!r} (config.json key "
                f"{key!r}: {_short(got.get(key))} vs {_short(want.get(key))}); merge only the shards of one grid"
            )


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _pick(sources: list[_Source]) -> dict[str, _Source]:
    """Cell -> the source whose rows are kept: the first where it is finished, else the first that has rows."""
    chosen: dict[str, _Source] = {}
    for source in sources:
        for cell in source.rows:
            if cell in source.done and (cell not in chosen or cell not in chosen[cell].done):
                chosen[cell] = source
            chosen.setdefault(cell, source)
    return chosen


def _write_lines(path: Path, lines: list[dict[str, Any]]) -> None:
    """Write ``path`` whole, through a temporary file (a source may be the output itself)."""
    tmp = path.with_name(path.name + ".merging")
    try:
        tmp.write_text("".join(json.dumps(r, default=repr) + "\n" for r in lines), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        raise ConfigError(f"{path} cannot be written ({exc.strerror}); choose another --out") from None


def _samples(source: _Source, cells: set[str]) -> dict[str, list[dict[str, Any]]]:
    """The ``samples.jsonl`` lines of ``source`` that belong to ``cells``, by cell."""
    path = source.path / SAMPLES
    out: dict[str, list[dict[str, Any]]] = {}
    if not path.is_file() or not cells:
        return out
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("cell") in cells:
            out.setdefault(record["cell"], []).append(record)
    return out


def _shard_index(source: _Source) -> float:
    shard = source.config.get("shard")
    try:
        return int(str(shard).split("/")[0])
    except ValueError:
        return float("inf")


def _cell_order(sources: list[_Source], chosen: dict[str, _Source]) -> list[tuple[str, _Source]]:
    """``(cell, source)`` of every kept cell, the sources' cells taken in turn by shard index (shard 0's
    first, shard 1's first, ..., shard 0's second, ...): the grid's order when each shard ran its cells
    in one go, so the merged report lists them as an unsharded run would."""
    ranked = sorted(sources, key=_shard_index)
    lists = [[c for c in s.rows if chosen[c] is s] for s in ranked]
    order = []
    for k in range(max((len(x) for x in lists), default=0)):
        order += [(cells[k], s) for s, cells in zip(ranked, lists, strict=True) if k < len(cells)]
    return order


def _merged_config(sources: list[_Source]) -> dict[str, Any]:
    config = {k: v for k, v in sources[0].config.items() if k != "shard"}
    config["cells"] = sorted({c for s in sources for c in s.config.get("cells", [])})
    seen, sizings = set(), []
    for s in sources:
        for row in s.config.get("sizings") or []:
            key = json.dumps(row, sort_keys=True)
            if key not in seen:
                seen.add(key)
                sizings.append(row)
    config["sizings"] = sizings
    return config


def _missing_shards(sources: list[_Source]) -> str | None:
    """Which shards of an ``n``-way split are not among the sources (``None``: none missing or unsharded)."""
    shards = [s.config.get("shard") for s in sources]
    counts = {int(x.split("/")[1]) for x in shards if isinstance(x, str) and "/" in x}
    if len(counts) != 1:
        return None
    (n,) = counts
    have = {int(x.split("/")[0]) for x in shards if isinstance(x, str) and x.endswith(f"/{n}")}
    missing = sorted(set(range(n)) - have)
    return ", ".join(f"{i}/{n}" for i in missing) if missing else None


def merge_runs(out: Path, shards: list[Path], log: Callable[[str], None] = print) -> dict[str, Any]:
    """Merge the run directories ``shards`` into ``out`` (see the module docstring); returns its config.

    Parameters
    ----------
    out : Path
        The merged run directory (created; an existing run there is merged too).
    shards : list of Path
        The shards' run directories (``--out`` of each ``kvpolicy ablate --shard i/n``).
    log : callable
        Where messages go.

    Raises
    ------
    ConfigError
        A source holds no run, the sources are runs of different grids, or another process holds
        ``out`` (:mod:`kvpolicy_lab.eval.lock`).
    """
    with ExitStack() as held:
        # a run already in out is one of the sources: out is held from before it is read; a new out
        # is held from when it is created, once the sources have been checked
        later = None if out.is_dir() else held
        if later is None:
            held.enter_context(hold_run_dir(out))
        return _merge_into(out, shards, log, later)


def _merge_into(out: Path, shards: list[Path], log: Callable[[str], None], hold: ExitStack | None) -> dict[str, Any]:
    """:func:`merge_runs` with ``out`` held already, or held through ``hold`` once it is created."""
    paths = list(dict.fromkeys(p.resolve() for p in shards))
    if (out / CONFIG).is_file() and out.resolve() not in paths:
        paths.append(out.resolve())
    sources = [_load(p) for p in paths]
    _check_same_grid(sources)
    missing = _missing_shards(sources)
    if missing:
        log(f"warning: --merge: shard(s) {missing} not given; their cells are missing from {out}")
    config = _merged_config(sources)
    cells = set(config["cells"])
    chosen = {c: s for c, s in _pick(sources).items() if c in cells}  # rows of cells of no shard's grid: left out
    records = {id(s): _samples(s, {c for c, k in chosen.items() if k is s and c in s.done}) for s in sources}
    rows, samples = [], []
    for cell, source in _cell_order(sources, chosen):
        rows += [r for r in source.rows[cell] if r["metric"] != "error" or cell not in source.done]
        samples += records[id(source)].get(cell, [])
    memo: dict[str, Any] = {}
    for source in sources:
        _merge_memo(memo, source.path / "sizing.json")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"run directory {str(out)!r} cannot be created ({exc.strerror}); choose another "
                          "--out") from None  # fmt: skip
    if hold is not None:
        hold.enter_context(hold_run_dir(out))
    _write_lines(out / RESULTS, rows)
    _write_lines(out / SAMPLES, samples)
    write_whole(out / CONFIG, json.dumps(config, indent=2, default=repr))
    if memo:
        write_whole(out / "sizing.json", json.dumps(memo, indent=1))
    for source in sources:
        _copy_attention(source.path, out)
    done = sum(c in s.done for c, s in chosen.items())
    unrun = f", {len(cells) - len(chosen)} never run" if len(cells) > len(chosen) else ""
    log(f"merged {len(sources)} run(s) into {out}: {len(cells)} cells, {done} finished, {len(chosen) - done} "
        f"failed{unrun}")  # fmt: skip
    return config


def _merge_memo(memo: dict[str, Any], path: Path) -> None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return
    if isinstance(data, dict):
        for model, entries in data.items():
            if isinstance(entries, dict):
                memo.setdefault(model, {}).update(entries)


def _copy_attention(source: Path, out: Path) -> None:
    """Copy ``source``'s attention analyses that ``out`` lacks."""
    if source == out.resolve() or not (source / "attention").is_dir():
        return
    for model_dir in (source / "attention").iterdir():
        target = out / "attention" / model_dir.name
        if model_dir.is_dir() and not (target / "attention_spikes.json").is_file():
            shutil.copytree(model_dir, target, dirs_exist_ok=True)


@dataclass
class _CacheLabel:
    label: str


@dataclass
class ConfigGrid:
    """The fields of a grid that a report shows, read back from a run's ``config.json``."""

    models: list[str]
    dtype: str
    device: str
    seed: int
    replay: bool
    caches: list[_CacheLabel]
    decode: str = "fused"

    @classmethod
    def of(cls, config: dict[str, Any]) -> ConfigGrid:
        """The grid of ``config`` (as :meth:`kvpolicy_lab.eval.grid.Grid.to_dict` wrote it)."""
        return cls(config.get("models", []), config.get("dtype", ""), config.get("device", ""),
                   config.get("seed", 0), config.get("replay", True),
                   [_CacheLabel(c["label"]) for c in config.get("caches", []) if isinstance(c, dict)],
                   config.get("decode", "materialized"))  # fmt: skip


def write_report(out: Path) -> None:
    """Write ``summary.md`` and the plots of the run directory ``out`` from its files alone."""
    from kvpolicy_lab.eval.plots import write_plots
    from kvpolicy_lab.eval.summary import write_summary

    config = read_config(out)
    rows = report_rows(run_rows(out)[0], set(config.get("cells", [])))
    write_summary(out, rows, ConfigGrid.of(config), config.get("sizings") or [])
    write_plots(out, rows)
