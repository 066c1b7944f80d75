"""Measure kvpolicy's LMCache codecs against LMCache's fp8 codec and uncompressed chunks
(docs/how-to/share-with-lmcache.md).

Needs the plugin's environment (``pip install torch==2.13.0 lmcache==0.5.6 -e . -e ./lab
./plugins/kvpolicy-lmcache``). Three parts, each optional:

- ``bits``: stored bits per element of a 256-token bfloat16 chunk, everything counted (prefix, header,
  padding, codes, scales, centres, scale bases), for SmolLM2-135M's layer stack (30 layers, 3 KV heads ×
  64) and an 8B-shaped one (32 layers, 8 KV heads × 128), from each codec's own
  ``estimate_serialized_size`` (which the kvpolicy codec reaches exactly; fp8 writes one byte per element),
  for each preset as configured by default (each chunk's first token and last 4 kept verbatim) and with
  every token coded (``keep_first=0, keep_last=0``);
- ``kl``: SmolLM2-135M (float32, CPU) on the frontier's held-out texts (the first ``--texts`` texts of the
  ablation's ``lm`` task, seed 0: standard-library files no setting was tuned on), ``--context`` tokens of
  context then ``--tokens`` teacher-forced tokens. The reference is ``DynamicCache`` over the whole
  context. Each codec row prefills ``context - 1`` tokens, cuts their KV into 256-token chunks (the last
  one partial), stores and loads each chunk through the codec's LMCache serializer and deserializer, puts
  them into a fresh ``DynamicCache`` (:mod:`kvpolicy_lmcache.hf`) and decodes on from the context's last
  token, as a server reusing a stored prompt does (``--recompute 1``); with ``--recompute 256`` only the
  full chunks before the last 256 context tokens are reused and the model recomputes those (LMCache stores
  full chunks only unless ``save_unfull_chunk`` is set, so a prompt's last partial chunk is always
  recomputed). ``--keep FIRST,LAST`` adds codec rows keeping other numbers of each chunk's first and last
  tokens verbatim (``--skip memory fp8`` leaves the other rows out). ``in memory`` rows run the same preset
  in a ``CompressedCache``
  (``CompressedCache.for_model``, the context prefilled whole, then decoded on kvpolicy's fused attention,
  as docs/frontier.md measures it). KL is the mean next-token ``KL(reference || row)`` per text, then the
  mean over texts ± standard error and the worst text;
- ``speed``: encode and decode of one 256-token bfloat16 chunk of the 8B-shaped stack (random normal
  values) through each codec's LMCache serializer and deserializer (kvpolicy's compiled kernel, and the
  first preset once more with ``kernel="reference"``), interleaved: ``--rounds`` rounds, each timing every
  codec once, after one warm-up round; the median per codec, its MB/s (uncompressed chunk bytes over the
  time) and the ratio of each codec's encode + decode time to fp8's.

Usage::

    LMCACHE_TRACK_USAGE=false python scripts/lmcache_codec.py --threads 2 --out results/lmcache/measure.json
    python scripts/lmcache_codec.py --parts speed --rounds 9
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import torch
from kvpolicy_lmcache import ChunkCodec
from kvpolicy_lmcache.hf import from_chunks, to_chunks
from kvpolicy_lmcache.serde import KVPolicyDeserializer, KVPolicySerializer, TensorObj
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde import Fp8QuantizationDeserializer, Fp8QuantizationSerializer

PRESETS = ("kvpolicy-3bit", "kvpolicy-3.5bit", "kvpolicy-4bit")
#: LMCache's chunk size, in tokens
CHUNK = 256
#: (name, layout of one 256-token chunk, head_dim)
STACKS = (("SmolLM2-135M", (2, 30, 256, 192), 64), ("8B-shaped", (2, 32, 256, 1024), 128))


class Fp8:
    """LMCache's fp8 codec, as an adapter configures it by default (``float8_e4m3fn``)."""

    name = "LMCache fp8"

    def __init__(self) -> None:
        self.ser, self.de = Fp8QuantizationSerializer(), Fp8QuantizationDeserializer()


class KVPolicy:
    """kvpolicy's codec through its LMCache serializer and deserializer."""

    def __init__(
        self, preset: str, head_dim: int | None, kernel: str = "auto", keep: tuple[int, int] | None = None
    ) -> None:
        kept = {} if keep is None else {"keep_first": keep[0], "keep_last": keep[1]}
        codec = ChunkCodec(preset=preset, head_dim=head_dim, kernel=kernel, **kept)
        self.name = preset if kernel == "auto" else f"{preset} ({kernel} kernel)"
        if keep is not None:
            self.name += f" (first {keep[0]}, last {keep[1]} verbatim)"
        self.ser, self.de = KVPolicySerializer(codec), KVPolicyDeserializer(codec)


KEY = ObjectKey(chunk_hash=bytes(32), model_name="measure", kv_rank=0)


def round_trip(codec: Any, chunk: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``chunk`` stored and loaded through ``codec``: the loaded chunk and the bytes stored."""
    size = codec.ser.estimate_serialized_size(MemoryLayoutDesc(shapes=[chunk.shape], dtypes=[chunk.dtype]))
    buf = torch.empty(size, dtype=torch.uint8)
    n = codec.ser.serialize(TensorObj(chunk), TensorObj(buf), KEY)
    out = torch.empty_like(chunk)
    codec.de.deserialize(TensorObj(buf[:n]), TensorObj(out), KEY)
    return out, n


# ---------------------------------------------------------------------------------------------- bits
def bits() -> list[dict[str, Any]]:
    rows = []
    for stack, shape, head_dim in STACKS:
        layout = MemoryLayoutDesc(shapes=[torch.Size(shape)], dtypes=[torch.bfloat16])
        numel = 1
        for s in shape:
            numel *= s
        sizes = {"uncompressed (bfloat16)": numel * 2, "LMCache fp8": Fp8().ser.estimate_serialized_size(layout)}
        for preset in PRESETS:
            sizes[preset] = KVPolicy(preset, head_dim).ser.estimate_serialized_size(layout)
            every = KVPolicy(preset, head_dim, keep=(0, 0))  # no token kept verbatim
            sizes[f"{preset}, every token coded"] = every.ser.estimate_serialized_size(layout)
        for name, size in sizes.items():
            rows.append({"stack": stack, "codec": name, "bytes": size, "bits_per_element": 8 * size / numel})
    return rows


# ------------------------------------------------------------------------------------------------ kl
def kl(
    texts: int,
    context: int,
    tokens: int,
    presets: list[str],
    recompute: list[int],
    partial: Path | None = None,
    only: list[int] | None = None,
    keeps: list[tuple[int, int] | None] | None = None,
    skip: tuple[str, ...] = (),
) -> dict[str, Any]:
    from transformers import DynamicCache

    from kvpolicy import CompressedCache
    from kvpolicy.fused import enable_fused
    from kvpolicy.prefill import teacher_forced_logits
    from kvpolicy_lab.eval.models import load_smollm2
    from kvpolicy_lab.eval.tasks import LanguageModeling

    model, tokenizer = load_smollm2()
    enable_fused(model)  # CompressedCache attends over its packed codes (as the frontier measures); others as before
    head_dim = model.config.head_dim
    samples = LanguageModeling(samples_per_context=texts, tokens=tokens).samples(tokenizer, context, seed=0)
    if only is not None:  # a share of the texts, for runs in several processes (merged by text id)
        samples = [samples[i] for i in only]
    ids = [torch.tensor(s.ids[: context + tokens]) for s in samples]
    codecs: list[Any] = [] if "fp8" in skip else [Fp8()]
    codecs += [KVPolicy(p, head_dim, keep=k) for p in presets for k in (keeps or [None])]
    per_row: dict[str, list[dict[str, float]]] = {}
    with torch.inference_mode():
        for i, text in enumerate(ids):
            text = text.unsqueeze(0)
            ref = teacher_forced_logits(model, text, context, DynamicCache(config=model.config))
            for preset in [] if "memory" in skip else presets:  # the preset in memory: context prefilled, then decoded
                got = teacher_forced_logits(model, text, context, CompressedCache.for_model(model, preset))
                per_row.setdefault(f"{preset} in memory (CompressedCache)", []).append(_scores(ref, got))
            prompt = DynamicCache(config=model.config)
            model(text[:, : context - 1], cache=prompt, use_cache=True)
            chunks = to_chunks(prompt)
            for recomputed in recompute:
                reused = chunks if recomputed == 1 else chunks[: (context - recomputed) // CHUNK]
                for codec in codecs:
                    loaded = [round_trip(codec, c)[0] for c in reused]
                    cache = from_chunks(loaded, head_dim, model.config)
                    start = sum(c.shape[2] for c in loaded)
                    got = teacher_forced_logits(model, text[:, start:], context - start, cache)
                    per_row.setdefault(f"{codec.name}, {recomputed} recomputed", []).append(_scores(ref, got))
            print(f"text {i}: " + ", ".join(f"{n} {r[-1]['kl']:.4f}" for n, r in per_row.items()), flush=True)
            if partial is not None:  # the rows so far, after every text
                partial.write_text(json.dumps(per_row, indent=1) + "\n")
    return {
        "texts": [s.sample_id for s in samples], "context": context, "tokens": tokens, "recomputed": recompute,
        "rows": {name: _summary(rows) for name, rows in per_row.items()},
    }  # fmt: skip


def _scores(ref: torch.Tensor, got: torch.Tensor) -> dict[str, float]:
    from kvpolicy_lab.quality import next_token_kl

    kl = next_token_kl(ref, got).double().mean()
    return {"kl": float(kl), "top1": float((ref.argmax(-1) == got.argmax(-1)).double().mean())}


def _summary(rows: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {"per_text": rows}
    for metric in ("kl", "top1"):
        values = [r[metric] for r in rows]
        se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
        out[metric] = {
            "mean": statistics.fmean(values),
            "se": se,
            "worst": max(values) if metric == "kl" else min(values),
        }
    return out


# --------------------------------------------------------------------------------------------- speed
def speed(rounds: int, presets: list[str]) -> dict[str, Any]:
    _, shape, head_dim = STACKS[1]
    chunk = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    codecs = [Fp8(), *(KVPolicy(p, head_dim) for p in presets), KVPolicy(presets[0], head_dim, "reference")]
    times: dict[str, dict[str, list[float]]] = {c.name: {"encode": [], "decode": []} for c in codecs}
    layout = MemoryLayoutDesc(shapes=[chunk.shape], dtypes=[chunk.dtype])
    buffers = {c.name: torch.empty(c.ser.estimate_serialized_size(layout), dtype=torch.uint8) for c in codecs}
    out = torch.empty_like(chunk)
    for r in range(rounds + 1):  # round 0 warms up (plans, templates, allocations)
        for c in codecs:
            buf = buffers[c.name]
            t0 = time.perf_counter()
            n = c.ser.serialize(TensorObj(chunk), TensorObj(buf), KEY)
            t1 = time.perf_counter()
            c.de.deserialize(TensorObj(buf[:n]), TensorObj(out), KEY)
            t2 = time.perf_counter()
            if r:
                times[c.name]["encode"].append(t1 - t0)
                times[c.name]["decode"].append(t2 - t1)
    mb = chunk.numel() * chunk.element_size() / 1e6
    fp8 = times["LMCache fp8"]
    fp8_total = statistics.median(fp8["encode"]) + statistics.median(fp8["decode"])
    rows = {}
    for name, t in times.items():
        enc, dec = statistics.median(t["encode"]), statistics.median(t["decode"])
        rows[name] = {
            "encode_ms": 1e3 * enc, "decode_ms": 1e3 * dec, "encode_mb_s": mb / enc, "decode_mb_s": mb / dec,
            "time_vs_fp8": (enc + dec) / fp8_total,
        }  # fmt: skip
    return {"shape": list(shape), "dtype": "bfloat16", "rounds": rounds, "chunk_mb": mb, "rows": rows}


def _pair(text: str) -> tuple[int, int]:
    first, last = (int(v) for v in text.split(","))
    return first, last


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", default=["bits", "kl", "speed"], choices=["bits", "kl", "speed"])
    p.add_argument("--presets", nargs="+", default=["kvpolicy-3bit", "kvpolicy-4bit"], choices=PRESETS)
    p.add_argument("--texts", type=int, default=5)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument(
        "--recompute",
        nargs="+",
        type=int,
        default=[1, 256],
        help="context tokens the model recomputes after the reused chunks: 1 (every chunk reused, the last "
        "one partial) or a multiple of 256 (the full chunks before them reused)",
    )
    p.add_argument("--only", nargs="+", type=int, default=None, help="measure these texts (indices) of the --texts")
    p.add_argument(
        "--keep",
        nargs="+",
        default=None,
        help="codec rows keeping each chunk's first and last tokens verbatim, as FIRST,LAST pairs (default: the "
        "preset's default only; 'default' names it among others)",
    )
    p.add_argument("--skip", nargs="+", default=[], choices=["memory", "fp8"], help="rows of the kl part left out")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args()
    bad = [r for r in args.recompute if r != 1 and (r % CHUNK or not 0 < r < args.context)]
    if bad:
        p.error(f"--recompute takes 1 or multiples of {CHUNK} below --context; got {bad}")
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict[str, Any] = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},
    }  # fmt: skip
    if "bits" in args.parts:
        result["bits"] = bits()
        for row in result["bits"]:
            print(
                f"{row['stack']:>14}  {row['codec']:<36} {row['bytes']:>10} bytes  {row['bits_per_element']:.3f} bits"
            )
    if "speed" in args.parts:
        result["speed"] = speed(args.rounds, args.presets)
        for name, row in result["speed"]["rows"].items():
            enc = f"encode {row['encode_ms']:7.1f} ms ({row['encode_mb_s']:6.0f} MB/s)"
            dec = f"decode {row['decode_ms']:7.1f} ms ({row['decode_mb_s']:6.0f} MB/s)"
            print(f"{name:<36} {enc}  {dec}  {row['time_vs_fp8']:.2f}x fp8")
    if "kl" in args.parts:
        partial = args.out.with_suffix(".partial.json") if args.out else None
        keeps = None if args.keep is None else [None if k == "default" else _pair(k) for k in args.keep]
        result["kl"] = kl(
            args.texts, args.context, args.tokens, args.presets, args.recompute, partial, args.only, keeps,
            tuple(args.skip),
        )  # fmt: skip
        for name, row in result["kl"]["rows"].items():
            k = row["kl"]
            print(f"{name:<44} KL {k['mean']:.4f} ± {k['se']:.4f} (worst {k['worst']:.4f})  top-1 "
                  f"{row['top1']['mean']:.1%}")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
