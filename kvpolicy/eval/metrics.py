"""Fidelity and cost measurements against an uncompressed cache."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm


def last_only(model: torch.nn.Module) -> dict[str, int]:
    """``{"logits_to_keep": 1}`` for a model whose forward takes it, else ``{}``.

    A prefill whose logits are used at the last position only need not project every position onto
    the vocabulary (``generate`` does the same): at 2k tokens that is a ``(2048, vocab)`` float32
    tensor, 2 GB and most of the prefill's time for Gemma-3's 262k vocabulary."""
    import inspect

    forward = type(model).forward
    if forward not in _TAKES_LAST:
        _TAKES_LAST[forward] = "logits_to_keep" in inspect.signature(forward).parameters
    return {"logits_to_keep": 1} if _TAKES_LAST[forward] else {}


_TAKES_LAST: dict = {}


@torch.inference_mode()
def teacher_forced_logits(
    model: torch.nn.Module, ids: torch.Tensor, prefill: int, cache: object, progress: str | None = None
) -> torch.Tensor:
    """Prefill ``ids[:, :prefill]``, then feed the rest one token at a time through ``cache``.

    Parameters
    ----------
    model : torch.nn.Module
        A causal LM.
    ids : torch.Tensor
        ``(batch, length)`` token ids.
    prefill : int
        Tokens fed in the first (prefill) call.
    cache : transformers.Cache
        The cache to drive (fresh).
    progress : str, optional
        Show a progress bar with this label.

    Returns
    -------
    torch.Tensor
        ``(batch, length - prefill, vocab)`` float32: the predictions for positions
        ``prefill .. length - 1``.
    """
    out = model(ids[:, :prefill], cache=cache, use_cache=True, **last_only(model))
    steps = [out.logits[:, -1:].float()]
    for t in tqdm(range(prefill, ids.shape[1] - 1), desc=progress, disable=progress is None, leave=False):
        steps.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits.float())
    return torch.cat(steps, dim=1)


def next_token_kl(reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """``KL(p_reference || p_candidate)`` in nats at every position.

    Parameters
    ----------
    reference, candidate : torch.Tensor
        ``(..., vocab)`` logits.

    Returns
    -------
    torch.Tensor
        ``(...)`` KL divergences.
    """
    log_p = torch.log_softmax(reference.float(), dim=-1)
    log_q = torch.log_softmax(candidate.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of ``targets`` (``(...)``) under ``logits`` (``(..., vocab)``)."""
    return -torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


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
