"""The cells of an ablation grid, in a fixed order, grouped by model × context × task; and shards of them.

:func:`plan_groups` lists the cells of one model in the order the runner runs them (contexts ascending,
then the grid's tasks, then its caches and their ``--equal-bytes`` copies). Numbering the cells of
every model in that order gives each cell of a grid a stable index; ``--shard i/n`` runs the cells
whose index modulo ``n`` is ``i`` (:class:`Shard`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from kvpolicy.errors import ConfigError
from kvpolicy_lab.eval.caches import CacheSpec
from kvpolicy_lab.eval.grid import SPEED, Grid, cell_id
from kvpolicy_lab.eval.tasks import LanguageModeling, Task

#: ``(context, lm tokens) -> [(cache, is an --equal-bytes copy), ...]``: the caches a quality task runs at a context
Sizer = Callable[[int, int], list[tuple[CacheSpec, bool]]]


@dataclass
class Group:
    """The cells of one model × context × task (they share samples and references).

    Attributes
    ----------
    model : str
        The model's name in the grid.
    context : int or None
        The context length (``None`` for a task that does not use one).
    task_name : str
        The task's name in the grid.
    task : Task or dict
        The task object (``speed``: its parameters).
    cells : list of (str, CacheSpec, bool)
        ``(cell id, cache, is an --equal-bytes copy)`` of every cell, finished or not, in grid order.
    """

    model: str
    context: int | None
    task_name: str
    task: Task | dict[str, Any]
    cells: list[tuple[str, CacheSpec, bool]]


@dataclass(frozen=True)
class Shard:
    """Part ``index`` of ``count`` of a grid's cells: those whose index modulo ``count`` is ``index``."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not (isinstance(self.count, int) and self.count >= 1 and isinstance(self.index, int)
                and 0 <= self.index < self.count):  # fmt: skip
            raise ConfigError(f"shard must be I/N with integers N >= 1 and 0 <= I < N; got {self.index}/{self.count}")

    def owns(self, index: int) -> bool:
        """Whether the cell numbered ``index`` belongs to this shard."""
        return index % self.count == self.index

    def size(self, total: int) -> int:
        """How many of ``total`` cells belong to this shard."""
        return len(range(self.index, total, self.count))

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str) -> Shard:
    """``"1/4"`` -> ``Shard(1, 4)``.

    Raises
    ------
    ConfigError
        ``text`` is not ``I/N`` with integers ``N >= 1`` and ``0 <= I < N``; the message names the value.
    """
    allowed = "I/N with integers N >= 1 and 0 <= I < N (e.g. 0/4 for the first of four shards)"
    index, sep, count = text.partition("/")
    try:
        return Shard(int(index), int(count))
    except (ValueError, ConfigError):
        reason = "" if sep else " (no '/')"
        raise ConfigError(f"must be {allowed}; got {text!r}{reason}") from None


def uses_context(task: Task | dict[str, Any]) -> bool:
    """Whether ``task`` runs once per context length (``speed``'s parameters: yes)."""
    return True if isinstance(task, dict) else type(task).uses_context


def plan_groups(grid: Grid, model_name: str, tasks: dict[str, Any], sized: Sizer) -> Iterator[Group]:
    """The groups of cells of ``model_name``, in the order the runner runs them.

    Parameters
    ----------
    grid : Grid
    model_name : str
        One of ``grid.models``.
    tasks : dict
        ``grid.task_objects()``.
    sized : callable
        ``(context, steps) -> [(cache, eq), ...]``: the caches of the quality tasks at ``context``, the
        grid's own followed by their ``--equal-bytes`` copies (see :func:`equal_specs`). Called once per
        context that has a quality task, before that context's groups are yielded.

    Yields
    ------
    Group
        One per (context, task) that runs at that context, possibly with no cells (``only``).
    """
    lm_tokens = tasks["lm"].tokens if isinstance(tasks.get("lm"), LanguageModeling) else 64
    contexts = sorted({*grid.contexts, *(c for t in tasks.values() if isinstance(t, dict) for c in t["contexts"])})
    first = True
    for context in contexts:
        if not grid.runs_at(model_name, context):
            continue
        quality = [n for n in tasks if n != SPEED and context in grid.contexts]
        specs = sized(context, lm_tokens) if quality else [(s, False) for s in grid.caches]
        for task_name, task in tasks.items():
            if task_name == SPEED:
                if context not in task["contexts"]:
                    continue
                ctx: int | None = context
                run_specs = [(s, False) for s in grid.caches]
            else:
                if context not in grid.contexts or (not uses_context(task) and not first):
                    continue
                ctx = context if uses_context(task) else None
                run_specs = specs
            params = task if isinstance(task, dict) else asdict(task)
            cells = [(cell_id(model_name, spec, ctx, task_name, params, grid), spec, eq)
                     for spec, eq in run_specs if grid.runs(task_name, spec.label, model_name, ctx)]  # fmt: skip
            yield Group(model_name, ctx, task_name, task, cells)
        if context in grid.contexts:
            first = False


def anchor(grid: Grid) -> CacheSpec:
    """The cache whose bytes ``--equal-bytes`` sizes the others to (the grid must set ``equal_bytes``)."""
    from kvpolicy_lab.eval.equal_bytes import anchor_of

    eb = grid.equal_bytes
    return anchor_of(grid.caches, None if eb is True else str(eb))


def equal_specs(grid: Grid, model: Any, context: int, steps: int,
                memo: dict[str, Any]) -> tuple[list[tuple[CacheSpec, bool]], list[dict[str, Any]]]:  # fmt: skip
    """The grid's caches plus their ``--equal-bytes`` copies at ``context``, and the sizing report.

    Parameters
    ----------
    grid : Grid
    model : Any
        The loaded model (its config, dtype and device size the copies); unused without ``equal_bytes``.
    context, steps : int
        Prefill tokens and decoding steps the bytes are measured after.
    memo : dict
        Earlier sizings of this model (updated in place; see :func:`kvpolicy_lab.eval.equal_bytes.equalize`).

    Returns
    -------
    specs : list of (CacheSpec, bool)
        ``(cache, is a copy)``: the grid's caches, then the copies.
    sizings : list of dict
        One row per copy: context, anchor label and the :class:`~kvpolicy_lab.eval.equal_bytes.Sizing` fields.
    """
    specs = [(s, False) for s in grid.caches]
    if not grid.equal_bytes:
        return specs, []
    from kvpolicy_lab.eval.equal_bytes import equalize, resizable

    base = anchor(grid)
    sized, report = equalize(model, base, grid.caches, context, steps, memo=memo)
    rows = [{"context": context, "anchor": base.label, **asdict(s)} for s in report]
    copies = [(s, True) for s, orig in zip(sized, grid.caches, strict=True) if resizable(orig, base)]
    return specs + copies, rows
