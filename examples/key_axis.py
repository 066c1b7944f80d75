"""How much does the key grouping axis matter at 2 bits? (SmolLM2-135M-Instruct, log policy)

Teacher-forced next-token loss over a continuation of a standard-library source file, for:
the uncompressed cache, LogQuant 2-bit with per-channel keys (the library default, KIVI's finding)
and LogQuant 2-bit with per-token keys (the paper's setting, the ``logquant`` preset). Values are
grouped per token in both.

    python examples/key_axis.py                   # ~2 min on 2 CPU cores
    python examples/key_axis.py --context 1024 --continuation 128
"""

from __future__ import annotations

import argparse

import torch

from kvpolicy import CompressedCache
from kvpolicy_lab.eval.demo import FIDELITY_FILE, stdlib_source
from kvpolicy_lab.eval.metrics import next_token_kl, nll, teacher_forced_logits
from kvpolicy_lab.eval.models import load_smollm2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--continuation", type=int, default=256)
    parser.add_argument("--bits", type=int, default=2)
    args = parser.parse_args()

    model, tokenizer = load_smollm2()
    ids = tokenizer(stdlib_source(FIDELITY_FILE), return_tensors="pt")["input_ids"]
    ids = ids[:, : args.context + args.continuation]
    targets = ids[:, args.context :]
    configs = {
        "uncompressed": dict(action="none"),
        # min-max groups of 64 either way (the comparison docs/explanation/quantization.md quotes)
        "keys per channel": dict(bits=args.bits, key_axis="channel", value_axis="token", group_size=64, fit="minmax"),
        "keys per token": dict(bits=args.bits, key_axis="token", value_axis="token", group_size=64, fit="minmax"),
    }
    ref = None
    print(f"SmolLM2-135M, {FIDELITY_FILE}: {args.context} context + {args.continuation} teacher-forced tokens, "
          f"log policy (W=42), {args.bits}-bit, group 64")  # fmt: skip
    print(f"{'cache':<18}{'NLL nats':>10}{'ΔNLL':>10}{'± s.e.':>9}{'KL nats':>10}{'bytes':>12}")
    for name, kwargs in configs.items():
        cache = CompressedCache(policy="log", **kwargs)
        logits = teacher_forced_logits(model, ids, args.context, cache, progress=name)
        loss = nll(logits, targets)[0]
        if ref is None:
            ref, ref_loss = logits, loss
        delta = loss - ref_loss
        se = delta.std() / len(delta) ** 0.5
        kl = next_token_kl(ref, logits).mean()
        print(f"{name:<18}{loss.mean():>10.4f}{delta.mean():>+10.4f}{se:>9.4f}{kl:>10.4f}"
              f"{cache.memory_report().total_bytes / 2**20:>9.2f} MiB")  # fmt: skip


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
