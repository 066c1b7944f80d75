"""Reconstruction error of SmolLM2-135M's rotated keys and values by quantizer (docs/explanation/quantization.md).

One prefill of ``--context`` tokens of a calibration text (files the frontier does not use) with
``DynamicCache``; every layer's keys and values are rotated (``Hadamard(0)``, what
``transform="hadamard"`` stores) and quantized by each scheme. Printed: bits per element (codes and
metadata), and the error relative to the data, ``‖x − x̂‖² / ‖x‖²`` summed over all layers, for
keys and values separately. ``codebook centred`` subtracts, per head, the mean of the first half of
the tokens (standing for the prompt, the first block a cache demotes) from every token before
quantizing, as ``Quantize(key_centre=True)`` does; its bytes include the centre.

Then the precision-tier question: a token that leaves a 4-bit middle tier for the 2-bit bottom is
either re-quantized from its 4-bit reconstruction (what :class:`kvpolicy.Tiered` does) or was
quantized to 2 bits from the original at demotion (a second copy held meanwhile). The error of
both, against the original, is printed for the bottom quantizer used by the tiered presets.

Usage::

    python scripts/quantizer_error.py --context 1024
"""

from __future__ import annotations

import argparse

import torch
from kvpolicy_research.lattice import Lattice  # the research plugin (pip install ./plugins/kvpolicy-research)
from transformers import DynamicCache

from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.transforms import Hadamard
from kvpolicy_lab.eval.models import load_smollm2
from kvpolicy_lab.eval.tasks import stdlib_text

TEXT = "functools.py"  # a calibration file (scripts/quantizer_quality.py --texts calibration)

#: label -> (bits, group size, axis, scheme)
SCHEMES = {
    "minmax channel G=64": dict(group_size=64, axis="channel", scheme="minmax"),
    "minmax channel G=128": dict(group_size=128, axis="channel", scheme="minmax"),
    "minmax token G=64": dict(group_size=64, axis="token", scheme="minmax"),
    "codebook": dict(group_size=None, axis="token", scheme="codebook"),
    "codebook centred": dict(group_size=None, axis="token", scheme="codebook", centred=True),
    "lattice": dict(group_size=None, axis="token", scheme="lattice"),
    "lattice centred": dict(group_size=None, axis="token", scheme="lattice", centred=True),
}


def _kv(context: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    model, tokenizer = load_smollm2(dtype=torch.float32)
    ids = torch.tensor([tokenizer(stdlib_text(TEXT))["input_ids"][:context]])
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    rot = Hadamard(0)
    return [rot.forward(layer.keys) for layer in cache.layers], [rot.forward(layer.values) for layer in cache.layers]


def _quantize(be: TorchBackend, x: torch.Tensor, bits: int, group_size: int | None, axis: str, scheme: str,
              centred: bool = False):  # fmt: skip
    extra: dict = {"scheme": scheme} if scheme != "minmax" else {}
    if centred:
        extra["centre"] = x[:, :, : x.shape[2] // 2].mean(dim=2, keepdim=True)
    return be.quantize(x, bits, group_size, axis, **extra)


def _error(be: TorchBackend, xs: list[torch.Tensor], **kw) -> tuple[float, float]:
    """(bits per element, relative squared error) over every layer."""
    held = err = energy = elems = 0.0
    for x in xs:
        q = _quantize(be, x, **kw)
        held += sum(q.nbytes().values()) * 8
        err += float((be.dequantize(q) - x).pow(2).sum())
        energy += float(x.pow(2).sum())
        elems += x.numel()
    return held / elems, err / energy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=1024, help="prefill tokens (a multiple of 128)")
    args = parser.parse_args()
    be = TorchBackend()
    keys, values = _kv(args.context)
    print(f"SmolLM2-135M-Instruct, {args.context} tokens of {TEXT}, rotated; relative squared error (lower is better)")
    print(f"{'bits':>4}  {'scheme':<22} {'bits/el':>8} {'keys':>9} {'values':>9}")
    for bits in (2, 3, 4):
        for label, kw in SCHEMES.items():
            if kw["scheme"] == "lattice" and bits not in Lattice.bits_allowed:
                continue
            b, ek = _error(be, keys, bits=bits, **kw)
            _, ev = _error(be, values, bits=bits, **kw)
            print(f"{bits:>4}  {label:<22} {b:8.3f} {ek:9.4f} {ev:9.4f}")
    print()
    print("a token moving from a 4-bit codebook middle tier to the 2-bit bottom")
    print("(keys per channel G=64, values per token G=64)")
    for kind, xs, axis in (("keys", keys, "channel"), ("values", values, "token")):
        direct = requant = energy = 0.0
        for x in xs:
            two = dict(bits=2, group_size=64, axis=axis, scheme="minmax")
            middle = be.dequantize(_quantize(be, x, 4, None, "token", "codebook"))
            direct += float((be.dequantize(_quantize(be, x, **two)) - x).pow(2).sum())
            requant += float((be.dequantize(_quantize(be, middle, **two)) - x).pow(2).sum())
            energy += float(x.pow(2).sum())
        print(f"  {kind:<7} quantized once from the original: {direct / energy:.4f}   "
              f"re-quantized from the middle tier: {requant / energy:.4f}  ({requant / direct:.3f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
