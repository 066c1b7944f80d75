"""GPU check: a model split across ``cuda:0`` and ``cpu`` (``device_map``) with a CompressedCache.

A tiny random Llama (4 layers, 2 kv heads) is dispatched with accelerate: embeddings and layers 0-1
on ``cuda:0``, layers 2-3, the final norm and the head on ``cpu``. For a few compositions it checks:

- every layer's held tensors (full-precision segment, codes, scales, positions) live on the device of
  that layer's keys, and ``backend="auto"`` chose per layer (``triton`` or ``torch`` on CUDA, ``cpu``
  on CPU);
- teacher-forced logits match the same model run entirely on CPU with the same composition (within
  float tolerance: the CUDA layers compute in another order, and a value at a rounding boundary can
  take the other code, see docs/explanation/scale-out.md);
- the memory report counts every layer, and ``save`` / ``load(device={layer: device})`` round-trips
  the split cache with identical continuation logits.

Exits 0 with a message when no GPU is present; non-zero on any failed check.

Usage::

    python scripts/device_map_check.py                      # needs a GPU
    python scripts/device_map_check.py --first-device cpu   # the same checks, both halves on CPU
                                                            # (tests the script, not the split)
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import torch

from kvpolicy import CompressedCache
from kvpolicy.tiny import random_model
from kvpolicy_lab.eval.metrics import teacher_forced_logits

COMPOSITIONS = {
    "log 2-bit": dict(policy="log", window=8, bits=2, group_size=16),
    "log K4V2 + rotation": dict(policy="log", window=8, key_bits=4, value_bits=2, group_size=16, transform="hadamard"),
    "sink evict": dict(policy="sink", sinks=2, window=12, action="evict"),
    "none": dict(policy="log", action="none"),
}


def device_map(first: str) -> dict[str, str]:
    """Embeddings and layers 0-1 on ``first``, the rest on CPU."""
    head = ("model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1")
    tail = ("model.layers.2", "model.layers.3", "model.norm", "lm_head")
    return {**dict.fromkeys(head, first), **dict.fromkeys(tail, "cpu")}


def _held(layer) -> list[torch.Tensor]:
    out = [layer.keys, layer.values]
    held = getattr(getattr(layer, "engine", None), "held", None)  # transformers' own layers (sliding) have none
    if held is not None and held.full_pos is not None:
        out.append(held.full_pos)
    store = None if held is None else held.store
    if store is not None and hasattr(store, "state_dict"):
        stack = [store.state_dict()]
        while stack:
            node = stack.pop()
            if isinstance(node, torch.Tensor):
                out.append(node)
            elif isinstance(node, dict):
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description="a CompressedCache on a model split across two devices")
    parser.add_argument("--first-device", default="cuda:0", help="device of layers 0-1 (default cuda:0)")
    first = parser.parse_args().first_device
    if first.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: device_map check skipped")
        return 0
    from accelerate import dispatch_model

    layer_devices = {0: first, 1: first, 2: "cpu", 3: "cpu"}
    failures = []
    reference_model = random_model("llama", layers=4, seed=0)
    split = dispatch_model(copy.deepcopy(reference_model), device_map=device_map(first))
    ids = torch.randint(3, 96, (2, 90), generator=torch.Generator().manual_seed(1))
    for name, kw in COMPOSITIONS.items():
        with torch.no_grad():
            ref = teacher_forced_logits(reference_model, ids, 40, CompressedCache(**kw))
            cache = CompressedCache(**kw)
            got = teacher_forced_logits(split, ids.to(first), 40, cache).cpu()
        diff = float((got - ref).abs().max())
        devices = {}
        for i, layer in enumerate(cache.layers):
            want = torch.device(layer_devices[i])
            wrong = [tuple(t.shape) for t in _held(layer) if t.device != want]
            devices[i] = f"{want} ({layer.engine.backend.name})"
            if wrong:
                failures.append(f"{name}: layer {i} holds tensors off {want}: {wrong}")
        report = cache.memory_report()
        if len(report.layers) != 4 or report.total_bytes <= 0:
            failures.append(f"{name}: memory report covers {len(report.layers)} layers")
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "split.kvc"
            cache.save(path)
            loaded = CompressedCache.load(path, device=layer_devices)
            more = torch.randint(3, 96, (2, 8), generator=torch.Generator().manual_seed(2)).to(first)
            with torch.no_grad():
                a = teacher_forced_logits(split, more, 3, copy.deepcopy(cache))
                b = teacher_forced_logits(split, more, 3, loaded)
            if not torch.equal(a, b):
                failures.append(f"{name}: continuation from the loaded split cache differs by {(a - b).abs().max()}")
        ok = diff < 5e-2
        if not ok:
            failures.append(f"{name}: split vs all-CPU logits differ by {diff:.3g}")
        print(f"{name:<22} max |split - cpu| {diff:.2e}  layers: {devices}  {'ok' if ok else 'FAIL'}")
    for failure in failures:
        print("FAIL:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
