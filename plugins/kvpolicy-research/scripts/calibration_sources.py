"""Where the calibrated rotation's statistics should come from: the prompt, or calibration texts.

Per layer of SmolLM2-135M-Instruct, on held-out texts (the frontier's, ``LM_FILES``), the keys and values of a
2,048-token prompt are coded as kvpolicy-3bit's older tier codes them (3-bit centred codebook keys, 2-bit
codebook values, 8-bit norms) behind:

- ``hadamard``: the plain rotation;
- ``prompt``: the calibrated rotation fitted on the prompt itself (the shipped ``"calibrated-hadamard"``);
- ``file``: the same rotations fitted on statistics measured over calibration texts (``CALIBRATION_FILES``,
  disjoint from the held-out ones) by :func:`kvpolicy_research.calibration.measure`.

Reported per variant, averaged over layers and texts: the relative error of the scores of the prompt's last
256 queries (``‖q (k̂ - k)ᵀ‖² / ‖q kᵀ‖²``), and the relative error of their attention outputs over the whole
prompt. An attention-level measurement, not the model's KL. Needs the lab (``pip install -e lab``)::

    python plugins/kvpolicy-research/scripts/calibration_sources.py --texts 3 --calibration-texts 3
"""

from __future__ import annotations

import argparse

import torch
from kvpolicy_research import calibration
from kvpolicy_research.calibrated import CalibratedRotation
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvpolicy.actions.quantize import Quantize
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.transforms import BindContext, Hadamard
from kvpolicy_lab.eval.models import load_smollm2
from kvpolicy_lab.eval.tasks import CALIBRATION_FILES, LanguageModeling

CONTEXT, QUERIES = 2048, 256


def record(model, ids):
    """Each layer's post-RoPE queries, keys and values of one forward over ``ids``."""
    seen = {}

    def hook(module, query, key, value, attention_mask, **kw):
        seen[module.layer_idx] = (query.detach(), key.detach(), value.detach())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("calibration_sources", hook)
    before = model.config._attn_implementation
    model.set_attn_implementation("calibration_sources")
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        model.set_attn_implementation(before)
    return seen


def coded(basis, q, k, v):
    """Keys and values of one layer back from kvpolicy-3bit's older tier behind ``basis``."""
    store = Quantize(key_bits=3, value_bits=2, scheme="codebook", key_centre=True, norm_bits=8).new_store(
        TorchBackend(), 0
    )
    n = k.shape[2]
    store.positions = torch.empty(1, 0, dtype=torch.int32)
    if basis.wants_queries:
        basis.observe(q, k)
    if not basis.fitted:
        basis.fit(k, v)
    basis.add(store, k, v, torch.arange(n, dtype=torch.int32)[None])
    return basis.unmap_keys(store.keys(), store.positions), basis.unmap_values(store.values())


def errors(q, k, v, k_hat, v_hat):
    group = q.shape[1] // k.shape[1]
    qs = q[:, :, -QUERIES:].double()
    kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    kh, vh = k_hat.double().repeat_interleave(group, 1), v_hat.double().repeat_interleave(group, 1)
    s, s_hat = qs @ kk.mT, qs @ kh.mT
    score = float((s_hat - s).pow(2).sum() / s.pow(2).sum())
    scale = q.shape[-1] ** -0.5
    out = torch.softmax(s * scale, -1) @ vv
    out_hat = torch.softmax(s_hat * scale, -1) @ vh
    return score, float((out_hat - out).pow(2).sum() / out.pow(2).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--texts", type=int, default=3)
    parser.add_argument("--calibration-texts", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    calib = LanguageModeling(samples_per_context=args.calibration_texts, tokens=1, files=CALIBRATION_FILES)
    held = LanguageModeling(samples_per_context=args.texts, tokens=1)
    texts = [torch.tensor([s.ids[:CONTEXT]]) for s in calib.samples(tokenizer, CONTEXT, 0)]
    stats = calibration.measure(model, texts)
    variants = {}
    for rotate_values in (True, False):
        t = CalibratedRotation(rotate_values=rotate_values)
        variants[f"file{'' if rotate_values else '-keys'}"] = (t, stats.rotations(t))
        variants[f"prompt{'' if rotate_values else '-keys'}"] = (t, None)
    sums: dict[str, list[float]] = {"hadamard": [0.0, 0.0], **{name: [0.0, 0.0] for name in variants}}
    count = 0
    for sample in held.samples(tokenizer, CONTEXT, 0):
        layers = record(model, torch.tensor([sample.ids[:CONTEXT]]))
        for i, (q, k, v) in layers.items():
            context = BindContext.of(i, k, v, model.config)
            runs = {"hadamard": Hadamard(0).bind(context)}
            for name, (t, rot) in variants.items():
                basis = t.bind(context)
                if rot is not None:  # the file's rotations for this layer, as a fitted basis holds them
                    basis.key_basis, basis.key_weights = rot[0][i : i + 1].clone(), rot[1][i : i + 1].clone()
                    basis.value_basis = rot[2][i : i + 1].clone() if t.rotate_values else None
                runs[name] = basis
            for name, basis in runs.items():
                k_hat, v_hat = coded(basis, q, k, v)
                e = errors(q, k, v, k_hat, v_hat)
                sums[name][0] += e[0]
                sums[name][1] += e[1]
            count += 1
    print(f"SmolLM2-135M, {args.texts} held-out texts x 30 layers, context {CONTEXT}, last {QUERIES} queries")
    print("| rotation | score rel. error | attention output rel. error |\n|---|---|---|")
    for name, (a, b) in sums.items():
        print(f"| {name} | {a / count:.5f} | {b / count:.5f} |")


if __name__ == "__main__":
    main()
