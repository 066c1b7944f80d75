"""The API in one screen, on a tiny random Llama built in code (no download, a few seconds).

python examples/quickstart.py
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvpolicy import CompressedCache, LogWindow, Quantize


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, 256, (1, 600))

    # strings + keywords, or objects: the same composition
    cache = CompressedCache(policy="log", window=32, action="quantize", bits=2)
    assert repr(cache) == repr(CompressedCache(policy=LogWindow(window=32), action=Quantize(bits=2)))
    print(cache)

    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), cache=cache, max_new_tokens=20,
                         do_sample=False)  # fmt: skip
    print(f"generated {out.shape[1] - prompt.shape[1]} tokens; cache length {cache.get_seq_length()}")
    pos = cache.positions(0)
    print(f"layer 0 keeps {pos['full'].numel()} positions at full precision: {pos['full'][:12].tolist()} ...")
    print(cache.memory_report())


if __name__ == "__main__":
    main()
