"""Fingerprints of SmolLM2-135M's logits under a set of caches: run on two commits, compare the lines.

A refactor that must not change behaviour (the same tokens, the same codes, the same logits) shows it
here bit for bit: each line is the sha256 of the float32 logits of a prefill followed by teacher-forced
decode steps, fused and materialised, for one cache. Equal lines on two commits mean equal logits, so
every KL, top-1 and ΔNLL measured with those caches is equal too.

Usage::

    python scripts/logits_fingerprint.py > after.txt          # on one commit
    git stash; python scripts/logits_fingerprint.py > before.txt; git stash pop
    diff before.txt after.txt
"""

from __future__ import annotations

import argparse
import hashlib

import torch

from kvpolicy import CompressedCache
from kvpolicy.fused import disable_fused, enable_fused
from kvpolicy_lab.eval.models import load_smollm2

CACHES = {
    "one-liner": lambda: CompressedCache(policy="log", action="quantize", bits=2),
    "kvpolicy-3bit": lambda: CompressedCache.from_preset("kvpolicy-3bit"),
    "kvpolicy-4.5bit": lambda: CompressedCache.from_preset("kvpolicy-4.5bit"),
    "logquant": lambda: CompressedCache.from_preset("logquant"),
    "kivi": lambda: CompressedCache.from_preset("kivi"),
    "torch-backend-k3v2": lambda: CompressedCache(policy="log", window=16, key_bits=3, value_bits=2, backend="torch"),
}


def fingerprint(model: torch.nn.Module, ids: torch.Tensor, prompt: int, make: object) -> str:
    """sha256 of the logits of ``ids[:, :prompt]`` as one forward, then one token at a time."""
    cache = make()
    logits = [model(ids[:, :prompt], cache=cache, use_cache=True).logits]
    for t in range(prompt, ids.shape[1]):
        logits.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    return hashlib.sha256(torch.cat(logits, dim=1).float().numpy().tobytes()).hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=600, help="prompt tokens (one forward)")
    parser.add_argument("--steps", type=int, default=40, help="teacher-forced decode steps after it")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_smollm2()
    ids = torch.randint(
        3, model.config.vocab_size, (1, args.prompt + args.steps), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        for mode in ("materialized", "fused"):
            if mode == "fused":
                enable_fused(model)
            for name, make in CACHES.items():
                print(f"{mode:12s} {name:20s} {fingerprint(model, ids, args.prompt, make)}", flush=True)
            if mode == "fused":
                disable_fused(model)


if __name__ == "__main__":
    main()
