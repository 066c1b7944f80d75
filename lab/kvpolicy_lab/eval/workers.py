"""The Ray worker of ``kvpolicy ablate --executor ray``: one actor per slot of the cluster.

A :class:`Worker` holds its slot (its GPU or its CPUs) for the whole run and runs one job at a time:
a cell, the ``--equal-bytes`` sizing of a model's caches, or a model's attention analysis. It keeps
the model it loaded last, and the samples and references of the group of cells it ran last, for its
next job. Being an actor, it keeps the GPU Ray gave it, so a model it holds never sits on a GPU that
Ray has since given to another task. Whatever it produces goes back to the driver, which alone writes
the run directory.
"""

from __future__ import annotations

import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpolicy.errors import ConfigError
from kvpolicy_lab.eval.caches import CacheSpec
from kvpolicy_lab.eval.cells import CellGroup, CellResult, error_result
from kvpolicy_lab.eval.grid import Grid
from kvpolicy_lab.eval.plan import Group, equal_specs, plan_groups


@dataclass(frozen=True)
class Fatal:
    """A :class:`~kvpolicy.errors.ConfigError` outside a cell (loading the model, drawing a task's samples,
    sizing the caches): the run stops with its message, as the in-process runner would."""

    message: str


class Worker:
    """Runs the jobs of one grid in a worker process (used as a Ray actor).

    Parameters
    ----------
    grid : Grid
        The grid whose cells it runs.
    threads : int
        torch threads in this process.
    """

    def __init__(self, grid: Grid, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self.grid = grid
        self._loaded: tuple[str, Any, Any] | None = None
        self._group: tuple[tuple[Any, ...], CellGroup] | None = None

    def _model(self, name: str) -> tuple[Any, Any]:
        """``name`` loaded (once; loading another model drops the previous one)."""
        from kvpolicy_lab.eval.runner import open_model

        if self._loaded is None or self._loaded[0] != name:
            self._loaded = self._group = None
            grid = self.grid
            self._loaded = (name, *open_model(name, grid.dtype, grid.device, grid.online))
        return self._loaded[1], self._loaded[2]

    def cell(self, group: Group, cid: str, spec: CacheSpec, eq: bool) -> CellResult | Fatal:
        """Run one cell of ``group`` (a group whose list of cells may be empty)."""
        key = (group.model, group.context, group.task_name, repr(group.task))
        try:
            model, tok = self._model(group.model)
            if self._group is None or self._group[0] != key:
                self._group = None
                self._group = (key, CellGroup(self.grid, model, tok, group.model, group.context, group.task_name,
                                              group.task))  # fmt: skip
        except ConfigError as exc:
            return Fatal(str(exc))
        except Exception as exc:  # drawing the samples failed otherwise: the cell's error row, retried next run
            return error_result(cid, group.model, spec, eq, group.context, group.task_name,
                                f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=6))  # fmt: skip
        return self._group[1].run(cid, spec, eq)

    def plan(self, model_name: str,
             memo: dict[str, Any]) -> tuple[list[Group], list[dict[str, Any]], dict[str, Any]] | Fatal:  # fmt: skip
        """The groups of ``model_name`` with their ``--equal-bytes`` copies sized on the loaded model, the
        sizing rows, and ``memo`` (the model's earlier sizings) updated."""
        sizings: list[dict[str, Any]] = []
        try:
            model, _ = self._model(model_name)

            def sized(context: int, steps: int) -> list[tuple[CacheSpec, bool]]:
                specs, rows = equal_specs(self.grid, model, context, steps, memo)
                sizings.extend(rows)
                return specs

            groups = list(plan_groups(self.grid, model_name, self.grid.task_objects(), sized))
        except ConfigError as exc:
            return Fatal(str(exc))
        return groups, sizings, memo

    def attention(self, model_name: str, params: dict[str, Any]) -> dict[str, bytes] | Fatal:
        """The files of the attention analysis of ``model_name``: path in its directory -> content."""
        from kvpolicy_lab.eval.attention_analysis import analyze_attention

        try:
            model, tok = self._model(model_name)
        except ConfigError as exc:
            return Fatal(str(exc))
        with tempfile.TemporaryDirectory() as tmp:
            analyze_attention(model, tok, seed=self.grid.seed, out=tmp, name=model_name, **params)
            return {str(p.relative_to(tmp)): p.read_bytes() for p in Path(tmp).rglob("*") if p.is_file()}
