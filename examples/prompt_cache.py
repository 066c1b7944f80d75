"""Prompt caching with a saved compressed cache: compress a long document once, answer many questions.

The document (the start of a standard-library module, ``--tokens`` long) is prefilled once into a
``CompressedCache`` and saved with ``cache.save``. Each question then starts from a fresh copy of
that cache (``CompressedCache.load``: a file another process could read) and only the question's
tokens run through the model. The example prints, per question, the answer from the loaded cache
and from re-running the whole prefill, and the time each took; then the file's size against a
saved ``DynamicCache`` of the same document.

python examples/prompt_cache.py                       # SmolLM2-135M-Instruct, 8k-token document
python examples/prompt_cache.py --tokens 2000 --questions 1   # a quicker run
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import DynamicCache

from kvpolicy import CompressedCache
from kvpolicy.fused import enable_fused
from kvpolicy_lab.eval.metrics import greedy_generate
from kvpolicy_lab.eval.models import load_smollm2
from kvpolicy_lab.eval.tasks import encode, stdlib_text

DOCUMENT = "argparse.py"
QUESTIONS = (
    "What is the name of the class that formats help messages? Answer in one sentence.",
    "Which exception is raised for an error in an argument? Answer in one sentence.",
    "What is this module for? Answer in one sentence.",
)


def split_prompt(tokenizer, document: str, question: str) -> tuple[list[int], list[int]]:
    """Ids of the chat prompt up to the end of ``document`` (shared by every question) and of the rest."""
    marker = "\x00END-OF-DOCUMENT\x00"
    messages = [
        {"role": "user", "content": f"Here is a Python module:\n\n```python\n{document}{marker}\n```\n\n{question}"}
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    head, tail = text.split(marker)
    return encode(tokenizer, head), encode(tokenizer, tail)


def save_dynamic(cache: DynamicCache, path: Path) -> int:
    """A ``DynamicCache`` saved as plainly as it gets: each layer's keys and values, one safetensors file."""
    tensors = {}
    for i, layer in enumerate(cache.layers):
        tensors[f"layers.{i}.keys"] = layer.keys.contiguous()
        tensors[f"layers.{i}.values"] = layer.values.contiguous()
    save_file(tensors, str(path))
    return path.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8000, help="document length in tokens (default 8000)")
    parser.add_argument("--questions", type=int, default=len(QUESTIONS), choices=range(1, len(QUESTIONS) + 1))
    parser.add_argument("--preset", default="kvpolicy-3.5bit", help="the cache's preset (default kvpolicy-3.5bit)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None, help="where the cache files go (default: a temp dir)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="kvpolicy-prompt-cache-"))
    out.mkdir(parents=True, exist_ok=True)

    model, tokenizer = load_smollm2()
    enable_fused(model)
    eos = {tokenizer.eos_token_id}
    source = stdlib_text(DOCUMENT)
    document = tokenizer.decode(encode(tokenizer, source)[: args.tokens])
    prefix, _ = split_prompt(tokenizer, document, QUESTIONS[0])
    print(f"document: the first {args.tokens} tokens of {DOCUMENT}; shared prompt prefix {len(prefix)} tokens")

    with torch.inference_mode():
        # warm-up: the first fused decode step loads (first run: builds) the cpu backend's kernel
        greedy_generate(model, torch.tensor([prefix[:128]]), CompressedCache.from_preset(args.preset), 2, eos)
        cache = CompressedCache.from_preset(args.preset)
        t0 = time.perf_counter()
        model(torch.tensor([prefix]), cache=cache, use_cache=True)
        prefill_s = time.perf_counter() - t0
        path = out / "document.kvc"
        t0 = time.perf_counter()
        size = cache.save(path, model=model)
        print(f"compressed prefill {prefill_s:.1f} s; saved {size / 2**20:.2f} MiB in {time.perf_counter() - t0:.2f} s "
              f"({cache!r})")  # fmt: skip
        report = cache.memory_report()
        held, sixteen = report.total_bytes, report.baseline_bytes

        dynamic = DynamicCache(config=model.config)
        model(torch.tensor([prefix]), cache=dynamic, use_cache=True)
        dynamic_size = save_dynamic(dynamic, out / "document-dynamic.safetensors")

        saved_s = []
        for question in QUESTIONS[: args.questions]:
            head, tail = split_prompt(tokenizer, document, question)
            assert head == prefix, "the shared prefix must tokenize the same for every question"
            t0 = time.perf_counter()
            loaded = CompressedCache.load(path, model=model)
            cached = greedy_generate(model, torch.tensor([tail]), loaded, args.max_new_tokens, eos)
            cached_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            fresh = greedy_generate(
                model, torch.tensor([prefix + tail]), CompressedCache.from_preset(args.preset), args.max_new_tokens, eos
            )
            fresh_s = time.perf_counter() - t0
            saved_s.append(fresh_s - cached_s)
            print(f"\nQ: {question}")
            runs = (("from the saved cache", cached, cached_s), ("re-running the prefill", fresh, fresh_s))
            for how, gen, secs in runs:
                answer = tokenizer.decode(gen.tokens, skip_special_tokens=True)
                print(f"  {how:<23}({secs:5.1f} s): {answer!r}")

    print(f"\ntime saved per question: {sum(saved_s) / len(saved_s):.1f} s on average ({len(saved_s)} questions)")
    print(f"file: {size / 2**20:.2f} MiB; held in memory: {held / 2**20:.2f} MiB (file / held = {size / held:.3f})")
    print(f"saved DynamicCache of the same prefix ({model.dtype}): {dynamic_size / 2**20:.2f} MiB, "
          f"{dynamic_size / size:.1f}x the compressed file")  # fmt: skip
    print(f"a 16-bit cache of the same tokens: {sixteen / 2**20:.2f} MiB, {sixteen / size:.1f}x the compressed file")
    print(f"files in {out}")


if __name__ == "__main__":
    main()
