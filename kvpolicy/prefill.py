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
"""

from __future__ import annotations

from typing import Any

import torch


def check_chunk_size(chunk_size: Any) -> int:
    """``chunk_size`` if it is an integer >= 1, else ``ValueError`` naming the value and what is allowed."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(
            f"chunk_size must be an integer >= 1 (tokens per chunk; one larger than the prompt runs it in one "
            f"chunk); got chunk_size={chunk_size!r}"
        )
    return chunk_size


@torch.inference_mode()
def chunked_prefill(model: torch.nn.Module, input_ids: torch.Tensor, cache: Any, chunk_size: int, **kwargs: Any) -> Any:
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
    **kwargs
        Passed to every forward (``logits_to_keep=1`` keeps only the last position's logits, as
        ``generate`` does). An ``attention_mask`` covering the prompt (``(batch, past + n)``) is sliced
        up to each chunk's end.

    Returns
    -------
    transformers.utils.ModelOutput
        The output of the last chunk's forward (its ``logits`` are the last chunk's).

    Raises
    ------
    ValueError
        If ``chunk_size`` is not an integer >= 1 or ``input_ids`` is not ``(batch, n)`` with ``n >= 1``.
    """
    check_chunk_size(chunk_size)
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be (batch, n) with n >= 1; got shape {tuple(input_ids.shape)}")
    mask = kwargs.pop("attention_mask", None)
    past = cache.get_seq_length()
    release = getattr(cache, "release_forward", None)  # a CompressedCache; with or without enable_fused's hook
    out = None
    for start in range(0, input_ids.shape[1], chunk_size):
        chunk = input_ids[:, start : start + chunk_size]
        if mask is not None:
            kwargs["attention_mask"] = mask[:, : past + start + chunk.shape[1]]
        out = model(chunk, cache=cache, use_cache=True, **kwargs)
        if callable(release):
            release()
    return out
