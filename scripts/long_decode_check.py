"""Decode at long contexts on a random layer stack shaped like an 8B model's, for every preset (GPU check).

A stack of ``--layers`` attention layers with ``--heads`` query heads and ``--kv-heads`` kv heads of
``--head-dim`` channels (default 32 / 8 / 128: Llama-3-8B's) holds ``L`` random prompt tokens per layer in
each preset's cache (``--presets``, default: the one-liner ``CompressedCache(policy="log", bits=2)`` and
every shipped preset that quantizes; ``backend="auto"``: ``triton`` on CUDA, or ``--backend``). The prompt
goes in layer by layer as a model's forward feeds it (each layer's prompt demoted once the next layer has
it). Then decode steps (one new token per layer, its update and its attention) run three ways, interleaved
round by round so that each ratio comes from one run:

- ``fused``: the cache's update, then kvpolicy's fused decode attention over its hand-off (the packed
  codes read in place, :mod:`kvpolicy.fused`);
- ``dequantized``: the same cache's update, then ``scaled_dot_product_attention`` over the hand-off, which
  dequantizes the history first (what a cache without a fused path does every step);
- ``dynamic``: ``DynamicCache``'s update, then ``scaled_dot_product_attention`` over the full-precision
  history.

Checks (any failure: exit status 1, and the row says ``FAILED``):

- fused attention equals dequantize-then-attend on every layer, over the same state;
- each quantized part of the first layer attended by the cache's backend equals the ``torch`` backend's
  attention over the same blocks (``out`` and log-sum-exp), at the backend's default precision and, on the
  ``triton`` backend, with float32 products (``precision="ieee"``);
- the ``triton`` backend's min-max quantize and dequantize kernels, at full size, give the ``torch``
  backend's scales and minimums exactly and its codes except at float32 rounding ties (``--backend``
  ``triton`` or ``auto`` on CUDA).

For the longest prompt (``--memory-length``) the peak of ``torch.cuda.max_memory_allocated`` while the
prompt goes in and one decode step runs is measured for each cache against ``DynamicCache``'s (each
layer's incoming prompt keys and values are in both). The results are printed and written as one Markdown
table (``--markdown``).

Usage::

    python scripts/long_decode_check.py --device cuda --lengths 32768 131072 --markdown presets.md
    python scripts/long_decode_check.py --device cpu --lengths 512 --heads 4 --kv-heads 2 --head-dim 64
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kvpolicy import CompressedCache, preset_files
from kvpolicy.fused import _make, attend_parts
from kvpolicy.layer.parts import Part
from kvpolicy.presets import BUILTIN_PRESETS

ONE_LINER = "one-liner"
_FUSED = _make("sdpa")  # kvpolicy's fused decode attention, as a model calls it
_MODULE = types.SimpleNamespace(training=False)  # what the fused function reads of the attention module


def default_presets() -> list[str]:
    """The one-liner and every shipped preset that quantizes (eviction presets hold nothing to decode)."""
    names = []
    for name in sorted(BUILTIN_PRESETS) + preset_files.names():
        action = build(name, "torch").action
        if action.compresses and action.keeps_demoted:
            names.append(name)
    return [ONE_LINER, *names]


def build(name: str, backend: str) -> CompressedCache:
    """The cache of preset ``name`` (or the one-liner) on ``backend``."""
    if name == ONE_LINER:
        return CompressedCache(policy="log", bits=2, backend=backend)
    return CompressedCache.from_preset(name, backend=backend)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@dataclasses.dataclass
class Row:
    """One (preset, length) result."""

    preset: str
    length: int
    backend: str = ""
    ms: dict[str, float] = dataclasses.field(default_factory=dict)
    held: int = 0
    dynamic_held: int = 0
    peak: int | None = None
    dynamic_peak: int | None = None
    fused_err: float = 0.0
    kernel_err: float = 0.0
    failures: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


class Stack:
    """Random prompt and decode tensors of one length for a stack of layers, generated on demand from seeds
    (the same for every cache), and the steps that feed them to a cache."""

    def __init__(self, args: argparse.Namespace, length: int) -> None:
        self.args, self.length = args, length
        self.dtype = getattr(torch, args.dtype)
        self.kv_step = (1, args.kv_heads, 1, args.head_dim)
        self.q_shape = (1, args.heads, 1, args.head_dim)
        self.scale = args.head_dim**-0.5

    def _gen(self, *seed: int) -> torch.Generator:
        return torch.Generator(device=self.args.device).manual_seed(hash((self.length, *seed)) & 0x7FFFFFFF)

    def prompt(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = self._gen(0, layer)
        shape = (1, self.args.kv_heads, self.length, self.args.head_dim)
        keys = torch.randn(shape, generator=g, device=self.args.device, dtype=self.dtype)
        return keys, torch.randn(shape, generator=g, device=self.args.device, dtype=self.dtype)

    def step(self, index: int, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The new key, value and query of decode step ``index`` at ``layer``."""
        g = self._gen(1, index, layer)
        dev, dt = self.args.device, self.dtype
        k = torch.randn(self.kv_step, generator=g, device=dev, dtype=dt)
        v = torch.randn(self.kv_step, generator=g, device=dev, dtype=dt)
        return k, v, torch.randn(self.q_shape, generator=g, device=dev, dtype=dt)

    def fill(self, cache) -> None:
        """The prompt, layer by layer (a compressed cache's prompt demoted as a model's forward would)."""
        for i in range(self.args.layers):
            keys, values = self.prompt(i)
            cache.update(keys, values, i)
            del keys, values
        if isinstance(cache, CompressedCache):
            cache.release_forward()


def _decode_step(cache, attend: Callable, inputs: list) -> None:
    """One decode step through every layer: each layer's update, then its attention."""
    for i, (k, v, q) in enumerate(inputs):
        keys, values = cache.update(k, v, i)
        attend(q, keys, values)


def _fused(q: torch.Tensor, keys, values) -> torch.Tensor:
    return _FUSED(_MODULE, q, keys, values, None)[0]


def _sdpa(scale: float) -> Callable:
    return lambda q, keys, values: F.scaled_dot_product_attention(q, keys, values, scale=scale, enable_gqa=True)


@torch.inference_mode()
def check(args: argparse.Namespace, preset: str, length: int, memory: bool) -> Row:
    """Build the caches of ``preset`` at ``length``, check them and time their decode steps."""
    from transformers import DynamicCache

    row = Row(preset, length)
    stack = Stack(args, length)
    cuda = args.device.startswith("cuda")
    if cuda:
        _sync(args.device)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    cache = build(preset, args.backend)
    stack.fill(cache)
    _decode_step(cache, _fused, [stack.step(-1, i) for i in range(args.layers)])
    if cuda and memory:
        _sync(args.device)
        row.peak = torch.cuda.max_memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    dynamic = DynamicCache()
    stack.fill(dynamic)
    _decode_step(dynamic, _sdpa(stack.scale), [stack.step(-1, i) for i in range(args.layers)])
    if cuda and memory:
        _sync(args.device)
        row.dynamic_peak = torch.cuda.max_memory_allocated() - base
    row.backend = cache.layers[0].engine.backend.name
    row.held = cache.memory_report().total_bytes
    row.dynamic_held = sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in dynamic.layers)
    paths = set(cache.attention_paths().values())
    if paths != {f"fused ({row.backend})"}:
        row.failures.append(f"attention paths {sorted(map(str, paths))}")
    _check_fused(cache, stack, row)
    _check_kernel(cache, stack, row)
    # timing: one decode step of each variant per round, the order rotating
    variants = {
        "fused": (cache, _fused),
        "dequantized": (cache, _sdpa(stack.scale)),
        "dynamic": (dynamic, _sdpa(stack.scale)),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.steps + 1):  # round 0 warms up (compiles)
        inputs = [stack.step(r, i) for i in range(args.layers)]
        for name in names[r % 3 :] + names[: r % 3]:
            target, attend = variants[name]
            _sync(args.device)
            t0 = time.perf_counter()
            _decode_step(target, attend, inputs)
            _sync(args.device)
            if r:
                times[name].append(time.perf_counter() - t0)
    row.ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    del cache, dynamic
    return row


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2e-2


def _check_fused(cache: CompressedCache, stack: Stack, row: Row) -> None:
    """Fused attention against dequantize-then-attend, every layer, the same state."""
    worst = 0.0
    for i, layer in enumerate(cache.layers):
        q = stack.step(-2, i)[2]
        engine = layer.engine
        got = attend_parts(
            q, [*engine.held.store.parts(), Part(engine.keys, engine.values)], stack.scale, engine.held.basis
        )
        k, v = layer.attention_view("ordered")
        ref = F.scaled_dot_product_attention(q, k, v, scale=stack.scale, enable_gqa=True)
        worst = max(worst, float((got.float() - ref.float()).abs().max()))
    row.fused_err = worst
    if worst > _tolerance(stack.dtype):
        row.failures.append(f"fused vs dequantized {worst:.2e} > {_tolerance(stack.dtype):g}")


def _check_kernel(cache: CompressedCache, stack: Stack, row: Row) -> None:
    """Each quantized part of the first layer: the cache's backend against the torch backend."""
    from kvpolicy.backends.torch_backend import TorchBackend

    reference = TorchBackend()
    engine = cache.layers[0].engine
    q = stack.step(-3, 0)[2]
    b, hq, nq, d = q.shape
    hk = stack.args.kv_heads
    query = q.reshape(b, hk, (hq // hk) * nq, d)
    worst = 0.0
    for part in engine.held.store.parts():
        if part.backend is None:
            continue
        q_part = query if engine.held.basis is None else engine.held.basis.map_query(query)
        want_out, want_lse = reference.attend(q_part, part.keys, part.values, stack.scale)
        backend = part.backend
        settings = [None] + (["ieee"] if backend.name == "triton" else [])
        for precision in settings:
            if precision is not None:
                saved, backend.precision = backend.precision, precision
            try:
                out, lse = backend.attend(q_part, part.keys, part.values, stack.scale)
            finally:
                if precision is not None:
                    backend.precision = saved
            err = max(float((out - want_out).abs().max()), float((lse - want_lse).abs().max()))
            # float32 sums in both; products in TF32 on a GPU for 16-bit queries by default
            tol = 1e-3 if precision == "ieee" or stack.dtype == torch.float32 else 2e-2
            worst = max(worst, err)
            if err > tol:
                row.failures.append(f"{backend.name} attend ({precision or 'default'}) vs torch {err:.2e} > {tol:g}")
    row.kernel_err = worst


def check_minmax_kernels(args: argparse.Namespace, length: int, presets: list[str]) -> list[str]:
    """The triton backend's min-max quantize and dequantize kernels against the torch backend at full size, for
    every min-max format of ``presets``; returns the failures."""
    from kvpolicy.backends.torch_backend import TorchBackend
    from kvpolicy.backends.triton_backend import TritonBackend
    from kvpolicy.formats import MinMax
    from kvpolicy.formats.packed import unpack

    triton_backend, reference = TritonBackend(), TorchBackend()
    formats = set()
    for name in presets:
        action = build(name, "torch").action
        for each in [action, *getattr(action, "tiers", ())]:
            for _, fmt in each.roles() if hasattr(each, "roles") else ():
                if isinstance(fmt, MinMax) and fmt.bits in (2, 4, 8):
                    formats.add(dataclasses.replace(fmt, fit="minmax"))  # the fit runs as torch operations
    failures = []
    g = torch.Generator(device=args.device).manual_seed(7)
    shape = (1, args.kv_heads, length - length % 128, args.head_dim)
    x = (torch.randn(shape, generator=g, device=args.device) * 2 + 0.5).to(getattr(torch, args.dtype))
    for fmt in sorted(formats, key=str):
        got, want = triton_backend.quantize(x, fmt), reference.quantize(x, fmt)
        differ = int((unpack(got.codes, fmt.bits) != unpack(want.codes, fmt.bits)).sum())
        equal_meta = torch.equal(got.scales, want.scales) and torch.equal(got.zeros, want.zeros)
        equal_deq = torch.equal(triton_backend.dequantize(got), reference.dequantize(got))
        print(f"  min-max kernels {fmt}: codes differing {differ} of {x.numel()}, metadata equal {equal_meta}, "
              f"dequantize equal {equal_deq}", flush=True)  # fmt: skip
        if differ > x.numel() * 1e-4 or not equal_meta or not equal_deq:
            failures.append(f"min-max kernels {fmt}")
    return failures


def markdown(rows: list[Row], args: argparse.Namespace, device: str, extra_failures: list[str]) -> str:
    """The results as one Markdown table, with the device and the command."""
    lines = [
        f"Decode on a random {args.layers}-layer stack of {args.heads} query heads, {args.kv_heads} kv heads, head "
        f"dim {args.head_dim}, {args.dtype}; {device}; torch {torch.__version__}. Times: median of {args.steps} "
        "interleaved decode steps (update and attention of every layer). Command: `python "
        f"scripts/long_decode_check.py {' '.join(sys.argv[1:])}`.",
        "",
        "| preset | tokens | backend | fused ms | dequantized ms | DynamicCache ms | fused / DynamicCache | "
        "fused / dequantized | held MiB (DynamicCache) | peak MiB (DynamicCache) | max err fused, kernel | check |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        peak = "" if r.peak is None else f"{r.peak / 2**20:,.0f} ({r.dynamic_peak / 2**20:,.0f})"
        lines.append(
            f"| {r.preset} | {r.length:,} | {r.backend} | {r.ms['fused']:.2f} | {r.ms['dequantized']:.2f} | "
            f"{r.ms['dynamic']:.2f} | {r.ms['fused'] / r.ms['dynamic']:.2f} | "
            f"{r.ms['fused'] / r.ms['dequantized']:.2f} | {r.held / 2**20:,.1f} ({r.dynamic_held / 2**20:,.1f}) | "
            f"{peak} | {r.fused_err:.1e}, {r.kernel_err:.1e} | {'ok' if r.ok else 'FAILED: ' + '; '.join(r.failures)} |"
        )
    for failure in extra_failures:
        lines.append(f"\nFAILED: {failure}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--steps", type=int, default=5, help="timed decode steps of each variant")
    parser.add_argument("--presets", nargs="+", default=None, help="default: the one-liner and every shipped preset "
                        "that quantizes")  # fmt: skip
    parser.add_argument("--backend", default="auto", help="the caches' backend (default auto)")
    parser.add_argument("--memory-length", type=int, default=None, help="default: the longest of --lengths")
    parser.add_argument("--markdown", type=Path, default=None, help="write the table here")
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if any(n < 2 for n in args.lengths) or args.steps < 1 or args.layers < 1:
        parser.error("--lengths must be >= 2, --steps and --layers >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("long_decode_check: no CUDA device visible; pass --device cpu for the reduced CPU run")
        return 0
    presets = default_presets() if args.presets is None else args.presets
    memory_length = max(args.lengths) if args.memory_length is None else args.memory_length
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    rows, extra = [], []
    for length in args.lengths:
        for preset in presets:
            t0 = time.perf_counter()
            row = check(args, preset, length, memory=length == memory_length)
            rows.append(row)
            ms = row.ms
            print(
                f"{length:>7} {preset:<20} {row.backend:<6} fused {ms['fused']:8.3f} ms  dequantized "
                f"{ms['dequantized']:8.3f} ms  dynamic {ms['dynamic']:8.3f} ms  fused/dynamic "
                f"{ms['fused'] / ms['dynamic']:5.2f}  fused/dequantized {ms['fused'] / ms['dequantized']:5.2f}  "
                f"held {row.held / 2**20:8.1f} MiB (dynamic {row.dynamic_held / 2**20:8.1f})"
                + ("" if row.peak is None else
                   f"  peak MiB {row.peak / 2**20:.1f} (dynamic {row.dynamic_peak / 2**20:.1f})")
                + f"  max err fused {row.fused_err:.2e} kernel {row.kernel_err:.2e}"
                + f"  [{time.perf_counter() - t0:.0f} s]  "
                + ("ok" if row.ok else "FAILED: " + "; ".join(row.failures)),
                flush=True,
            )  # fmt: skip
    triton_used = any(r.backend == "triton" for r in rows)
    if triton_used:
        extra = check_minmax_kernels(args, max(args.lengths), presets)
    table = markdown(rows, args, device, extra)
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table)
    print(table)
    return 0 if all(r.ok for r in rows) and not extra else 1


if __name__ == "__main__":
    sys.exit(main())
