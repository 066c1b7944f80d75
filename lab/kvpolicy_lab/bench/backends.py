"""``kvpolicy bench backends``: quantize / dequantize throughput of every available backend.

Throughput is GB/s of the 16-bit input (``numel * 2`` bytes, whatever the dtype measured), next to a
plain copy (``clone``) of the same tensor. Everything runs in one process, timed by
``torch.utils.benchmark.Timer`` (:func:`kvpolicy_lab.bench.timing.interleaved`) on torch's current
thread count; repetitions are interleaved (each round times every call once: the copy, and each
backend's quantize and dequantize, in an order that rotates from round to round), each timed call
follows two untimed ones, and the median is reported, so machine noise hits all rows alike and the
ratios to ``clone`` are the numbers to compare. ``mean |err|`` is the
mean absolute reconstruction error on the benchmark tensor (standard normal values).
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from kvpolicy import registry
from kvpolicy.errors import ConfigError
from kvpolicy.formats import MinMax
from kvpolicy_lab.bench.timing import device_clock, interleaved

HELP = "quantize/dequantize throughput (GB/s of 16-bit input) per backend, next to a plain copy"

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvpolicy bench backends``; each value is checked at parse time."""
    from kvpolicy.commands._parser import add_list
    from kvpolicy.commands._types import DTYPES, choice_of, dtype_name, list_item, positive_int
    from kvpolicy_lab.commands._types import available_device

    parser.add_argument("--shape", nargs="+", type=list_item(positive_int, "--shape"), action=_Shape,
                        default=(1, 8, 4096, 128), metavar="N",
                        help="the benchmark tensor: four integers batch kv_heads tokens head_dim")  # fmt: skip
    parser.add_argument("--bits", type=positive_int, default=2, help="code width")
    parser.add_argument("--group-size", type=positive_int, default=64, help="elements per group")
    parser.add_argument("--axis", choices=("channel", "token"), default="channel", help="grouping axis")
    parser.add_argument("--dtype", type=dtype_name, choices=DTYPES, default="float16", help="input dtype")
    parser.add_argument("--device", type=available_device, default="cpu", help="torch device: cpu, cuda, cuda:N")
    parser.add_argument("--repeats", type=positive_int, default=7, help="interleaved repetitions; the median is shown")
    add_list(parser, "--backends", choice_of("backend", _registered_backends), metavar="BACKEND",
             help="backends to time (default: every registered one)")  # fmt: skip


def _registered_backends() -> list[str]:
    from kvpolicy import registry

    return registry.names("backends")


class _Shape(argparse.Action):
    """``--shape B H T D``: exactly four integers, stored as a tuple."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: list[int],
        option_string: str | None = None,
    ) -> None:
        if len(values) != 4:
            raise argparse.ArgumentError(
                self, f"must be four integers batch kv_heads tokens head_dim (e.g. 1 8 4096 128); got {len(values)}"
            )
        setattr(namespace, self.dest, tuple(values))


def _check_grouping(args: argparse.Namespace) -> None:
    """Refuse a ``--group-size`` that does not split the grouped dimension of ``--shape`` into whole groups.

    No backend can quantize such a tensor (``axis="token"`` groups the ``head_dim`` channels of each
    token, ``axis="channel"`` the tokens of each channel), so the run stops before any backend is built.
    """
    tokens, head_dim = args.shape[2], args.shape[3]
    dim, size = ("head_dim", head_dim) if args.axis == "token" else ("tokens", tokens)
    if size % args.group_size:
        divisors = [g for g in (128, 64, 32, 16, 8, 4) if size % g == 0]
        hint = f"a divisor of {size} such as {divisors[0]}" if divisors else f"a divisor of {size}"
        shape = " ".join(str(d) for d in args.shape)
        raise ConfigError(
            f"--group-size {args.group_size} does not divide the {dim} of --shape {shape} ({dim}={size}; --axis "
            f"{args.axis} groups the {dim} {'of each token' if args.axis == 'token' else 'of each channel'}); "
            f"use {hint}, or another --shape"
        )


def _available(names: list[str], x: torch.Tensor, args: argparse.Namespace) -> tuple[dict, dict, dict[str, str]]:
    """Backends that can run this configuration with their first blocks of ``x``, and why each other one is
    skipped: refused by its capabilities, or by its library when quantizing (a refusal a backend's
    capabilities do not describe is reported the same way, with the library's message)."""
    ready, blocks, skipped = {}, {}, {}
    for name in names:
        try:
            be = registry.get("backends", name)()
            be.check(bits=args.bits, group_size=args.group_size, axis=args.axis)
            be.check_tensor(x)
            fmt = MinMax(args.bits, args.group_size, args.axis)
        except ConfigError as exc:  # includes a missing optional package
            skipped[name] = str(exc)
            continue
        try:
            blocks[name] = be.quantize(x, fmt)
        except (ValueError, RuntimeError, NotImplementedError) as exc:
            text = str(exc).strip().splitlines()
            skipped[name] = (
                f"backend {name!r} refused bits={args.bits} group_size={args.group_size} axis={args.axis!r} on "
                f"shape {tuple(x.shape)} {x.dtype}: {type(exc).__name__}: {text[0] if text else ''}"
            )
            continue
        ready[name] = be
    return ready, blocks, skipped


def run(args: argparse.Namespace) -> int:
    shape = args.shape
    _check_grouping(args)
    device = torch.device(args.device)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=_DTYPES[args.dtype])
    names = args.backends or registry.names("backends")
    backends, blocks, skipped = _available(names, x, args)
    fmt = MinMax(args.bits, args.group_size, args.axis) if backends else None
    calls = {"clone": x.clone}
    for name, be in backends.items():
        calls[f"{name}.q"] = partial(be.quantize, x, fmt)
        calls[f"{name}.dq"] = partial(be.dequantize, blocks[name])
    measured = interleaved(calls, number=1, repeats=args.repeats, clock=device_clock(device))
    gb = x.numel() * 2 / 1e9
    med = {k: m.median for k, m in measured.items()}
    clone = gb / med["clone"]
    print(
        f"kvpolicy bench backends: shape={shape} dtype={args.dtype} device={device.type} bits={args.bits} "
        f"group_size={args.group_size} axis={args.axis}; median of {args.repeats} interleaved repeats; "
        "GB/s of 16-bit input"
    )
    print(
        f"{'backend':<10}{'quantize GB/s':>15}{'dequant GB/s':>14}{'q / clone':>11}{'dq / clone':>12}"
        f"{'bits/elem':>11}{'mean |err|':>12}"
    )
    print(f"{'clone':<10}{clone:>15.3g}{clone:>14.3g}{1.0:>11.3g}{1.0:>12.3g}{8 * x.element_size():>11.2f}{0.0:>12.3g}")
    for name in backends:
        q_gbs, dq_gbs = gb / med[f"{name}.q"], gb / med[f"{name}.dq"]
        bpe = 8 * sum(blocks[name].nbytes().values()) / x.numel()
        err = float((backends[name].dequantize(blocks[name]).float() - x.float()).abs().mean())
        print(
            f"{name:<10}{q_gbs:>15.3g}{dq_gbs:>14.3g}{q_gbs / clone:>11.3g}{dq_gbs / clone:>12.3g}"
            f"{bpe:>11.2f}{err:>12.4g}"
        )
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    return 0
