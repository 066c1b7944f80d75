"""Decode speed and prompt peak memory of kvpolicy at two or more git revisions, in one interleaved run.

Each revision is checked out as a detached ``git worktree`` under ``--worktrees`` (default: a
``kvpolicy-revisions`` folder in the temporary directory; an existing one at the same commit is reused,
no other worktree is touched) and measured in fresh Python processes whose ``PYTHONPATH`` starts with
that checkout (``kvpolicy`` and ``lab/``), with plugin autoloading off, so every process runs the
revision's own code. The C++ kernel is built once per revision before any timing (its build name carries
a hash of its source, so each revision gets its own object in the shared kvpolicy cache directory).

The measurements reuse the revision's own benchmark code:

- decode ms/token: one process per revision fills every cache of ``--caches`` to ``--length`` tokens as
  ``kvpolicy bench decode --fill synthetic`` does (its ``_prefill``, SmolLM2-135M, float32, batch 1),
  then, once per repetition, times them with that benchmark's interleaved Timer rounds
  (``kvpolicy_lab.bench.timing.interleaved``: ``--rounds`` measured rounds after one warm-up round,
  ``--steps`` steps each); a repetition's value per cache is the median of its rounds (the contexts
  grow by the steps run);
- prompt peak memory: one process per revision, cache and repetition runs ``kvpolicy bench memory``'s
  worker (``python -m kvpolicy_lab.bench.memory``): the resident-set high-water mark of a
  ``--length``-token prompt and ``--memory-steps`` decode steps, above the loaded, warmed-up model
  (a peak is the process's own, so ``--memory-parallel`` processes may run at once to save time).

Repetitions alternate the revisions (their order rotates from one repetition to the next), so all see the
same machine load. The table gives, per cache and revision, the median over repetitions with the
interquartile range in brackets, and the ratio of the last revision to each earlier one: the median of
the per-repetition ratios (each repetition's values were measured side by side), with its IQR. Results
are rewritten to ``--out`` after every measurement (``revisions.json``, ``table.md``), so a run cut
short keeps what it measured.

Usage::

    python scripts/compare_revisions.py e29417c main --length 8192 --reps 5 --threads 1 \\
        --out results/revisions-8k
    python scripts/compare_revisions.py HEAD~1 HEAD --length 256 --reps 2 --memory-reps 1   # quick

``--summarise DIR`` rewrites ``DIR/table.md`` from ``DIR/revisions.json`` (e.g. after a run was stopped).
Remove the worktrees afterwards with ``git worktree remove <path>`` (their paths are in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

CACHES = ("dynamic", "one-liner", "preset:kvpolicy-3bit", "preset:kvpolicy-3.5bit")
#: the line prefix of a worker's JSON result (the memory worker's is the revision's own)
RESULT = "COMPARE-REVISIONS-RESULT "
MEMORY_RESULT = "KVPOLICY-MEMORY-RESULT "


# ---------------------------------------------------------------------- worktrees
def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def checkout(repo: Path, rev: str, root: Path) -> tuple[str, Path]:
    """The full hash of ``rev`` and a detached worktree of it under ``root`` (made, or reused)."""
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}", cwd=repo)
    path = root / commit[:12]
    if path.exists():
        if _git("rev-parse", "HEAD", cwd=path) != commit:
            raise SystemExit(f"{path} exists but is not at {commit}; remove it with git worktree remove")
    else:
        root.mkdir(parents=True, exist_ok=True)
        _git("worktree", "add", "--detach", str(path), commit, cwd=repo)
    return commit, path


def environment(path: Path, threads: int) -> dict[str, str]:
    """The environment of a process that runs the revision checked out at ``path``."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(path), str(path / "lab")]),
        "KVPOLICY_DISABLE_PLUGIN_AUTOLOAD": "1",
        "OMP_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
    }


def _run(argv: list[str], env: dict[str, str], mark: str) -> dict[str, Any]:
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=env["PYTHONPATH"].split(os.pathsep)[0])
    lines = [line for line in proc.stdout.splitlines() if line.startswith(mark)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"{argv[1:3]} failed (exit status {proc.returncode}):\n{tail}")
    return json.loads(lines[-1].removeprefix(mark))


# ---------------------------------------------------------------------- worker side (runs the revision's code)
def _worker(job: dict[str, Any], path: str) -> None:
    """Build the kernel (``kind: build``), or fill the decode caches once and then answer each ``measure``
    line on stdin with one interleaved measurement of every cache (``kind: decode``); results on stdout."""
    import torch

    import kvpolicy

    if not Path(kvpolicy.__file__).resolve().is_relative_to(Path(path).resolve()):
        raise SystemExit(f"kvpolicy imported from {kvpolicy.__file__}, not from {path}")
    torch.set_num_threads(job["threads"])
    if job["kind"] == "build":
        from kvpolicy.kernels.cpu_attention import load

        load()
        print(RESULT + json.dumps({"kvpolicy": kvpolicy.__file__}), flush=True)
        return
    from kvpolicy_lab.bench.decode import DecodeStep, Variant, _decoding, _prefill, load
    from kvpolicy_lab.bench.timing import device_clock, interleaved

    model = load("smollm2", torch.float32, "cpu")
    args = argparse.Namespace(window=42, fill="synthetic", device="cpu", dtype="float32")
    variants = {name: Variant.parse(name) for name in job["caches"]}
    ids = torch.randint(3, model.config.vocab_size, (1, job["length"]), generator=torch.Generator().manual_seed(0))
    steps = {}
    for name, v in variants.items():
        cache, token, _ = _prefill(model, v, ids, args)
        steps[name] = DecodeStep(model, cache, token)
    print(RESULT + json.dumps({"ready": True}), flush=True)
    for _ in sys.stdin:
        measured = interleaved(
            steps, number=job["steps"], repeats=job["rounds"], warmup=1, threads=job["threads"],
            around=lambda name: _decoding(model, variants[name]), clock=device_clock("cpu"),
        )  # fmt: skip
        paths = {n: sorted(map(str, set(getattr(s.cache, "attention_paths", dict)().values()) - {None}))
                 for n, s in steps.items()}  # fmt: skip
        result = {n: {"decode_ms": m.median * 1e3, "rounds_ms": [t * 1e3 for t in m.times], "paths": paths[n],
                      "tokens": steps[n].cache.get_seq_length()} for n, m in measured.items()}  # fmt: skip
        print(RESULT + json.dumps(result), flush=True)


class Worker:
    """A decode worker process of one revision: it fills its caches once, then measures on request."""

    def __init__(self, script: str, path: Path, job: dict[str, Any], threads: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, script, str(path), "--worker", json.dumps(job)], env=environment(path, threads),
            cwd=path, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

    def read(self) -> dict[str, Any]:
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                return json.loads(line.removeprefix(RESULT))
        raise RuntimeError(f"decode worker exited with status {self.proc.wait()} (its stderr is above)")

    def measure(self) -> dict[str, Any]:
        self.proc.stdin.write("measure\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


# ---------------------------------------------------------------------- statistics and output
def _summary(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "iqr": q[2] - q[0], "n": len(values)}


def _cell(s: dict[str, float] | None, digits: int) -> str:
    return "-" if s is None else f"{s['median']:.{digits}f} ({s['iqr']:.{digits}f})"


def summarise(data: dict[str, Any]) -> dict[str, Any]:
    """Median (IQR) per metric, cache and revision, and the last revision's paired ratios to each other."""
    revs = data["revisions"]
    new = revs[-1]["commit"]
    out: dict[str, Any] = {}
    measured = dict(data["samples"])
    dyn = measured["decode_ms"].get("dynamic", {})
    measured["decode_x_dynamic"] = {  # each cache over DynamicCache in the same process and rounds
        cache: {c: {k: v / dyn[c][k] for k, v in reps.items() if k in dyn.get(c, {})} for c, reps in by_rev.items()}
        for cache, by_rev in measured["decode_ms"].items()
        if cache != "dynamic"
    }
    for metric in ("decode_ms", "decode_x_dynamic", "peak_mib"):
        per: dict[str, Any] = {}
        for cache in data["caches"]:
            samples = {r["commit"]: measured[metric].get(cache, {}).get(r["commit"], {}) for r in revs}
            cell: dict[str, Any] = {c: _summary(list(v.values())) for c, v in samples.items() if v}
            for r in revs[:-1]:
                old = r["commit"]
                pairs = [samples[new][k] / samples[old][k] for k in samples[new] if k in samples[old]]
                if pairs:
                    cell[f"ratio {new[:7]}/{old[:7]}"] = _summary(pairs)
            per[cache] = cell
        out[metric] = per
    return out


def table(data: dict[str, Any]) -> str:
    revs = data["revisions"]
    new = revs[-1]["commit"][:7]
    names = [f"{r['name']} ({r['commit'][:7]})" if r["name"] != r["commit"][:7] else r["name"] for r in revs]
    ratios = [f"{new}/{r['commit'][:7]}" for r in revs[:-1]]
    lines = []
    for metric, title, digits in (
        ("decode_ms", "decode ms/token", 2),
        ("decode_x_dynamic", "decode time x DynamicCache's in the same rounds", 3),
        ("peak_mib", "prompt peak MiB", 1),
    ):
        summary = data["summary"].get(metric, {})
        if not any(summary.values()):
            continue
        lines += [f"**{title}** at {data['length']} tokens, median (IQR) over repetitions", ""]
        lines.append("| cache | " + " | ".join([*names, *ratios]) + " |")
        lines.append("|---" * (1 + len(names) + len(ratios)) + "|")
        for cache, cell in summary.items():
            if not cell:
                continue
            values = [_cell(cell.get(r["commit"]), digits) for r in revs]
            values += [_cell(cell.get(f"ratio {r}"), 3) for r in ratios]
            lines.append(f"| {cache} | " + " | ".join(values) + " |")
        lines.append("")
    lines.append(f"Command: `{data['command']}`")
    lines.append(f"Machine: {data['machine']}; torch {data['torch']}; {data['threads']} thread(s).")
    return "\n".join(lines) + "\n"


def save(data: dict[str, Any], out: Path) -> None:
    data["summary"] = summarise(data)
    out.mkdir(parents=True, exist_ok=True)
    (out / "revisions.json").write_text(json.dumps(data, indent=1))
    (out / "table.md").write_text(table(data))


# ---------------------------------------------------------------------- driver
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("revisions", nargs="*", help="git revisions, oldest first; the last is compared to each")
    parser.add_argument("--length", type=int, default=8192, help="context / prompt tokens (default 8192)")
    parser.add_argument("--reps", type=int, default=5, help="decode repetitions per revision (default 5)")
    parser.add_argument("--memory-reps", type=int, default=None, help="memory repetitions (default: --reps; 0: none)")
    parser.add_argument("--caches", nargs="+", default=list(CACHES), help=f"cache variants (default {CACHES})")
    parser.add_argument(
        "--memory-caches", nargs="+", default=None, help="caches of the memory runs (default: --caches)"
    )
    parser.add_argument("--memory-parallel", type=int, default=1,
                        help="memory processes run at once (a peak is per process; default 1)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per round (default 16)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per decode process (default 3)")
    parser.add_argument("--memory-steps", type=int, default=2, help="decode steps after the prompt (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in every process (default 1)")
    parser.add_argument("--out", type=Path, default=Path("compare-revisions"), help="output folder")
    parser.add_argument("--worktrees", type=Path, default=Path(tempfile.gettempdir()) / "kvpolicy-revisions")
    parser.add_argument("--summarise", type=Path, metavar="DIR", help="only rewrite DIR/table.md from its JSON")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.summarise:
        save(json.loads((args.summarise / "revisions.json").read_text()), args.summarise)
        print((args.summarise / "table.md").read_text())
        return 0
    if args.worker:
        _worker(json.loads(args.worker), args.revisions[0])
        return 0
    if len(args.revisions) < 2:
        parser.error("give at least two revisions")
    repo = Path(_git("rev-parse", "--show-toplevel", cwd=Path.cwd()))
    revs = []
    for rev in args.revisions:
        commit, path = checkout(repo, rev, args.worktrees)
        revs.append({"name": rev, "commit": commit, "path": str(path)})
    memory_reps = args.reps if args.memory_reps is None else args.memory_reps
    import torch

    data: dict[str, Any] = {
        "command": " ".join(["python", "scripts/compare_revisions.py", *sys.argv[1:]]),
        "revisions": revs, "length": args.length, "caches": args.caches, "threads": args.threads,
        "steps": args.steps, "rounds": args.rounds, "memory_steps": args.memory_steps, "torch": torch.__version__,
        "machine": f"{platform.machine()} {_cpu()}, {os.cpu_count()} logical CPUs",
        "samples": {"decode_ms": {}, "peak_mib": {}}, "failures": [],
    }  # fmt: skip
    script = str(Path(__file__).resolve())
    for r in revs:  # the kernel build and first imports, untimed
        print(f"building {r['name']} ({r['commit'][:7]})", flush=True)
        job = {"kind": "build", "threads": args.threads}
        _run([sys.executable, script, r["path"], "--worker", json.dumps(job)], environment(Path(r["path"]), 1), RESULT)
    job = {"kind": "decode", "length": args.length, "caches": args.caches, "steps": args.steps,
           "rounds": args.rounds, "threads": args.threads}  # fmt: skip
    workers = {r["commit"]: Worker(script, Path(r["path"]), job, args.threads) for r in revs} if args.reps else {}
    for worker in workers.values():  # the caches are filled before any timing, all revisions at once
        worker.read()
    for rep in range(max(args.reps, memory_reps)):
        order = revs[rep % len(revs) :] + revs[: rep % len(revs)]
        for r in order if rep < args.reps else []:
            start = time.perf_counter()
            result = workers[r["commit"]].measure()
            for cache, row in result.items():
                data["samples"]["decode_ms"].setdefault(cache, {}).setdefault(r["commit"], {})[rep] = row["decode_ms"]
            data.setdefault("decode_paths", {})[r["commit"]] = {c: v["paths"] for c, v in result.items()}
            shown = ", ".join(f"{c} {v['decode_ms']:.2f}" for c, v in result.items())
            print(f"rep {rep} {r['name']}: decode ms/token {shown} ({time.perf_counter() - start:.0f} s)", flush=True)
            save(data, args.out)
        if rep == args.reps - 1:
            for worker in workers.values():
                worker.close()
        cells = [(c, r) for c in (args.memory_caches or args.caches) for r in order] if rep < memory_reps else []
        with ThreadPoolExecutor(max_workers=args.memory_parallel) as pool:
            running = {}
            for cache, r in cells:
                spec = dict(model="smollm2", dtype="float32", device="cpu", threads=args.threads, length=args.length,
                            variant=cache, window=42, steps=args.memory_steps, seed=args.length, chunk=0)  # fmt: skip
                argv = [sys.executable, "-m", "kvpolicy_lab.bench.memory", json.dumps(spec)]
                running[pool.submit(_run, argv, environment(Path(r["path"]), args.threads), MEMORY_RESULT)] = cache, r
            for done in as_completed(running):
                cache, r = running[done]
                try:
                    row = done.result()
                except RuntimeError as exc:
                    print(exc, file=sys.stderr, flush=True)
                    data["failures"].append({"rep": rep, "revision": r["commit"], "kind": cache, "error": str(exc)})
                    continue
                mib = row["peak_bytes"] / 2**20
                data["samples"]["peak_mib"].setdefault(cache, {}).setdefault(r["commit"], {})[rep] = mib
                print(
                    f"rep {rep} {r['name']}: {cache} peak {mib:.1f} MiB ({row['prefill_s']:.0f} s prefill)", flush=True
                )
                save(data, args.out)
    save(data, args.out)
    print(table(data))
    return 1 if data["failures"] else 0


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
