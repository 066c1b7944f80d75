"""Quality of the log cache by quantizer setting (group sizes, key/value bits) on SmolLM2-135M-Instruct.

Each text: ``--context`` tokens of a standard-library file (continued by the next files of the list
when short) as prefill, then ``--tokens`` teacher-forced tokens, scored against ``DynamicCache``:
ΔNLL and KL in nats per token and top-1 agreement (mean ± s.e. over all scored tokens). Decode runs
kvpolicy's fused path (``enable_fused``, ``backend="auto"``). Bits per element count everything
held after the last token; ``bits16`` counts the full-precision window and the key staging at 16
bits (what they cost in a 16-bit model).

Settings are compared on ``--texts calibration`` (files no other measurement uses); the
numbers in docs/explanation/quantization.md are from ``--texts heldout`` (the ablation's LM files).

Usage::

    python scripts/quantizer_quality.py --texts calibration
    python scripts/quantizer_quality.py --texts heldout --caches g64 k128 k4v2 k2v4 k3v2 b3
    python scripts/quantizer_quality.py --texts calibration --limit 3 --tokens 128 --caches g64 g64-mse k128 k128-mse
    python scripts/quantizer_quality.py --texts calibration --limit 3 --tokens 128 --caches g64-kmse g64-vmse k4v2 \
        k4v2-kmse k4v2-vmse
"""

from __future__ import annotations

import argparse
import math

import torch
from transformers import DynamicCache

from kvpolicy import CompressedCache
from kvpolicy.fused import enable_fused
from kvpolicy_lab.eval.metrics import next_token_kl, nll, teacher_forced_logits
from kvpolicy_lab.eval.models import load_smollm2
from kvpolicy_lab.eval.tasks import CALIBRATION_FILES, LM_FILES, stdlib_text

TEXTS = {
    "calibration": CALIBRATION_FILES,
    "heldout": LM_FILES[:5],
}
CACHES = {
    "g32": ("keys G=32, values G=32", dict(group_size=32, fit="minmax")),
    "g64": ("keys G=64, values G=64 (default)", dict(group_size=64, fit="minmax")),
    "k128": ("keys G=128, values G=64", dict(key_group_size=128, value_group_size=64, fit="minmax")),
    "k256": ("keys G=256, values G=64", dict(key_group_size=256, fit="minmax")),
    "k4v2": ("keys 4-bit, values 2-bit, G=64", dict(key_bits=4, value_bits=2, group_size=64, fit="minmax")),
    "k2v4": ("keys 2-bit, values 4-bit, G=64", dict(key_bits=2, value_bits=4, group_size=64, fit="minmax")),
    "k3v2": ("keys 3-bit, values 2-bit, G=64", dict(key_bits=3, value_bits=2, group_size=64, fit="minmax")),
    "b3": ("keys and values 3-bit, G=64", dict(bits=3, group_size=64, fit="minmax")),
    "rot": ("2-bit + Hadamard rotation", dict(group_size=64, transform="hadamard", fit="minmax")),
    "k3v2-rot": (
        "K3V2 + Hadamard rotation",
        dict(key_bits=3, value_bits=2, transform="hadamard", group_size=64, fit="minmax"),
    ),
    "k4v2-rot": (
        "K4V2 + Hadamard rotation",
        dict(key_bits=4, value_bits=2, transform="hadamard", group_size=64, fit="minmax"),
    ),
    "b3-rot": ("3-bit + Hadamard rotation", dict(bits=3, transform="hadamard", group_size=64, fit="minmax")),
    "b4": ("keys and values 4-bit", dict(bits=4, group_size=64, fit="minmax")),
    "b4-rot": ("4-bit + Hadamard rotation", dict(bits=4, transform="hadamard", group_size=64, fit="minmax")),
    "g64-mse": ("G=64, fitted ranges", dict(group_size=64, fit="mse")),
    "k128-mse": ("keys G=128, fitted ranges", dict(key_group_size=128, value_group_size=64, fit="mse")),
    "k3v2-mse": ("K3V2, fitted ranges", dict(key_bits=3, value_bits=2, fit="mse", group_size=64)),
    "k4v2-mse": ("K4V2, fitted ranges", dict(key_bits=4, value_bits=2, fit="mse", group_size=64)),
    "rot-mse": ("2-bit + Hadamard, fitted ranges", dict(group_size=64, transform="hadamard", fit="mse")),
    "g64-kmse": ("G=64, fitted key ranges", dict(group_size=64, key_fit="mse")),
    "g64-vmse": ("G=64, fitted value ranges", dict(group_size=64, value_fit="mse", key_fit="minmax")),
    "k4v2-kmse": ("K4V2, fitted key ranges", dict(key_bits=4, value_bits=2, key_fit="mse", group_size=64)),
    "k4v2-vmse": (
        "K4V2, fitted value ranges",
        dict(key_bits=4, value_bits=2, value_fit="mse", key_fit="minmax", group_size=64),
    ),
}


def _ids(tokenizer, files: tuple[str, ...], first: int, need: int) -> torch.Tensor:
    ids: list[int] = []
    for name in files[first:] + files[:first]:
        ids += tokenizer(stdlib_text(name))["input_ids"]
        if len(ids) >= need:
            return torch.tensor([ids[:need]])
    raise SystemExit(f"the files {files} hold {len(ids)} tokens; {need} needed")


def setup(threads: int, files: tuple[str, ...], context: int, tokens: int):
    """SmolLM2 with the fused path, one text of ``context + tokens`` tokens per file (``_ids``), and the
    uncompressed cache's teacher-forced logits of each."""
    torch.set_num_threads(threads)
    model, tokenizer = load_smollm2()
    enable_fused(model)
    texts = [_ids(tokenizer, files, i, context + tokens) for i in range(len(files))]
    with torch.inference_mode():
        refs = [teacher_forced_logits(model, ids, context, DynamicCache()) for ids in texts]
    return model, texts, refs


def _mean_se(x: torch.Tensor) -> str:
    x = x.double().flatten()
    return f"{float(x.mean()):.4f} ± {float(x.std() / math.sqrt(x.numel())):.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", choices=sorted(TEXTS), default="heldout")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--caches", nargs="+", choices=list(CACHES), default=list(CACHES))
    parser.add_argument("--limit", type=int, default=None, help="the first N texts of the set only")
    args = parser.parse_args()
    files = TEXTS[args.texts][: args.limit]
    model, texts, refs = setup(args.threads, files, args.context, args.tokens)
    print(
        f"SmolLM2-135M fp32, {args.texts} texts {list(files)}: {args.context} context + {args.tokens} "
        "teacher-forced tokens each; log policy W=42, 2-bit unless said"
    )
    print(f"{'cache':<36}{'ΔNLL':>18}{'KL':>18}{'top-1':>18}{'bits/el':>9}{'bits16':>8}")
    for key in args.caches:
        name, kwargs = CACHES[key]
        deltas, kls, top1 = [], [], []
        for ids, ref in zip(texts, refs, strict=True):
            cache = CompressedCache(policy="log", action="quantize", **kwargs)
            with torch.inference_mode():
                got = teacher_forced_logits(model, ids, args.context, cache)
            targets = ids[0, args.context :]
            deltas.append(nll(got[0], targets) - nll(ref[0], targets))
            kls.append(next_token_kl(ref[0], got[0]))
            top1.append((ref[0].argmax(-1) == got[0].argmax(-1)).double())
        report = cache.memory_report()
        cfg = model.config
        d = cfg.hidden_size // cfg.num_attention_heads
        elements = report.layers[0].tokens * cfg.num_hidden_layers * cfg.num_key_value_heads * 2 * d
        seg = report.segments
        bits = 8 * report.total_bytes / elements
        bits16 = 8 * (report.total_bytes - (seg["full_precision"] + seg["staging"]) / 2) / elements
        print(
            f"{name:<36}{_mean_se(torch.cat(deltas)):>18}{_mean_se(torch.cat(kls)):>18}"
            f"{_mean_se(torch.cat(top1)):>18}{bits:>9.3f}{bits16:>8.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
