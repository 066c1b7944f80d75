"""Chunked prefill: a long prompt run through the model in chunks, so a compressed cache holds one
chunk at full precision at a time.

``model.generate(..., prefill_chunk_size=C)`` does this inside transformers' generation loop (a
``GenerationConfig`` field); :func:`chunked_prefill` does the same for a caller that runs the model
itself (scoring, a custom loop) and returns the output of the last chunk.

Each chunk is one multi-token update per layer: once its attention has run, the layer demotes it as
any prompt (see ``docs/explanation/architecture.md``, *When tokens are demoted*; :func:`chunked_prefill` releases
every layer after each chunk's forward, with or without the forward hook of ``enable_fused``), and the next
chunk attends over the earlier ones as a decode step would, compressed outside the policy's full-precision set. So:

- the demotions equal those of an unchunked prefill for policies whose selection depends on the length
  only (``Policy.splits_appends``: log, recent's ``sliding`` variant, sink, sinks; score-based policies
  see each chunk's attention instead of the whole prompt's), and so do the bytes held; a store with centred
  keys (``key_centre=True``, the ``kvpolicy-*`` presets) takes its centre from the first chunk's demoted keys
  rather than the whole prompt's;
- the logits equal an unchunked prefill's up to float tolerance (1e-5 in float32) while nothing is
  compressed (``action="none"``, or a prompt within the full-precision set); with compression, the later
  chunks read the earlier ones compressed, as generation reads the prompt.

A padded batch (``attention_mask``) is run as ``generate`` runs it: positions from the mask (pads at 0, each
row's tokens counted from its first), and the cache told each chunk's mask
(:meth:`~kvpolicy.cache.CompressedCache.note_attention_mask`), so that a compressed cache feeds every row
only its own tokens, even a row whose first chunks are padding only: each row then holds what it holds run
alone with its tokens split where the batch's chunks split them. Padding that is not on the left is refused
(:class:`~kvpolicy.errors.PaddingError`).

:func:`teacher_forced_logits` drives a cache the other way: a prefill, then the rest of a known sequence one
token at a time, each step's logits kept (how a cache's predictions are compared with another's, the tests' and
the lab's measure); :func:`last_only` asks a model for the last position's logits only where its forward can.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from tqdm.auto import tqdm


def check_chunk_size(chunk_size: Any) -> int:
    """``chunk_size`` if it is an integer >= 1, else ``ValueError`` naming the value and what is allowed."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(
            f"chunk_size must be an integer >= 1 (tokens per chunk; one larger than the prompt runs it in one "
            f"chunk); got chunk_size={chunk_size!r}"
        )
    return chunk_size


@torch.inference_mode()
def chunked_prefill(
    model: torch.nn.Module, input_ids: torch.Tensor, cache: Any, chunk_size: int, *,
    attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None, logits_to_keep: int = 1,
    **kwargs: Any,
) -> Any:  # fmt: skip
    """Run ``input_ids`` through ``model`` in chunks of ``chunk_size`` tokens, filling ``cache``.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM.
    input_ids : torch.Tensor
        ``(batch, n)`` token ids of the prompt (continuing what ``cache`` holds, if anything).
    cache : transformers.Cache
        The cache to fill (a :class:`kvpolicy.CompressedCache` or any other).
    chunk_size : int
        Tokens per chunk, >= 1; a value >= ``n`` runs the prompt in one chunk.
    attention_mask : torch.Tensor, optional
        ``(batch, past + n)``: 1 for a token, 0 for padding, over what ``cache`` holds and the prompt (a
        left-padded batch, as a tokenizer with ``padding_side="left"`` makes it). Each chunk is given the mask
        up to its end, and a :class:`~kvpolicy.cache.CompressedCache` is told it.
    position_ids : torch.Tensor, optional
        ``(batch, n)`` positions of the prompt's tokens; default with ``attention_mask``: as ``generate`` gives
        them (pads at 0, each row's tokens counted from its first), else the model's own (counting on from
        what ``cache`` holds).
    logits_to_keep : int, default 1
        The positions of each chunk whose logits the model computes, as ``generate`` does: 1 keeps the last
        position's; 0 keeps every position's (a chunk of ``C`` tokens then holds ``C x vocabulary`` logits:
        1,024 tokens of a model with a vocabulary of 49,152 take 200 MB in float32). Passed only to a model
        whose ``forward`` takes it (transformers' causal LMs do).
    **kwargs
        Passed to every forward.

    Returns
    -------
    transformers.utils.ModelOutput
        The output of the last chunk's forward (its ``logits`` are the last chunk's: ``(batch, 1, vocabulary)``
        by default, ``(batch, last chunk, vocabulary)`` with ``logits_to_keep=0``).

    Raises
    ------
    ValueError
        If ``chunk_size`` is not an integer >= 1, ``input_ids`` is not ``(batch, n)`` with ``n >= 1``, or
        ``attention_mask`` or ``position_ids`` do not cover it.
    PaddingError
        If ``attention_mask`` pads a row elsewhere than on the left and ``cache`` compresses.
    """
    check_chunk_size(chunk_size)
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be (batch, n) with n >= 1; got shape {tuple(input_ids.shape)}")
    batch, n = input_ids.shape
    past = cache.get_seq_length()
    if attention_mask is not None and tuple(attention_mask.shape) != (batch, past + n):
        raise ValueError(
            f"attention_mask must be (batch, past + n) = ({batch}, {past + n}) (the cache holds {past} tokens, the "
            f"prompt has {n}); got shape {tuple(attention_mask.shape)}"
        )
    if position_ids is None and attention_mask is not None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
    if position_ids is not None and (position_ids.dim() != 2 or position_ids.shape[-1] != n):
        raise ValueError(f"position_ids must be (batch, n) with n = {n}; got shape {tuple(position_ids.shape)}")
    if last_only(model):  # the model's forward takes logits_to_keep
        kwargs["logits_to_keep"] = logits_to_keep
    note = getattr(cache, "note_attention_mask", None)  # a CompressedCache reads padding from the mask
    release = getattr(cache, "release_forward", None)  # a CompressedCache; with or without enable_fused's hook
    out = None
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask[:, : past + end]
            if callable(note):
                note(kwargs["attention_mask"])
        if position_ids is not None:
            kwargs["position_ids"] = position_ids[:, start:end]
        out = model(input_ids[:, start:end], cache=cache, use_cache=True, **kwargs)
        if callable(release):
            release()
    return out


def last_only(model: torch.nn.Module) -> dict[str, int]:
    """``{"logits_to_keep": 1}`` for a model whose forward takes it, else ``{}``.

    A prefill whose logits are used at the last position only need not project every position onto
    the vocabulary (``generate`` does the same): at 2k tokens that is a ``(2048, vocab)`` float32
    tensor, 2 GB and most of the prefill's time for Gemma-3's 262k vocabulary."""
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
