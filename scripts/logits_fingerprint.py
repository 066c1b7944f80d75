"""Fingerprints of SmolLM2-135M's logits under a set of caches: run on two commits, compare the lines.

A refactor that must not change behaviour (the same tokens, the same codes, the same logits) shows it
here bit for bit: each line is the sha256 of the float32 logits of a prefill followed by teacher-forced
decode steps, fused and materialised, for one cache. Equal lines on two commits mean equal logits, so
every KL, top-1 and ΔNLL measured with those caches is equal too.

The caches: every registered preset, every shipped preset file, the one-liner, and the compositions of
the research plugin's parts (the lattice format, the low-rank transform, query-weighted keys; they need
``pip install ./plugins/kvpolicy-research`` where they are not in the core). ``saved`` lines save a cache
after the prompt (entropy-coded where named), load it and hash the logits of the decode that continues
from the loaded cache. ``--save-dir`` also keeps those files and ``--load-dir`` continues from files kept
by another commit: files saved by the old code must load and continue bit for bit.

Usage::

    python scripts/logits_fingerprint.py --save-dir /tmp/files > before.txt   # on the old commit
    python scripts/logits_fingerprint.py --load-dir /tmp/files > after.txt    # on the new one
    diff before.txt after.txt
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import tempfile
from pathlib import Path

import torch

from kvpolicy import CompressedCache, registry
from kvpolicy.attention import disable_scores, enable_scores
from kvpolicy.fused import disable_fused, enable_fused
from kvpolicy_lab.eval.models import load_smollm2

ROOT = Path(__file__).resolve().parent.parent
LATTICE = dict(policy="log", window=16, key_bits=3, value_bits=2, scheme="lattice", key_centre=True,
               transform="hadamard")  # fmt: skip
CACHES = {
    "one-liner": lambda: CompressedCache(policy="log", action="quantize", bits=2),
    "torch-backend-k3v2": lambda: CompressedCache(policy="log", window=16, key_bits=3, value_bits=2, backend="torch"),
    "lattice-k3v2-n8": lambda: CompressedCache(**LATTICE, norm_bits=8),
    "lattice-k3v2-n8-torch": lambda: CompressedCache(**LATTICE, norm_bits=8, backend="torch"),
    "lattice-k2v2-n16": lambda: CompressedCache(**{**LATTICE, "key_bits": 2}),
    "lattice-values-codebook-keys": lambda: CompressedCache(
        policy="log", window=16, bits=2, key_scheme="codebook", value_scheme="lattice", transform="hadamard"
    ),
    "lowrank": lambda: CompressedCache(policy="log", window=16, key_bits=3, value_bits=2, transform="lowrank", rank=8),
    "query-hadamard": lambda: CompressedCache(
        policy="log", window=16, key_bits=3, value_bits=2, scheme="codebook", transform="query-hadamard"
    ),
}
CACHES |= {f"preset:{name}": (lambda n=name: CompressedCache.from_preset(n)) for name in registry.names("presets")}
CACHES |= {
    f"file:{path.stem}": (lambda p=path: CompressedCache.from_preset(str(p)))
    for path in [*sorted((ROOT / "kvpolicy" / "preset_files").glob("*.toml")),
                 *sorted((ROOT / "examples" / "presets").glob("*.toml")),
                 *sorted((ROOT / "plugins" / "kvpolicy-research" / "examples").glob("*.toml"))]
}  # fmt: skip
#: caches saved after the prompt and loaded again: (name, cache, entropy-coded)
SAVED = [
    ("kvpolicy-3bit", CACHES["preset:kvpolicy-3bit"], False),
    ("kvpolicy-3bit-entropy", CACHES["preset:kvpolicy-3bit"], True),
    ("one-liner-entropy", CACHES["one-liner"], True),
    ("lattice-k3v2-n8-entropy", CACHES["lattice-k3v2-n8"], True),
    ("lattice-k2v2-n16", CACHES["lattice-k2v2-n16"], False),
]


def run(model: torch.nn.Module, ids: torch.Tensor, start: int, cache: object, first: int | None = None) -> list:
    """Logits of ``ids[:, start:first]`` as one forward (when ``first``), then one token at a time."""
    logits = []
    if first is not None:
        logits.append(model(ids[:, start:first], cache=cache, use_cache=True).logits)
        start = first
    for t in range(start, ids.shape[1]):
        logits.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    return logits


def digest(logits: list) -> str:
    return hashlib.sha256(torch.cat(logits, dim=1).float().numpy().tobytes()).hexdigest()[:16]


def save(cache: CompressedCache, path: Path, coded: bool) -> None:
    """``cache.save`` entropy-coded or not, by the saving API of the commit at hand."""
    if not coded:
        cache.save(path)
    elif "entropy_coding" in inspect.signature(cache.save).parameters:
        cache.save(path, entropy_coding=True)
    else:
        cache.save(path, codec="entropy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=600, help="prompt tokens (one forward)")
    parser.add_argument("--steps", type=int, default=40, help="teacher-forced decode steps after it")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", nargs="*", help="the cache names to run (default: all)")
    parser.add_argument("--save-dir", type=Path, help="keep the saved files here")
    parser.add_argument("--load-dir", type=Path, help="continue from the files kept here (by another commit)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_smollm2()
    ids = torch.randint(
        3, model.config.vocab_size, (1, args.prompt + args.steps), generator=torch.Generator().manual_seed(0)
    )
    wanted = lambda name: not args.only or name in args.only  # noqa: E731
    with torch.no_grad():
        for mode in ("materialized", "fused"):
            # scores reported in both modes: the parts that weigh keys by the queries need them
            (enable_fused if mode == "fused" else enable_scores)(model)
            for name, make in CACHES.items():
                if wanted(name):
                    print(f"{mode:12s} {name:36s} {digest(run(model, ids, 0, make(), args.prompt))}", flush=True)
            for name, make, coded in SAVED:
                if not wanted(name):
                    continue
                folder = args.save_dir or Path(tempfile.mkdtemp())
                folder.mkdir(parents=True, exist_ok=True)
                path = (args.load_dir or folder) / f"{name}-{mode}.kvc"
                if args.load_dir is None:
                    cache = make()
                    model(ids[:, : args.prompt], cache=cache, use_cache=True)
                    save(cache, path, coded)
                    print(f"{mode:12s} {'kept:' + name:36s} {digest(run(model, ids, args.prompt, cache))}", flush=True)
                loaded = CompressedCache.load(path)
                print(f"{mode:12s} {'saved:' + name:36s} {digest(run(model, ids, args.prompt, loaded))}", flush=True)
            (disable_fused if mode == "fused" else disable_scores)(model)


if __name__ == "__main__":
    main()
