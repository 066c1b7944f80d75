"""Fingerprints of SmolLM2-135M's logits under a set of caches: run on two commits, compare the lines.

A refactor that must not change behaviour (the same tokens, the same codes, the same logits) shows it
here bit for bit: each line is the sha256 of the float32 logits of a prefill followed by teacher-forced
decode steps, fused and materialised, for one cache. Equal lines on two commits mean equal logits, so
every KL, top-1 and ΔNLL measured with those caches is equal too.

The caches are the presets, the one-liner, a few compositions of the core, and the compositions of the
research plugin (``pip install ./plugins/kvpolicy-research``; their lines say "not installed" without it).
A cache whose transform fits on the prompt's queries runs its materialised steps under kvpolicy's score
wrapper (:func:`kvpolicy.attention.enable_scores`), which reports them. With ``--files DIR`` each cache is
also saved after its prompt and ten steps, loaded, and run on (the ``reloaded`` lines); a file already in
``DIR`` is loaded instead of written, so files written on one commit are read on the other.

Usage::

    python scripts/logits_fingerprint.py --files /tmp/fp > before.txt   # on one commit
    python scripts/logits_fingerprint.py --files /tmp/fp > after.txt    # on the other
    diff before.txt after.txt
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Callable
from pathlib import Path

import torch

from kvpolicy import CompressedCache
from kvpolicy.attention import disable_scores, enable_scores
from kvpolicy.errors import ConfigError
from kvpolicy.fused import disable_fused, enable_fused
from kvpolicy_lab.eval.models import load_smollm2

CACHES: dict[str, Callable[[], CompressedCache]] = {
    "one-liner": lambda: CompressedCache(policy="log", action="quantize", bits=2),
    "kvpolicy-3bit": lambda: CompressedCache.from_preset("kvpolicy-3bit"),
    "kvpolicy-4.5bit": lambda: CompressedCache.from_preset("kvpolicy-4.5bit"),
    "logquant": lambda: CompressedCache.from_preset("logquant"),
    "kivi": lambda: CompressedCache.from_preset("kivi"),
    "torch-backend-k3v2": lambda: CompressedCache(policy="log", window=16, key_bits=3, value_bits=2, backend="torch"),
    "hadamard-k3v2": lambda: CompressedCache(policy="log", window=16, key_bits=3, value_bits=2, transform="hadamard"),
    "h2o": lambda: CompressedCache.from_preset("h2o"),
    # the research plugin's transforms
    "lowrank-cpu": lambda: CompressedCache(policy="log", window=16, key_bits=3, value_bits=2, transform="lowrank"),
    "lowrank-torch-r4-16": lambda: CompressedCache(
        policy="log", window=16, bits=2, transform="lowrank", rank=4, coefficient_bits=16, backend="torch"
    ),
    "lowrank-3bit": lambda: CompressedCache.from_preset("kvpolicy-3bit", transform="lowrank"),
    "query-hadamard": lambda: CompressedCache(
        policy="log", window=16, key_bits=3, value_bits=2, transform="query-hadamard"
    ),
    "query-hadamard-3bit": lambda: CompressedCache.from_preset("kvpolicy-3bit", transform="query-hadamard"),
}
#: caches whose materialised steps need kvpolicy's wrapper (scores, or queries for the transform)
WRAPPED = ("h2o", "query-hadamard", "query-hadamard-3bit")


def run(model: torch.nn.Module, ids: torch.Tensor, prompt: int, cache: CompressedCache, start: int) -> list:
    """The logits of ``ids[:, start:prompt]`` as one forward (when ``start < prompt``), then one token at a time."""
    logits = []
    if start < prompt:
        logits.append(model(ids[:, start:prompt], cache=cache, use_cache=True).logits)
    for t in range(max(start, prompt), ids.shape[1]):
        logits.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    return logits


def digest(logits: list) -> str:
    return hashlib.sha256(torch.cat(logits, dim=1).float().numpy().tobytes()).hexdigest()[:16]


def fingerprint(model, ids, prompt, make, files: Path | None, name: str) -> tuple[str, str | None]:
    """sha256 of the logits of the prompt and every step; with ``files``, also of the steps after a reload."""
    cache = make()
    whole = digest(run(model, ids, prompt, cache, 0))
    if files is None:
        return whole, None
    path = files / f"{name}.safetensors"
    if not path.exists():
        cache = make()
        run(model, ids[:, : prompt + 10], prompt, cache, 0)
        cache.save(path)
    loaded = CompressedCache.load(path)
    return whole, digest(run(model, ids, prompt, loaded, prompt + 10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=600, help="prompt tokens (one forward)")
    parser.add_argument("--steps", type=int, default=40, help="teacher-forced decode steps after it")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--files", type=Path, default=None, help="save and reload each cache through this folder")
    parser.add_argument("--only", nargs="*", default=None, help="these caches only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.files is not None:
        args.files.mkdir(parents=True, exist_ok=True)
    model, _ = load_smollm2()
    ids = torch.randint(
        3, model.config.vocab_size, (1, args.prompt + args.steps), generator=torch.Generator().manual_seed(0)
    )
    names = list(CACHES) if args.only is None else args.only
    with torch.no_grad():
        for mode in ("materialized", "fused"):
            for name in names:
                if mode == "fused":
                    enable_fused(model)
                elif name in WRAPPED:
                    enable_scores(model)
                try:
                    whole, reloaded = fingerprint(model, ids, args.prompt, CACHES[name], args.files, f"{mode}-{name}")
                except ConfigError as exc:
                    whole = reloaded = f"not installed ({str(exc).splitlines()[0][:60]})"
                finally:
                    disable_fused(model)
                    disable_scores(model)
                print(f"{mode:12s} {name:20s} {whole}", flush=True)
                if reloaded is not None:
                    print(f"{mode:12s} {name:20s} reloaded {reloaded}", flush=True)


if __name__ == "__main__":
    main()
