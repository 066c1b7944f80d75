"""``kvpolicy tune``: search compositions under a bits-per-element budget (see :mod:`kvpolicy_lab.tune`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvpolicy.commands._parser import add_list
from kvpolicy.commands._types import DTYPES, dtype_name, model_name, positive_int, token_count
from kvpolicy.errors import ConfigError
from kvpolicy_lab.commands._types import check_output, device_name, out_dir, out_file, positive_float

if TYPE_CHECKING:
    from kvpolicy_lab.eval.executors import RayExecutor


def _run(args: argparse.Namespace) -> int:
    if not args.online:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a missing model fails in seconds, not after retries
    import torch

    from kvpolicy_lab.eval.executors import make_executor
    from kvpolicy_lab.eval.lock import hold_run_dir

    executor = make_executor(args.executor, None, None, None, args.threads)
    if executor is not None:
        executor.check_address()  # a cluster named by RAY_ADDRESS that cannot be reached fails before any work
    if args.threads:
        torch.set_num_threads(args.threads)
    with hold_run_dir(args.out, "--out"):
        return _search(args, executor)


def _search(args: argparse.Namespace, executor: RayExecutor | None) -> int:
    """The search itself, with ``--out`` held (see :func:`_run`)."""
    from tqdm.auto import tqdm

    from kvpolicy_lab import tune
    from kvpolicy_lab.eval.grid import grid_from_dict
    from kvpolicy_lab.eval.runner import Runner, open_model
    from kvpolicy_lab.eval.tasks import CALIBRATION_FILES

    model, tokenizer = open_model(args.model, args.dtype, args.device, args.online)
    config = model.config
    rotate, why = args.rotation != "none", f"--rotation {args.rotation}"
    if args.rotation == "auto":
        rotate, why = tune.rotation_helps(model, tokenizer, args.context)
        print(f"rotation: {why}", file=sys.stderr)
    del model
    lengths = (1, args.screen_tokens, args.tokens, args.heldout_tokens)  # the ends of the runs below
    layers = tune.attention_layers(config)
    candidates = list(tune.space(layers, tuple(args.windows), tuple(args.key_groups), tuple(args.tier_factors), rotate,
                                 tuple(args.key_fits), tuple(args.norm_bits), tuple(args.schemes),
                                 tuple(args.transforms)))  # fmt: skip
    held: dict[str, float] = {}  # the bytes of each storage layout, computed once
    for c in tqdm(candidates, desc="bytes of each composition", disable=args.no_progress):
        key = tune.storage_key(c.args)
        if key not in held:
            held[key] = tune.simulated_bits(c.args, config, args.context, lengths)
        c.bits = held[key]
    fitting = tune.within_budget(candidates, args.budget_bits)
    screened = tune.pick(fitting, args.screen)
    print(f"{len(candidates)} compositions, {len(fitting)} within {args.budget_bits:g} bits per element at "
          f"{args.context} tokens; screening {len(screened)}, calibrating the best {args.trials}",
          file=sys.stderr)  # fmt: skip

    def run(name: str, caches: list[tune.Candidate], lm: dict) -> None:
        """Run ``caches`` on the ``lm`` task into ``--out/name``; their scores go to ``c.scores[name]``."""
        run_dir = args.out / name
        spec = tune.grid(args.model, args.context, caches, lm, args.dtype, args.device, args.batch)
        grid = grid_from_dict({**spec, "online": args.online})
        failed = Runner(grid, run_dir, progress=not args.no_progress, executor=executor).run()
        if failed:
            raise RuntimeError(f"{failed} cell(s) of the {name} run failed; see {run_dir}")
        scores = tune.read_scores(run_dir)
        for c in caches:
            c.scores[name] = scores[c.label]

    texts = {"files": list(CALIBRATION_FILES)}
    run("screen", screened, {"samples_per_context": args.screen_samples, "tokens": args.screen_tokens, **texts})
    # the bytes a run measured (after its teacher-forced tokens) must fit too
    fits = tune.measured_within(screened, args.budget_bits, "screened")
    trials = tune.pick(sorted(fits, key=lambda c: c.scores["screen"]["kl"]), args.trials, nearest=False)
    run("calibration", trials, {"samples_per_context": args.samples, "tokens": args.tokens, **texts})
    fitting_trials = tune.measured_within(trials, args.budget_bits, "calibrated")
    chosen = min(fitting_trials, key=lambda c: c.scores["calibration"]["kl"])
    singles = sorted((c for c in trials if c.family == "single"), key=lambda c: c.scores["calibration"]["kl"])
    held = [chosen, *[c for c in singles[: args.compare] if c is not chosen]]
    run("heldout", held, {"samples_per_context": args.heldout_samples, "tokens": args.heldout_tokens})
    print(tune.frontier_table(trials, chosen))
    info = {
        "model": args.model, "budget_bits": args.budget_bits, "context": args.context, "label": chosen.label,
        "bits_per_element": round(chosen.bits, 4),
        "bits_per_element_calibration": round(chosen.scores["calibration"]["bits"], 4),
        "bits_per_element_heldout": round(chosen.scores["heldout"]["bits"], 4),
        "kl_calibration": chosen.scores["calibration"]["kl"],
        "kl_heldout": chosen.scores["heldout"]["kl"], "top1_heldout": chosen.scores["heldout"]["top1"],
        "rotation": "hadamard" if rotate else "none", "rotation_reason": why,
        "command": " ".join(["kvpolicy", *sys.argv[1:]]),
    }  # fmt: skip
    args.preset.parent.mkdir(parents=True, exist_ok=True)
    args.preset.write_text(tune.preset_toml(chosen, info))
    print(f"\nchosen: {chosen.label} ({chosen.bits:.3f} bits per element); preset written to {args.preset}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``kvpolicy tune`` to ``sub``."""
    p = sub.add_parser(
        "tune",
        help="find the composition that fits a bits-per-element budget best (screening and calibration texts, "
        "then held-out texts)",
        description="Search compositions (policy window, sinks, key/value widths and schemes, rotation when it "
        "helps the model, boundary layers, a middle tier) under --budget-bits, screen --screen of them on a short "
        "calibration text, rank the best --trials on calibration texts, check the winner against the best "
        "single-tier compositions on held-out texts, and write a preset file that CompressedCache.from_config "
        "loads (--preset-file). Resumable: the runs live in --out.",
    )  # fmt: skip
    p.add_argument("--model", type=model_name, default="smollm2",
                   help="smollm2, gemma3-270m, tiny-<llama|qwen2|mistral>[-LAYERS], a local path or a hub id "
                   "(a hub id not in the local cache needs --online)")  # fmt: skip
    p.add_argument(
        "--budget-bits",
        type=positive_float,
        required=True,
        help="bits per element, everything held (a hybrid model's: over its full-attention layers)",
    )
    p.add_argument("--context", type=token_count, default=2048, help="context tokens (2048, 8k...)")
    p.add_argument("--preset-file", dest="preset", type=out_file, required=True, metavar="FILE",
                   help="the preset file to write (.toml; CompressedCache.from_config reads it)")  # fmt: skip
    p.add_argument("--out", type=out_dir, default=None, metavar="DIR",
                   help="directory of the runs (screen, calibration, heldout), kept for resuming (default: next to "
                   "the preset file: FILE without .toml, plus -runs)")  # fmt: skip
    p.add_argument("--screen", type=positive_int, default=40, help="compositions screened")
    p.add_argument("--screen-samples", type=positive_int, default=1, help="screening texts")
    p.add_argument("--screen-tokens", type=token_count, default=32, help="screening tokens per text")
    p.add_argument("--trials", type=positive_int, default=9, help="compositions calibrated")
    p.add_argument("--compare", type=positive_int, default=2, help="single-tier rivals scored held out")
    p.add_argument("--samples", type=positive_int, default=3, help="calibration texts")
    p.add_argument("--tokens", type=token_count, default=128, help="calibration tokens per text")
    p.add_argument("--heldout-samples", type=positive_int, default=5, help="held-out texts")
    p.add_argument("--heldout-tokens", type=token_count, default=256, help="held-out tokens per text")
    add_list(p, "--windows", positive_int, default=[16, 42], metavar="W", help="log windows tried")
    add_list(p, "--key-groups", positive_int, default=[64], metavar="G",
             help="group sizes of the keys (per channel) tried")  # fmt: skip
    add_list(
        p,
        "--key-fits",
        choices=("minmax", "mse"),
        default=["minmax", "mse"],
        metavar="FIT",
        help="ranges of the min-max keys tried: minmax (min-max), mse (fitted for the least squared error)",
    )
    add_list(p, "--tier-factors", positive_int, default=[4], metavar="FACTOR",
             help="a middle tier keeps what the log rule at FACTOR x the window keeps")  # fmt: skip
    add_list(p, "--norm-bits", int, choices=(16, 8), default=[8], metavar="BITS",
             help="widths of the per-vector scales of codebook and lattice blocks tried: 8 (one-byte log codes), "
             "16")  # fmt: skip
    add_list(p, "--schemes", choices=("codebook", "lattice"), default=["codebook", "lattice"], metavar="SCHEME",
             help="per-token vector schemes tried for rotated keys and values: codebook (Lloyd-Max indices per "
             "coordinate), lattice (D4 lattice points per four coordinates, 2 and 3 bits)")  # fmt: skip
    # (kvpolicy_lab.tune.TRANSFORMS and DEFAULT_TRANSFORMS; that module is imported when a search runs)
    add_list(p, "--transforms", choices=("hadamard", "query-hadamard", "lowrank"),
             default=["hadamard", "query-hadamard"], metavar="TRANSFORM",
             help="transforms tried where the rotation is searched: hadamard, query-hadamard (keys weighted per "
             "channel by the prompt's queries first; labels end in -qh), lowrank (each key's rank-8 principal part "
             "held beside the codes; labels end in -lr; not tried unless named)")  # fmt: skip
    p.add_argument("--rotation", choices=("auto", "hadamard", "none"), default="auto",
                   help="search with the Hadamard rotation, without it, or (auto) as `kvpolicy analyze rotation` "
                   "finds for this model on a calibration text")  # fmt: skip
    p.add_argument("--batch", type=positive_int, default=4, metavar="N",
                   help="decode up to N texts of a run together: the same scores up to float rounding, in less time "
                   "on CPU (as `kvpolicy ablate --batch`)")  # fmt: skip
    p.add_argument("--dtype", type=dtype_name, choices=DTYPES, default="float32", help="model dtype")
    p.add_argument("--device", type=device_name, default="cpu", help="cpu, cuda, cuda:N or mps")
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help='where the cells run: here, or on Ray workers (pip install "kvpolicy-lab[ray]")')  # fmt: skip
    p.add_argument("--online", action="store_true", help="allow downloading the model from the Hugging Face hub")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_run_with_defaults, resumes="out")


def _run_with_defaults(args: argparse.Namespace) -> int:
    if args.out is not None and args.out.suffix == ".toml":
        raise ConfigError(
            f"--out {str(args.out)!r} looks like a preset file, but --out is the directory of the runs; the preset "
            "file is --preset-file: give --out a directory, or leave it out (default: next to the preset file)"
        )
    if args.out is None:
        runs = Path(str(args.preset.with_suffix("")) + "-runs")
        args.out = check_output("--out (default: next to --preset-file)", runs, "directory")
    return _run(args)
