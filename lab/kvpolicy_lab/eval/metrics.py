"""Fidelity and cost measurements against an uncompressed cache (teacher forcing itself is the
library's: :func:`kvpolicy.prefill.teacher_forced_logits`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from kvpolicy.prefill import last_only, teacher_forced_logits
from kvpolicy_lab.quality import next_token_kl, nll

__all__ = ["Generation", "greedy_generate", "last_only", "next_token_kl", "nll", "teacher_forced_logits"]


@dataclass(frozen=True)
class Generation:
    """A greedy generation and its cost.

    Attributes
    ----------
    tokens : list of int
        Generated token ids (without the prompt).
    prefill_ms : float
        Wall time of the prefill forward.
    decode_ms_per_token : float
        Median wall time of one decode forward.
    """

    tokens: list[int]
    prefill_ms: float
    decode_ms_per_token: float


@torch.inference_mode()
def greedy_generate(
    model: torch.nn.Module,
    ids: torch.Tensor,
    cache: object,
    max_new_tokens: int,
    eos_token_ids: set[int] | None = None,
    progress: str | None = None,
) -> Generation:
    """Greedy decoding of one prompt with per-step timing (``ids``: ``(1, length)``)."""
    eos = eos_token_ids or set()
    t0 = time.perf_counter()
    logits = model(ids, cache=cache, use_cache=True, **last_only(model)).logits[:, -1]
    prefill_ms = (time.perf_counter() - t0) * 1e3
    tokens: list[int] = []
    times: list[float] = []
    for _ in tqdm(range(max_new_tokens), desc=progress, disable=progress is None, leave=False):
        nxt = int(logits.argmax(-1))
        tokens.append(nxt)
        if nxt in eos or len(tokens) == max_new_tokens:
            break
        t0 = time.perf_counter()
        logits = model(torch.tensor([[nxt]]), cache=cache, use_cache=True).logits[:, -1]
        times.append((time.perf_counter() - t0) * 1e3)
    decode = float(torch.tensor(times).median()) if times else float("nan")
    return Generation(tokens, prefill_ms, decode)
