"""Bits per element of saved caches, plain and entropy-coded, for every preset on SmolLM2-135M.

For each preset: prefill a prompt of ``--tokens`` tokens (the first of the lab's LM files, a
standard-library source file), then report the bits per element the cache holds
(``memory_report()``: compressed bytes over ``2 x layers x kv heads x tokens x head dim``
elements), of the file ``cache.save(path)`` writes and of the file ``cache.save(path,
codec="entropy")`` writes (whole files, header included, over the same element count), and
the median save and load times of each (``--repeats`` runs). Both files are loaded and checked to
hold identical tensors.

    PYTHONPATH=lab python plugins/kvpolicy-research/scripts/entropy_sizes.py --tokens 2048 --dtype bfloat16

Needs the lab (``kvpolicy_lab``) and constriction.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvpolicy import CompressedCache
from kvpolicy.attention import enable_scores
from kvpolicy.presets import BUILTIN_PRESETS


def _timed(fn, repeats: int) -> tuple[object, float]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return out, statistics.median(times)


def _flat(cache: CompressedCache) -> list[torch.Tensor]:
    """Every tensor a cache holds, in a fixed order (to compare two loaded caches)."""
    out: list[torch.Tensor] = []

    def walk(node: object) -> None:
        if isinstance(node, torch.Tensor):
            out.append(node)
        elif isinstance(node, dict):
            for key in sorted(node):
                walk(node[key])
        elif isinstance(node, (list, tuple)):
            for item in node:
                walk(item)

    for layer in cache.layers:
        walk(layer.state_dict())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--presets", nargs="*", default=list(BUILTIN_PRESETS))
    args = parser.parse_args()

    from kvpolicy_lab.eval.models import load_smollm2
    from kvpolicy_lab.eval.tasks import LM_FILES, encode, stdlib_text

    model, tokenizer = load_smollm2(dtype=getattr(torch, args.dtype))
    enable_scores(model)  # h2o's attention scores; outputs unchanged
    ids = torch.tensor([encode(tokenizer, stdlib_text(LM_FILES[0]))[: args.tokens]])
    if ids.shape[1] < args.tokens:
        raise SystemExit(f"{LM_FILES[0]} has only {ids.shape[1]} tokens")
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    elements = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * args.tokens * head_dim
    print(f"SmolLM2-135M {args.dtype}, {args.tokens} tokens of {LM_FILES[0]}, {torch.get_num_threads()} threads")
    print(
        "| preset | memory bits/el | file bits/el | coded bits/el | coded - memory | save plain / coded (s) | "
        "load plain / coded (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        plain, coded = Path(tmp) / "plain.kvc", Path(tmp) / "coded.kvc"
        for name in args.presets:
            cache = CompressedCache.for_model(model, name)
            with torch.no_grad():
                model(ids, cache=cache, use_cache=True)
            memory = cache.memory_report().total_bytes * 8 / elements
            size_plain, t_save_plain = _timed(lambda c=cache: c.save(plain), args.repeats)
            size_coded, t_save_coded = _timed(lambda c=cache: c.save(coded, codec="entropy"), args.repeats)
            a, t_load_plain = _timed(lambda: CompressedCache.load(plain), args.repeats)
            b, t_load_coded = _timed(lambda: CompressedCache.load(coded), args.repeats)
            fa, fb = _flat(a), _flat(b)
            same = len(fa) == len(fb) and all(
                x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(fa, fb, strict=True)
            )
            if not same:
                raise SystemExit(f"{name}: the coded file does not load to the plain file's tensors")
            bp, bc = size_plain * 8 / elements, size_coded * 8 / elements
            print(
                f"| {name} | {memory:.3f} | {bp:.3f} | {bc:.3f} | {bc - memory:+.3f} | "
                f"{t_save_plain:.2f} / {t_save_coded:.2f} | {t_load_plain:.2f} / {t_load_coded:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
