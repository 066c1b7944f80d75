"""``kvpolicy bench memory``: the peak memory of a prompt, one process per cache, as users measure it.

For each prompt length and each cache variant a fresh Python process is started. It loads the model,
runs a short warm-up forward (so one-off allocations of the runtime, thread pools and kernels are not
counted), takes the memory level, then prefills a prompt of random tokens through the cache and decodes
``--steps`` tokens greedily. It reports:

- ``peak``: the process's high-water mark above the level after the model was loaded and warmed up. On
  CPU this is the resident set (``VmHWM`` of ``/proc/self/status``, reset before the prompt where Linux
  allows it, else ``getrusage``'s ``ru_maxrss``); on CUDA it is ``torch.cuda.max_memory_allocated``
  above ``torch.cuda.memory_allocated`` after the warm-up. It includes the model's own forward
  temporaries, as a user sees them.
- ``held``: the bytes the cache holds after the last step (``memory_report`` for kvpolicy caches,
  :func:`kvpolicy_lab.eval.caches.held_bytes` for the others).
- ``prefill``, ``first step`` and ``median step``: wall times of the prompt's forward (all its chunks
  with ``--chunk``), of the first decode step after it and the median of the later steps.
- ratios of the peak (and of prefill plus first step) against ``dynamic`` and against the first
  transformers ``QuantizedCache`` variant (``hf-<backend>-<bits>``) of the same length.

With ``--chunk C`` every cache is prefilled in chunks of ``C`` tokens (:func:`kvpolicy.prefill.chunked_prefill`,
what ``generate(..., prefill_chunk_size=C)`` does), ``DynamicCache`` and ``QuantizedCache`` included.

Cache variants are those of ``kvpolicy bench decode`` (``dynamic``, ``one-liner``, ``preset:<name>``,
``hf-quanto-2``, ``<policy>-<bits>-<backend>-<layout>-<fused|mat>``), plus ``none``: the same prompt
with no cache at all (``use_cache=False``, no decode steps), the floor of the model's own temporaries.

The times are read around single calls by hand, not by ``torch.utils.benchmark.Timer`` (which ``kvpolicy
bench decode`` uses): each span here happens once, in the order a user meets it (a prompt into an empty
cache, then the first step after it, cold), and a Timer's untimed warm-up calls would both change what the
first step measures and add to the memory peak this benchmark is about.

Where the platform has neither ``/proc/self/status`` nor ``getrusage`` (Windows) and the device is not
CUDA, the peak is reported as unavailable with a message; the other columns are still measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvpolicy.errors import ConfigError
from kvpolicy_lab.bench.decode import DTYPES, Variant, _variant, check_model, load, model_options

HELP = "peak memory above the loaded model, bytes held, prefill and decode-step times: one process per cache"

DEFAULT_VARIANTS = ("none", "dynamic", "hf-quanto-2", "one-liner", "preset:kvpolicy-3bit", "preset:kvpolicy-3.5bit")
#: the line prefix a worker process writes its JSON result after
RESULT_MARK = "KVPOLICY-MEMORY-RESULT "
#: tokens of the warm-up forward each worker runs before it takes the memory level
WARMUP_TOKENS = 16


# ---------------------------------------------------------------------- reading the high-water mark
def peak_source(device: str) -> str | None:
    """How the peak is read on ``device`` here: ``"cuda"``, ``"proc"`` (``/proc/self/status``),
    ``"getrusage"``, or ``None`` where none is available."""
    if device.startswith("cuda"):
        return "cuda"
    if Path("/proc/self/status").is_file():
        return "proc"
    try:
        import resource  # noqa: F401  (absent on Windows)
    except ImportError:
        return None
    return "getrusage"


def unavailable_message(device: str) -> str:
    """The message printed where :func:`peak_source` finds nothing."""
    return (
        f"peak memory is unavailable on this platform ({platform.system() or 'unknown'}, device {device!r}): "
        "it needs /proc/self/status or the resource module's getrusage (Linux, macOS) or a CUDA device; "
        "the peak column is reported as n/a, the other columns are measured"
    )


def _proc_status(field_name: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmHWM``, ``VmRSS``), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field_name} field")


def _reset_hwm() -> bool:
    """Reset the process's resident-set high-water mark to its current level (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _maxrss() -> int:
    """``getrusage``'s ``ru_maxrss`` in bytes (kilobytes on Linux, bytes on macOS)."""
    import resource

    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(value) if sys.platform == "darwin" else int(value) * 1024


class PeakMeter:
    """The high-water mark of this process above a level taken by :meth:`start`.

    Parameters
    ----------
    source : str or None
        What :func:`peak_source` returned; ``None`` makes :meth:`peak` return ``None``.
    """

    def __init__(self, source: str | None) -> None:
        self.source = source
        self.level = 0
        self.reset = False

    def start(self) -> None:
        """Take the level the peak is measured above (and reset the high-water mark where possible)."""
        if self.source == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.level = torch.cuda.memory_allocated()
        elif self.source == "proc":
            self.reset = _reset_hwm()
            self.level = _proc_status("VmRSS")
        elif self.source == "getrusage":
            self.level = _maxrss()  # the high-water mark cannot be reset: measure above it

    def peak(self) -> int | None:
        """Bytes of the high-water mark above the level (``None`` where no source is available)."""
        if self.source == "cuda":
            torch.cuda.synchronize()
            return max(0, torch.cuda.max_memory_allocated() - self.level)
        if self.source == "proc":
            return max(0, _proc_status("VmHWM") - self.level)
        if self.source == "getrusage":
            return max(0, _maxrss() - self.level)
        return None


# ---------------------------------------------------------------------- counted tensor bytes
def allocation_peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn()`` and count the tensor bytes it allocates: the peak of the bytes allocated during the
    call and still alive, from torch's memory profiler (deterministic, unlike the resident set).

    Parameters
    ----------
    fn : callable
        Called once with no arguments.

    Returns
    -------
    result, peak : (Any, int)
        What ``fn`` returned, and the largest number of bytes held at once by tensors created
        during the call (tensors that existed before it are not counted).
    """
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as p:
        result = fn()
    live = peak = 0
    created: set[Any] = set()  # tensors freed during the call but made before it do not offset new ones
    for _, action, (key, _version), size in p._memory_profile().timeline:
        if action == Action.CREATE:
            created.add(key)
            live += size
            peak = max(peak, live)
        elif action == Action.DESTROY and key in created:
            live -= size
    return result, peak


# ---------------------------------------------------------------------- one measurement (in its own process)
@dataclass
class Row:
    """One measured cell: a cache at a prompt length."""

    model: str
    dtype: str
    device: str
    threads: int
    length: int
    variant: str
    peak_bytes: int | None
    held_bytes: int
    prefill_s: float
    first_step_s: float
    median_step_s: float
    peak_source: str = ""
    #: tokens per prefill chunk (0: the prompt in one forward)
    chunk: int = 0
    peak_x_dynamic: float = float("nan")
    peak_x_quantized: float = float("nan")
    #: (prefill + first step) over dynamic's
    ttft_x_dynamic: float = float("nan")


def _load_model(model: str, dtype: torch.dtype, device: str, online: bool = False) -> torch.nn.Module:
    """The model ``--model`` names, as ``kvpolicy bench decode`` resolves it (:func:`kvpolicy_lab.bench.decode.load`:
    a local model directory is loaded without a tokenizer, the prompts being random token ids)."""
    return load(model, dtype, device, online)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def measure(spec: dict[str, Any]) -> Row:
    """Measure one cache at one prompt length in this process (the worker side of :func:`run`).

    Parameters
    ----------
    spec : dict
        ``model``, ``dtype`` (a key of ``DTYPES``), ``device``, ``threads`` (int or None), ``length``,
        ``variant`` (a cache variant name), ``window``, ``steps`` (decode steps, >= 1), ``seed``, and
        optionally ``chunk`` (tokens per prefill chunk; 0 or absent: one forward) and ``online`` (a hub
        model may be fetched).

    Returns
    -------
    Row
        The measured cell (ratios left unset).
    """
    from kvpolicy.modes import decode_mode
    from kvpolicy.prefill import chunked_prefill
    from kvpolicy_lab.eval.caches import held_bytes
    from kvpolicy_lab.eval.metrics import last_only

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    device, name, length = spec["device"], spec["variant"], int(spec["length"])
    variant = None if name == "none" else Variant.parse(name)
    model = _load_model(spec["model"], DTYPES[spec["dtype"]], device, bool(spec.get("online")))
    mode = None if variant is None else "fused" if variant.fused else "scores"
    with nullcontext() if mode is None else decode_mode(model, mode):
        vocab = model.config.vocab_size
        ids = torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(int(spec["seed"])))
        ids = ids.to(device)
        cache = None if variant is None else variant.build(model.config, int(spec["window"]))
        warm = None if variant is None else variant.build(model.config, int(spec["window"]))
        model(ids[:, :WARMUP_TOKENS], cache=warm, use_cache=warm is not None, **last_only(model))
        del warm
        source = peak_source(device)
        meter = PeakMeter(source)
        meter.start()
        _sync(device)
        t0 = time.perf_counter()
        chunk = int(spec.get("chunk") or 0)
        if chunk and cache is not None:
            out = chunked_prefill(model, ids, cache, chunk, **last_only(model))
        else:
            out = model(ids, cache=cache, use_cache=cache is not None, **last_only(model))
        _sync(device)
        prefill = time.perf_counter() - t0
        token = out.logits[:, -1:].argmax(-1)
        del out
        steps: list[float] = []
        for _ in range(int(spec["steps"]) if cache is not None else 0):
            t0 = time.perf_counter()
            token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            _sync(device)
            steps.append(time.perf_counter() - t0)
        peak = meter.peak()
    later = steps[1:] or steps
    return Row(
        model=spec["model"], dtype=spec["dtype"], device=device, threads=torch.get_num_threads(), length=length,
        variant=name, peak_bytes=peak, held_bytes=held_bytes(cache) if cache is not None else 0,
        prefill_s=prefill, first_step_s=steps[0] if steps else float("nan"),
        median_step_s=statistics.median(later) if later else float("nan"),
        peak_source=(source or "unavailable") + ("" if source != "proc" or meter.reset else " (not reset)"),
        chunk=chunk if cache is not None else 0,
    )  # fmt: skip


def _spawn(spec: dict[str, Any]) -> Row:
    """Run :func:`measure` in a fresh Python process and read its row back."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvpolicy_lab.bench.memory", json.dumps(spec)],
        capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(
            f"the worker process for cache {spec['variant']!r} at {spec['length']} tokens failed "
            f"(exit status {proc.returncode}):\n{tail}"
        )
    return Row(**json.loads(lines[-1].removeprefix(RESULT_MARK)))


def ratios(rows: list[Row]) -> None:
    """Fill each row's ratios against ``dynamic`` and the first ``hf-*`` variant of its length."""
    for length in {r.length for r in rows}:
        same = [r for r in rows if r.length == length]
        dyn = next((r for r in same if r.variant == "dynamic"), None)
        quant = next((r for r in same if r.variant.startswith("hf-")), None)
        for r in same:
            if r.peak_bytes is not None:
                if dyn is not None and dyn.peak_bytes:
                    r.peak_x_dynamic = r.peak_bytes / dyn.peak_bytes
                if quant is not None and quant.peak_bytes:
                    r.peak_x_quantized = r.peak_bytes / quant.peak_bytes
            if dyn is not None and r.variant != "none":
                r.ttft_x_dynamic = (r.prefill_s + r.first_step_s) / (dyn.prefill_s + dyn.first_step_s)


# ---------------------------------------------------------------------- output
def table(rows: list[Row], quantized: str | None) -> str:
    """The rows as a fixed-width table (MiB, seconds, milliseconds)."""
    q = f"x {quantized}" if quantized else "x hf"

    def mib(value: int | None) -> str:
        return "n/a" if value is None else f"{value / 2**20:.1f}"

    head = (
        f"{'length':>7} {'cache':<26} {'peak MiB':>9} {'x dynamic':>9} {q:>13} {'held MiB':>9} "
        f"{'prefill s':>9} {'first ms':>9} {'median ms':>9} {'ttft x dyn':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.length:>7} {r.variant:<26} {mib(r.peak_bytes):>9} {r.peak_x_dynamic:>9.2f} "
            f"{r.peak_x_quantized:>13.2f} "
            f"{r.held_bytes / 2**20:>9.1f} {r.prefill_s:>9.2f} {r.first_step_s * 1e3:>9.1f} "
            f"{r.median_step_s * 1e3:>9.1f} {r.ttft_x_dynamic:>10.2f}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------- CLI
def _cache(text: str) -> str:
    """A cache variant of ``kvpolicy bench decode`` or ``none``."""
    return text if text == "none" else _variant(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvpolicy bench memory``; each value is checked at parse time."""
    from kvpolicy.commands._parser import add_list
    from kvpolicy.commands._types import positive_int, token_count
    from kvpolicy_lab.commands._types import non_negative_int, out_dir

    model_options(parser)
    add_list(parser, "--lengths", token_count, default=[8192, 16384], metavar="TOKENS",
             help="prompt lengths (e.g. 8k 16384)")  # fmt: skip
    add_list(parser, "--caches", _cache, default=list(DEFAULT_VARIANTS), metavar="CACHE",
             help="cache variants (those of kvpolicy bench decode, plus none: no cache)")  # fmt: skip
    parser.add_argument("--steps", type=positive_int, default=6, help="decode steps after the prompt")
    parser.add_argument("--chunk", type=positive_int, default=None,
                        help="prefill every cache in chunks of this many tokens (default: one forward)")  # fmt: skip
    parser.add_argument("--window", type=positive_int, default=42, help="policy window of <policy>-... variants")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads in each process (default: torch's choice)")  # fmt: skip
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the random prompt")
    parser.add_argument("--out", type=out_dir, default=Path("bench-memory"), metavar="DIR",
                        help="directory for memory.json")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    check_model(args)
    for name in args.caches:  # construct once: an unavailable backend fails before any process starts
        if name != "none" and Variant.parse(name).kind in ("kv", "one-liner", "preset"):
            Variant.parse(name).build(None, args.window)
    source = peak_source(args.device)
    if source is None:
        print(unavailable_message(args.device), file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    failed = []
    for length in args.lengths:
        for name in args.caches:
            spec = dict(model=args.model, dtype=args.dtype, device=args.device, threads=args.threads, length=length,
                        variant=name, window=args.window, steps=args.steps, seed=args.seed + length,
                        chunk=args.chunk or 0, online=args.online)  # fmt: skip
            try:
                row = _spawn(spec)
            except RuntimeError as exc:
                print(exc, file=sys.stderr, flush=True)
                failed.append((length, name))
                continue
            rows.append(row)
            peak = "n/a" if row.peak_bytes is None else f"{row.peak_bytes / 2**20:.1f} MiB"
            print(f"  {length:>6} {name:<26} peak {peak:>12}  held {row.held_bytes / 2**20:8.1f} MiB", flush=True)
    ratios(rows)
    quantized = next((n for n in args.caches if n.startswith("hf-")), None)
    print(table(rows, quantized))
    meta = dict(model=args.model, dtype=args.dtype, device=args.device, threads=args.threads, steps=args.steps,
                chunk=args.chunk or 0,
                torch=torch.__version__, machine=platform.processor() or platform.machine(),
                peak_source=source or "unavailable")  # fmt: skip
    (args.out / "memory.json").write_text(json.dumps(dict(meta=meta, rows=[asdict(r) for r in rows]), indent=1))
    print(f"wrote {args.out / 'memory.json'}")
    if failed:
        print(f"{len(failed)} measurement(s) failed: {failed}", file=sys.stderr)
        return 1
    return 0


def _worker(argv: list[str]) -> int:
    """Entry point of a worker process: ``python -m kvpolicy_lab.bench.memory '<spec JSON>'``."""
    if len(argv) != 1:
        print("usage: python -m kvpolicy_lab.bench.memory '<spec JSON>' (started by kvpolicy bench memory)")
        return 2
    try:
        row = measure(json.loads(argv[0]))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(RESULT_MARK + json.dumps(asdict(row)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
