"""Variants of the ``kvpolicy-3bit`` composition on the calibration texts (docs/explanation/quantization.md).

Each probe is the preset's composition (log W = 4, a middle tier of centred 4-bit codebook keys and
values kept by the log rule at W′ = 32, 3-bit centred keys and 2-bit values below, Hadamard) with one
change. Some changes are not options of the library, because they lost: the probe then patches the
codebook quantizer (:func:`kvpolicy.formats.codebook.quantize`) or the quantized store for its run
only. Scored like ``kvpolicy tune``'s calibration stage: SmolLM2-135M fp32, ``--context`` tokens of
three calibration files (:data:`~kvpolicy_lab.eval.tasks.CALIBRATION_FILES`, which no published number is
measured on) then ``--tokens`` teacher-forced tokens, next-token KL against ``DynamicCache`` (mean ±
standard error over tokens), top-1 agreement, bits per element with full-precision tensors at 16 bits.

Probes:

- ``preset``: the composition itself;
- ``value-centre``: values centred like keys (``key_centre``) on their stream's first block;
- ``sinks-value-centre``, ``sinks``: 4 sink tokens at full precision, with and without it;
- ``ls-scale-values``, ``ls-scale-keys``: the least-squares scale ``⟨x, C⟩ / ‖C‖²`` (the smallest
  squared error for the chosen codes) instead of the norm-preserving ``‖x‖ / ‖C‖``;
- ``lloyd-values``, ``lloyd-both``: two rounds of re-choosing the codes for the least-squares scale
  and re-fitting it;
- ``scale-levels-256``, ``scale-levels-64``: scales rounded to a log2 grid of 256 or 64 levels over
  float16's 30 octaves (8- or 6-bit scales over that range); ``scale-step-32``, ``scale-step-64``: a
  grid of 1/32 or 1/64 octave (8 bits then span 8 or 4 octaves). The bits shown are still those of
  16-bit scales: 8-bit ones would save 0.125 bits per element;
- ``bottom-k3v4``, ``bottom-k4v2``, ``bottom-k4v4``: the bottom tier's widths, to split the error
  between keys and values;
- ``bottom-k3v3``, ``bottom-k4v3``, ``w8-x64-bottom-k3v3`` (W = 8, W′ = 64) against the presets
  ``kvpolicy-3.5bit`` and ``kvpolicy-4bit``: wider bottom tiers for larger budgets;
- ``minmax-k4v4-w4``, ``minmax-k4-codebook-v4-w4``, ``minmax-k4-codebook-v4-w8``,
  ``minmax-token-k4-codebook-v4-w4``, ``minmax-k4-codebook-v3-w4``, ``minmax-k4v3-w4``: not the
  preset's family; one tier of 4-bit min-max keys (per channel, or ``token``), 3- or 4-bit values
  (min-max or codebook), log ``W`` = 4 or 8 and Hadamard, for issue 11's 4.5-bit budget.

``--scale-range`` also prints the range of the log2 scales the composition stores on the first text.

Usage::

    python scripts/codebook_probes.py --threads 2 --scale-range
    python scripts/codebook_probes.py --probes preset value-centre
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from quantizer_quality import setup  # scripts/: the model, texts and references, built the same way

import kvpolicy.actions.quantize as quantize_mod
import kvpolicy.formats.codebook as codebook
from kvpolicy import CompressedCache, LogWindow, Quantize, Tiered
from kvpolicy.transforms import Hadamard
from kvpolicy_lab.eval.caches import baseline_bytes, held_bytes
from kvpolicy_lab.eval.metrics import next_token_kl, teacher_forced_logits
from kvpolicy_lab.eval.tasks import CALIBRATION_FILES


def composition(
    key_bits: int = 3, value_bits: int = 2, sinks: int = 0, window: int = 4, middle: int = 32
) -> Callable[[], CompressedCache]:
    """The ``kvpolicy-3bit`` composition with the bottom tier's widths, sinks and windows given."""
    tiers = [
        Quantize(bits=4, scheme="codebook", key_centre=True),
        Quantize(key_bits=key_bits, value_bits=value_bits, scheme="codebook", key_centre=True),
    ]
    extra = {"sinks": sinks} if sinks else {}
    action = Tiered(tiers=tiers, keep=[LogWindow(window=middle)])
    return lambda: CompressedCache(policy=LogWindow(window=window), action=action, transform=Hadamard(0), **extra)


def one_tier(window: int, **quantize: Any) -> Callable[[], CompressedCache]:
    """Not the preset's family: log W = ``window``, one ``Quantize(**quantize)`` tier, Hadamard. Min-max
    keys are min-max in groups of 64, as they were probed (whatever the defaults)."""
    if "key_scheme" not in quantize and "scheme" not in quantize:
        quantize = {"key_fit": "minmax", "key_group_size": 64, **quantize}
    return lambda: CompressedCache(policy=LogWindow(window=window), action=Quantize(**quantize), transform=Hadamard(0))


@contextlib.contextmanager
def centred_values() -> Iterator[None]:
    """Codebook values centred on their stream's first block, as ``key_centre`` does for keys."""
    original = quantize_mod.QuantizedStore.__init__

    def init(self: Any, action: Any, backend: Any, layer_idx: int) -> None:
        original(self, action, backend, layer_idx)
        if action.values.name == "codebook":
            self.v.centre = True

    quantize_mod.QuantizedStore.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        quantize_mod.QuantizedStore.__init__ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def patched_scales(roles: set[str], lloyd: int = 0, log_step: float = 0.0) -> Iterator[None]:
    """The codebook quantizer of ``roles`` (``"k"``, ``"v"``) with least-squares scales (``lloyd``
    rounds of re-choosing codes and re-fitting), or, with ``log_step``, its scales rounded to a log2
    grid of that step (octaves)."""
    quantize, stream_quantize, store_init = codebook.quantize, quantize_mod.QuantizedStream._quantize, \
        quantize_mod.QuantizedStore.__init__  # fmt: skip
    current: dict[str, str | None] = {"role": None}

    def init(self: Any, action: Any, backend: Any, layer_idx: int) -> None:
        store_init(self, action, backend, layer_idx)
        self.k.role, self.v.role = "k", "v"

    def tagged(self: Any, x: torch.Tensor) -> Any:
        current["role"] = getattr(self, "role", None)
        return stream_quantize(self, x)

    def probe(x: torch.Tensor, bits: int, mdtype: torch.dtype, backend: str = "torch", remedy: Any = None,
              centre: torch.Tensor | None = None) -> codebook.CodebookTensor:  # fmt: skip
        out = quantize(x, bits, mdtype, backend, remedy, centre)
        if current["role"] not in roles:
            return out
        if log_step:
            scales = torch.exp2(torch.round(torch.log2(out.scales.float()) / log_step) * log_step)
            return codebook.CodebookTensor(out.codes, scales.to(out.scales.dtype), bits, out.shape, out.dtype,
                                           out.centre)  # fmt: skip
        from kvpolicy.backends.torch_backend import pack

        table, edges = codebook._tables(bits, str(x.device))
        xf = x.float() - (0 if out.centre is None else out.centre.float())
        c = codebook.unit_vectors(out)
        s = (xf * c).sum(-1) / (c * c).sum(-1)
        codes = None
        for _ in range(lloyd):
            codes = torch.bucketize(xf / s.unsqueeze(-1).clamp_min(1e-30), edges, right=True).to(torch.uint8)
            c = table[codes.long()]
            s = (xf * c).sum(-1) / (c * c).sum(-1).clamp_min(1e-30)
        packed = out.codes if codes is None else pack(codes, bits).contiguous()
        return codebook.CodebookTensor(packed, s.to(mdtype).contiguous(), bits, out.shape, out.dtype, out.centre)

    quantize_mod.QuantizedStore.__init__ = init  # type: ignore[method-assign]
    quantize_mod.QuantizedStream._quantize = tagged  # type: ignore[method-assign]
    codebook.quantize = probe  # type: ignore[assignment]
    try:
        yield
    finally:
        quantize_mod.QuantizedStore.__init__ = store_init  # type: ignore[method-assign]
        quantize_mod.QuantizedStream._quantize = stream_quantize  # type: ignore[method-assign]
        codebook.quantize = quantize  # type: ignore[assignment]


#: name -> (cache factory, context manager factory)
PROBES: dict[str, tuple[Callable[[], CompressedCache], Callable[[], Any]]] = {
    "preset": (composition(), contextlib.nullcontext),
    "value-centre": (composition(), centred_values),
    "sinks-value-centre": (composition(sinks=4), centred_values),
    "sinks": (composition(sinks=4), contextlib.nullcontext),
    "ls-scale-values": (composition(), lambda: patched_scales({"v"})),
    "ls-scale-keys": (composition(), lambda: patched_scales({"k"})),
    "lloyd-values": (composition(), lambda: patched_scales({"v"}, lloyd=2)),
    "lloyd-both": (composition(), lambda: patched_scales({"k", "v"}, lloyd=2)),
    "scale-levels-256": (composition(), lambda: patched_scales({"k", "v"}, log_step=30 / 256)),
    "scale-levels-64": (composition(), lambda: patched_scales({"k", "v"}, log_step=30 / 64)),
    "scale-step-32": (composition(), lambda: patched_scales({"k", "v"}, log_step=1 / 32)),
    "scale-step-64": (composition(), lambda: patched_scales({"k", "v"}, log_step=1 / 64)),
    "bottom-k3v4": (composition(value_bits=4), contextlib.nullcontext),
    "bottom-k4v2": (composition(key_bits=4), contextlib.nullcontext),
    "bottom-k4v4": (composition(key_bits=4, value_bits=4), contextlib.nullcontext),
    # wider bottom tiers against the 3.5- and 4-bit presets
    "bottom-k3v3": (composition(value_bits=3), contextlib.nullcontext),
    "bottom-k4v3": (composition(key_bits=4, value_bits=3), contextlib.nullcontext),
    "w8-x64-bottom-k3v3": (composition(value_bits=3, window=8, middle=64), contextlib.nullcontext),
    # issue 11's 4.5-bit budget: one tier of 4-bit min-max keys (rotated) with a small full-precision window
    "minmax-k4v4-w4": (one_tier(4, bits=4), contextlib.nullcontext),
    "minmax-k4-codebook-v4-w4": (one_tier(4, bits=4, value_scheme="codebook"), contextlib.nullcontext),
    "minmax-k4-codebook-v4-w8": (one_tier(8, bits=4, value_scheme="codebook"), contextlib.nullcontext),
    "minmax-token-k4-codebook-v4-w4": (
        one_tier(4, bits=4, key_axis="token", value_scheme="codebook"),
        contextlib.nullcontext,
    ),
    "minmax-k4-codebook-v3-w4": (
        one_tier(4, key_bits=4, value_bits=3, value_scheme="codebook"),
        contextlib.nullcontext,
    ),
    "minmax-k4v3-w4": (one_tier(4, key_bits=4, value_bits=3), contextlib.nullcontext),
    "kvpolicy-3.5bit": (lambda: CompressedCache.from_preset("kvpolicy-3.5bit"), contextlib.nullcontext),
    "kvpolicy-4bit": (lambda: CompressedCache.from_preset("kvpolicy-4bit"), contextlib.nullcontext),
}


def _print_scale_range(model: Any, ids: torch.Tensor, context: int) -> None:
    """The smallest and largest log2 scale of every codebook block the composition quantizes on ``ids``."""
    quantize, seen = codebook.quantize, []

    def record(*args: Any, **kwargs: Any) -> codebook.CodebookTensor:
        out = quantize(*args, **kwargs)
        seen.append(torch.log2(out.scales.float()).flatten())
        return out

    codebook.quantize = record  # type: ignore[assignment]
    try:
        with torch.inference_mode():
            teacher_forced_logits(model, ids, context, composition()())
    finally:
        codebook.quantize = quantize  # type: ignore[assignment]
    logs = torch.cat(seen)
    print(f"log2 scales of the composition on the first text: {float(logs.min()):.2f} .. {float(logs.max()):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--texts", type=int, default=3, help="calibration texts (at most 5)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--probes", nargs="+", choices=list(PROBES), default=list(PROBES))
    parser.add_argument("--scale-range", action="store_true", help="also print the log2 scales' range on text 1")
    args = parser.parse_args()
    model, texts, refs = setup(args.threads, CALIBRATION_FILES[: args.texts], args.context, args.tokens)
    if args.scale_range:
        _print_scale_range(model, texts[0], args.context)
    print(f"SmolLM2-135M fp32, {args.texts} calibration texts, {args.context} context + {args.tokens} tokens")
    print(f"{'probe':<22}{'bits/el':>9}{'KL':>20}{'top-1':>8}")
    for name in args.probes:
        make, patch = PROBES[name]
        kls, top1 = [], []
        with patch():
            for ids, ref in zip(texts, refs, strict=True):
                cache = make()
                with torch.inference_mode():
                    got = teacher_forced_logits(model, ids, args.context, cache)
                kls.append(next_token_kl(ref[0], got[0]))
                top1.append((ref[0].argmax(-1) == got[0].argmax(-1)).double())
        bits = 16 * held_bytes(cache, at_16bit=True) / baseline_bytes(model.config, cache.get_seq_length(), 1)
        kl = torch.cat(kls).double()
        se = float(kl.std() / math.sqrt(kl.numel()))
        print(f"{name:<22}{bits:>9.3f}{f'{float(kl.mean()):.4f} ± {se:.4f}':>20}{float(torch.cat(top1).mean()):>8.1%}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
