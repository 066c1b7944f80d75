"""Running the cells of an ablation grid: one group of cells at a time, results as plain rows.

A *group* is the cells that share a model, a context length and a task. They share the task's samples
and, when a cell needs them, the uncompressed references, which :class:`CellGroup` computes once. A cell
run returns a :class:`CellResult` (its rows for ``results.jsonl`` and its lines for ``samples.jsonl``)
and writes nothing, so it can run in the runner's process or in a worker elsewhere; only the runner
(:class:`kvpolicy_lab.eval.runner.Runner`) writes the run directory.
"""

from __future__ import annotations

import time
import traceback
from collections import Counter
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpolicy_lab.eval import measure
from kvpolicy_lab.eval.caches import CacheSpec
from kvpolicy_lab.eval.grid import CELL_IDS, SPEED, Grid
from kvpolicy_lab.eval.tasks import LanguageModeling, Task

#: cache kinds that treat the sequences of a batch independently, so that a grid's ``batch`` applies
#: to them (transformers' ``QuantizedCache`` does not: hqq's groups span the batch); a policy that
#: reads attention scores runs one sample at a time as well
ROW_INDEPENDENT = ("compressed", "preset", "dynamic")


@dataclass
class CellResult:
    """What one cell produced.

    Attributes
    ----------
    cid : str
        The cell's id.
    cache, task : str
        The cell's cache label and task name (for messages).
    context : int or None
        The cell's context length (``None`` for tasks that do not use one).
    rows : list of dict
        Its rows for ``results.jsonl``: one per metric, or one error row.
    samples : list of dict
        Its lines for ``samples.jsonl`` (generation tasks).
    error : str or None
        ``"Type: message"`` when the cell raised (``rows`` then holds its error row).
    """

    cid: str
    cache: str
    task: str
    context: int | None
    rows: list[dict[str, Any]]
    samples: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


def spec_fields(spec: CacheSpec) -> dict[str, Any]:
    """The policy, action, bits and backend columns of a row for ``spec``."""
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


def make_row(cid: str, model: str, spec: CacheSpec, eq: bool, context: int | None, task: str, metric: str,
             rows_in_cell: int, value: float, se: float | None = None, n: int = 1,
             extra: dict | None = None) -> dict[str, Any]:  # fmt: skip
    """One row of ``results.jsonl`` (see :mod:`kvpolicy_lab.eval.runner`)."""
    return {
        "cell": cid, "cell_ids": CELL_IDS, "model": model, "cache": spec.label, "kind": spec.kind,
        "repr": spec.describe(),
        **spec_fields(spec), "equal_bytes": eq, "context": context, "task": task, "metric": metric,
        "value": value, "se": se, "n": n, "rows_in_cell": rows_in_cell, "extra": extra or {},
    }  # fmt: skip


def error_result(cid: str, model: str, spec: CacheSpec, eq: bool, context: int | None, task: str, message: str,
                 trace: str) -> CellResult:  # fmt: skip
    """The result of a cell that raised ``message`` (its one error row; the next run retries it)."""
    row = make_row(cid, model, spec, eq, context, task, "error", 1, value=float("nan"),
                   extra={"error": message, "traceback": trace})  # fmt: skip
    return CellResult(cid, spec.label, task, context, [row], error=message)


def _attention_for(model: Any, decode: str, wrapped: bool) -> AbstractContextManager[None]:
    """kvpolicy's attention for a cell (``decode``: the grid's mode), as a :func:`kvpolicy.modes.decode_mode`
    that restores the model's implementation when the cell ends.

    ``"fused"`` installs the fused decode attention (:func:`kvpolicy.fused.enable_fused`, which also
    reports attention scores): compressed caches are measured on the path a user runs, and a cell
    decodes up to 2.3x faster than with a materialised history (SmolLM2 at 2k). The grid's
    ``"materialized"`` installs the score wrapper only (``decode_mode(model, "scores")``), so every decode
    step rebuilds the history. Both check masks, so ``layout="agnostic"`` works (:mod:`kvpolicy.handoff`);
    other caches' outputs are unchanged either way. Models whose attention implementation kvpolicy does
    not wrap are left alone; for a cache that needs the wrapper (``wrapped``: a policy that needs scores, a
    transform fitted on the queries) on such a model entering the mode raises the ConfigError naming the
    implementation, which becomes the cell's error row.
    """
    from kvpolicy import attention, fused
    from kvpolicy.modes import decode_mode

    base = model.config._attn_implementation.removeprefix(fused.PREFIX).removeprefix(attention.PREFIX)
    if base not in attention.WRAPPED and not wrapped:
        return nullcontext()
    return decode_mode(model, "fused" if decode == "fused" else "scores")


class PathTally:
    """How the decode steps of a cell attended: per path, how many layer-steps took it.

    After every decode forward of ``model`` (one new position) through the watched cache, each
    compressed layer's latest path (:meth:`kvpolicy.cache.CompressedCache.attention_paths`, e.g.
    ``"fused (cpu)"`` or ``"materialized (torch): <reason>"``) is counted once. Prefill forwards are
    not decode steps and count nothing; neither do forwards through another cache (the uncompressed
    references) or caches without that report (transformers' own).
    """

    def __init__(self, model: Any) -> None:
        self.counts: Counter[str] = Counter()
        self._cache: Any = None
        self._handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def watch(self, cache: Any) -> Any:
        """Count the steps through ``cache`` from now on; returns it."""
        self._cache = cache
        return cache

    def _hook(self, module: Any, args: Any, kwargs: dict, output: Any) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        report = getattr(cache, "attention_paths", None)
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        positions = ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else None
        if cache is self._cache and report is not None and positions == 1:
            self.counts.update(p for p in report().values() if p is not None)

    def close(self) -> None:
        self._handle.remove()

    def extra(self) -> dict[str, Any]:
        """``{"attention_paths": {path: layer-steps}}`` for a row's ``extra`` (empty when none)."""
        return {"attention_paths": dict(sorted(self.counts.items()))} if self.counts else {}


class CellGroup:
    """The cells of one model × context × task, run one at a time on a loaded model.

    Parameters
    ----------
    grid : Grid
        The grid (dtype, seed, replay).
    model, tok : Any
        The loaded model and its tokenizer.
    model_name : str
        The model's name in the grid.
    context : int or None
        The context length (``None``: a task that does not use one).
    task_name : str
        The task's name in the grid (``speed``: the timing task).
    task : Task or dict
        The task object (``speed``: its parameters).
    progress : bool
        Show tqdm bars within long cells.
    """

    def __init__(self, grid: Grid, model: Any, tok: Any, model_name: str, context: int | None, task_name: str,
                 task: Task | dict[str, Any], progress: bool = False) -> None:  # fmt: skip
        self.grid = grid
        self.model = model
        self.tok = tok
        self.model_name = model_name
        self.context = context
        self.task_name = task_name
        self.task = task
        self.progress = progress
        if task_name == SPEED:
            self.samples = LanguageModeling(samples_per_context=1, tokens=1).samples(tok, context, grid.seed)
            self.ids = self.samples[0].ids[:context]
        else:
            self.samples = task.samples(tok, context or 0, grid.seed)  # type: ignore[union-attr]
        self.refs: list[measure.Reference | None] | None = None

    def run(self, cid: str, spec: CacheSpec, eq: bool) -> CellResult:
        """Run the cell of cache ``spec`` (``eq``: an ``--equal-bytes`` copy) with id ``cid``.

        An exception inside the cell is caught and returned as its error row.
        """
        grid, model, task, context = self.grid, self.model, self.task, self.context
        t0 = time.perf_counter()
        scores = spec.needs_scores()
        queries = spec.needs_queries()
        paths = PathTally(model)
        records: list[dict[str, Any]] = []
        try:
            with _attention_for(model, grid.decode, scores or queries):
                make = lambda spec=spec: paths.watch(spec.build(model))  # noqa: E731
                if self.task_name == SPEED:
                    metrics = measure.speed(model, self.ids, make, task["steps"], task["repeats"])  # type: ignore[index]
                else:
                    samples = self.samples
                    needs_ref = grid.replay or any(s.kind == "teacher_forced" or s.against_reference for s in samples)
                    if self.refs is None and needs_ref:
                        self.refs = measure.references(model, samples, grid.batch)
                    replay = grid.replay and not scores and not queries  # their prefill reports to the cache
                    metrics, records = measure.quality(
                        model,
                        self.tok,
                        task,
                        samples,
                        self.refs,
                        make,
                        replay=replay,
                        progress=self.progress,
                        attention_error=grid.attention_error_at(context),
                        batch=grid.batch if spec.kind in ROW_INDEPENDENT and not scores else 1,
                    )
        except Exception as exc:  # recorded, retried by the next run
            return error_result(cid, self.model_name, spec, eq, context, self.task_name,
                                f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=6))  # fmt: skip
        finally:
            paths.close()
        seconds = time.perf_counter() - t0
        rows = [make_row(cid, self.model_name, spec, eq, context, self.task_name, m.name, len(metrics), value=m.value,
                         se=m.se, n=m.n, extra={**m.extra, "seconds": round(seconds, 2), **paths.extra()})
                for m in metrics]  # fmt: skip
        lines = [{"cell": cid, "cache": spec.label, "task": self.task_name, "context": context, **r} for r in records]
        return CellResult(cid, spec.label, self.task_name, context, rows, lines)
