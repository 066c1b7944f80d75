"""Whether a forward continues what a cache holds, read off the positions transformers gives ``Cache.update``.

A cache holds the tokens of the forwards it served, and the next forward must continue them: its tokens' positions
follow those already seen in each row. ``generate`` called a second time with a cache already filled, and a
prompt no longer than what the cache holds, breaks that: it feeds again tokens the cache holds (or a slice of them)
at positions the cache has already seen, and the model would attend over both copies, a silently wrong result (or
fail deep inside the model when nothing is left to feed). :class:`Continuation` tells such a forward apart and
refuses it, naming the remedy.

Each row's positions are tracked as the largest seen plus one (``top``). Padding has position 0 in ``generate``, as
has a row's first real token, so a step whose positions in a row are all 0 is taken to be padding and never
refused; any other step must reach a position at least ``top`` in every row. Legitimate continuations always do:
the next token of a conversation, a later chunk of a chunked prefill, a second user turn given as the whole
conversation so far, a verification forward after ``crop`` (which lowers ``top`` by the tokens removed), and a
plain forward without position ids (the model counts on from ``get_seq_length()``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: what the refusal says to do
REMEDY = (
    "Build a new cache per generate call, or call cache.reset() before reusing it; to continue a conversation, pass "
    "the whole conversation so far (the tokens the cache holds, then the new ones)"
)


class Continuation:
    """The largest position each batch row has seen, to refuse a forward that does not continue them.

    Attributes
    ----------
    top : torch.Tensor or None
        ``(rows,)`` int64: one more than the largest position seen in each row (``rows`` is 1 when the positions
        were given for the whole batch at once), or ``None`` before the first step (and after :meth:`reset`).
    """

    def __init__(self) -> None:
        self.top: torch.Tensor | None = None

    def step(self, position_ids: torch.Tensor | None, length: int, real: torch.Tensor | None = None) -> None:
        """Check and record the positions ``(batch or 1, n)`` of a step on a cache holding ``length`` tokens.

        Positions that are not a 2-d tensor (none given, or a multimodal model's 3-d rope positions) are not read.
        ``real`` (``(batch, n)`` bool, from the forward's attention mask): the columns that are tokens; padding
        columns are not read (a row of padding only is not checked), so that padding the layers refuse is
        refused as padding.

        Raises
        ------
        ValueError
            If in some row the step's positions are not all 0 (padding) and stay below the largest position seen:
            the forward repeats tokens the cache holds instead of continuing them (the message names the remedy).
        """
        if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.numel() == 0:
            return
        positions = position_ids.detach().to(torch.int64)
        if real is not None and real.shape[-1] == positions.shape[-1]:
            positions = positions.masked_fill(~real.to(positions.device), -1)
        last = positions.amax(dim=-1)
        top = self.top
        if top is None or (top.shape[0] != last.shape[0] and 1 not in (top.shape[0], last.shape[0])):
            self.top = last + 1  # a first step (or one of another batch, which the layers refuse themselves)
            return
        top, last = torch.broadcast_tensors(top.to(last.device), last)
        behind = (last < top) & (last > 0)
        if torch.compiler.is_compiling():  # no tensor value read into Python: the check fails when the step runs
            torch._assert_async(
                ~behind.any(),
                f"CompressedCache: this forward does not continue what the cache "
                f"holds (its positions repeat ones the cache has seen). {REMEDY}",
            )
        elif bool(behind.any()):
            row = int(behind.nonzero()[0, 0])
            raise ValueError(
                f"CompressedCache: this forward does not continue what the cache holds: it holds {length} tokens, "
                f"row {row} of which reached position {int(top[row]) - 1}, and the new tokens of that row end at "
                f"position {int(last[row])}. The cache was filled by an earlier generate call (or forward), and this "
                f"one was given a prompt no longer than what it holds, so its tokens would be attended twice. {REMEDY}"
            )
        self.top = torch.maximum(top, last + 1)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch operation (reorder, select, repeat) to the rows' state; state given for the whole batch
        at once (one row) stays as it is."""
        if self.top is not None and self.top.shape[0] > 1:
            self.top = fn(self.top)

    def crop(self, tokens: int) -> None:
        """``tokens`` tokens were removed from the end of every row."""
        if self.top is not None:
            self.top = (self.top - tokens).clamp_min(0)

    def reset(self) -> None:
        """Forget every row (the cache holds nothing)."""
        self.top = None


def refuse_empty(query_length: int, length: int) -> None:
    """Refuse a forward of no tokens on a cache holding ``length`` tokens: ``generate`` feeds none when its prompt
    is no longer than what the cache holds (raises ``ValueError`` naming the remedy)."""
    if query_length == 0 and length > 0:
        raise ValueError(
            f"CompressedCache: a forward of 0 tokens on a cache holding {length}: generate was given a prompt no "
            f"longer than what the cache holds, so nothing is left to feed. {REMEDY}"
        )
