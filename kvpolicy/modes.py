"""One switch for a model's attention implementation, restored on exit: :func:`decode_mode`.

kvpolicy runs a model's attention through one of three implementations:

``"fused"``
    kvpolicy's fused decode attention (:func:`kvpolicy.fused.enable_fused`): a decode step reads the
    compressed history where it lies; score-based policies get their scores.
``"scores"``
    kvpolicy's score-reporting wrapper of the model's own implementation
    (:func:`kvpolicy.attention.enable_scores`): every decode step materialises the history, score-based
    policies get their scores and ``layout="agnostic"`` has its mask checked.
``"materialized"``
    the model's own implementation (``"sdpa"``, ``"eager"``, ...), with none of kvpolicy's wrappers: what it
    ran before kvpolicy's ``kvpolicy_fused_`` / ``kvpolicy_`` prefix.

``with decode_mode(model, "fused"):`` switches ``model`` for the block and, on exit, also when the block
raises, puts back the implementation the model had and kvpolicy's forward hook as it was (installed or not).
Uses nest: each restores what the one around it set. :func:`attention_implementation` is the same
set-and-restore for any implementation registered with transformers (an analysis that captures queries,
``"eager"`` for ``output_attentions``); :func:`decode_mode` is built on it, so there is one place where a
model's implementation is switched and put back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvpolicy import attention, fused
from kvpolicy.policies.base import check_choice

#: the modes :func:`decode_mode` takes
MODES = ("fused", "materialized", "scores")


@contextmanager
def attention_implementation(model: torch.nn.Module, name: str | None = None) -> Iterator[None]:
    """Run ``model`` with attention implementation ``name`` inside the block; restore on exit.

    On exit, also when the block raises, the model runs the implementation it ran on entry again, and
    kvpolicy's forward hook (:func:`kvpolicy.attention.watch_forward`) is installed exactly when it was on
    entry: one the block installed is removed, one it removed is put back.

    Parameters
    ----------
    model : torch.nn.Module
        A transformers model (``model.config._attn_implementation``, ``model.set_attn_implementation``).
    name : str or None
        An implementation registered with transformers (``"sdpa"``, ``"eager"``, a name registered with
        ``AttentionInterface``); None leaves the implementation as it is, so that the block may switch it
        itself (:func:`decode_mode` does) and still have it restored.
    """
    previous = model.config._attn_implementation
    hooked = getattr(model, attention.HOOK_ATTR, None) is not None
    try:
        if name is not None and name != previous:
            model.set_attn_implementation(name)
        yield
    finally:
        if model.config._attn_implementation != previous:
            model.set_attn_implementation(previous)
        handle = getattr(model, attention.HOOK_ATTR, None)
        if hooked and handle is None:
            attention.watch_forward(model)
        elif not hooked and handle is not None:
            handle.remove()
            setattr(model, attention.HOOK_ATTR, None)


@contextmanager
def decode_mode(model: torch.nn.Module, mode: str) -> Iterator[None]:
    """Run ``model`` with kvpolicy's ``mode`` of attention inside the block; restore on exit.

    Parameters
    ----------
    model : torch.nn.Module
        A transformers model running ``"sdpa"`` or ``"eager"`` attention, or one of kvpolicy's wrappers of
        them (``"materialized"`` takes any implementation).
    mode : {"fused", "materialized", "scores"}
        ``"fused"``: kvpolicy's fused decode attention (:func:`kvpolicy.fused.enable_fused`, which reports
        scores too); ``"scores"``: the score-reporting wrapper of the model's own implementation
        (:func:`kvpolicy.attention.enable_scores`); ``"materialized"``: the model's own implementation, none
        of kvpolicy's wrappers.

    Raises
    ------
    ConfigError
        If ``mode`` is not one of :data:`MODES`, or (on entry; the model is left as it was) if kvpolicy does
        not wrap the model's implementation (``"fused"``, ``"scores"`` on a ``flex_attention`` model).

    Examples
    --------
    >>> with decode_mode(model, "fused"):                        # doctest: +SKIP
    ...     out = model.generate(**inputs, cache=CompressedCache(bits=2), max_new_tokens=64)
    """
    check_choice("mode", mode, MODES, "decode_mode")
    with attention_implementation(model):
        if mode == "fused":
            fused.enable_fused(model)
        else:
            fused.disable_fused(model)
            if mode == "scores":
                attention.enable_scores(model)
            else:
                attention.disable_scores(model)
        yield


__all__ = ["MODES", "attention_implementation", "decode_mode"]
