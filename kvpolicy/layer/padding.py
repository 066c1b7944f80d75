"""Which columns of a step are padding, read from what marks them; plain torch, no transformers.

A compressed layer serves a padded batch one row at a time (:mod:`kvpolicy.layer.padded`), so it must know
exactly which columns of each row are tokens. Two things can say so:

- the 2-D attention mask of the forward (:class:`StepMask`: this step's columns of it), when the cache was
  told it (:meth:`kvpolicy.cache.CompressedCache.note_attention_mask`: kvpolicy's forward hook and
  :func:`kvpolicy.prefill.chunked_prefill` tell it). It decides alone;
- else the positions of every column that transformers passes to ``Cache.update``, read with the convention
  of ``generate``: a pad has position 0 and a row's tokens count ``0, 1, ...`` from its first one.

Served is left padding: in each row, every pad comes before the row's first token, and from then on every
column is a token (a prompt in chunks may begin with chunks of padding only). Anything else (right padding,
a hole in the mask, padding that appears after a row's first token, a later forward padded differently) is
refused with :class:`~kvpolicy.errors.PaddingError`, naming the row and the remedy.

Positions alone cannot tell every layout apart: a row whose first token is followed by padding (right
padding of a one-token row, a hole just after the first token), or a chunk of padding only, gives the same
positions as a left-padded row. Read from positions, such a row is taken as left-padded; a later step whose
positions contradict that reading (a chunked prompt) is refused. The mask, when the cache is told it, leaves
no such case.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpolicy.errors import PaddingError

#: what to do about padding a compressed cache cannot serve
REMEDY = (
    'pad on the left (tokenizer padding_side="left": pads first, then each row\'s tokens), or run the rows as '
    'separate batches; action="none" serves any padding, as DynamicCache does'
)
#: how to let the cache read padding from the attention mask rather than from positions
MASK_REMEDY = (
    "let the cache read the attention mask: kvpolicy.attention.enable_scores(model) or "
    "kvpolicy.fused.enable_fused(model) (their forward hook hands it over), or "
    "kvpolicy.prefill.chunked_prefill(model, ids, cache, chunk, attention_mask=mask)"
)


@dataclass(frozen=True)
class StepMask:
    """This step's columns of the forward's 2-D attention mask.

    Parameters
    ----------
    columns : torch.Tensor
        ``(batch, n)`` bool: True for a token, False for padding.
    padded : bool
        Whether any column is padding (computed once per forward by the cache).
    """

    columns: torch.Tensor
    padded: bool


def refuse(row: int | None, seen: str, why: str) -> PaddingError:
    """The error for padding a compressed layer cannot serve (raise it): the row, what was seen, the remedy."""
    where = "" if row is None else f" row {row}:"
    return PaddingError(
        f"CompressedCache cannot serve this padding:{where} {seen}; {why}. A compressed cache serves left padding "
        f"only (every pad before the row's first token); {REMEDY}"
    )


def is_padded(position_ids: torch.Tensor | None, mask: StepMask | None, batch: int) -> bool:
    """Whether a step shows padding to a layer that holds an unpadded batch (or nothing yet).

    With a mask: any column of padding. Else with positions ``(batch or 1, n)``: rows that differ, or a row
    whose positions do not count up by one (pads have position 0). Neither: not padded (nothing marks it).
    """
    if mask is not None:
        return mask.padded
    ids = _positions(position_ids, batch)
    if ids is None:
        return False
    consecutive = bool((ids[:, 1:] - ids[:, :-1] == 1).all()) if ids.shape[1] > 1 else True
    return not consecutive or (ids.shape[0] > 1 and bool((ids != ids[:1]).any()))


def rows_differ(position_ids: torch.Tensor | None, mask: StepMask | None, batch: int) -> bool:
    """Whether a later multi-token step of an unpadded batch shows padding: a column of padding in the mask,
    else rows whose positions differ (a step may repeat or skip positions, a tree of drafts does, but the same
    in every row)."""
    if mask is not None:
        return mask.padded
    ids = _positions(position_ids, batch)
    return ids is not None and ids.shape[0] > 1 and bool((ids != ids[:1]).any())


def leading_pads(n: int, held: Sequence[int], position_ids: torch.Tensor | None, mask: StepMask | None) -> list[int]:
    """The pad columns before each row's tokens in a step of ``n`` columns of a padded batch.

    Parameters
    ----------
    n : int
        Columns of the step.
    held : sequence of int
        Tokens each row holds before the step (0: the row has had padding only so far).
    position_ids : torch.Tensor, optional
        ``(batch or 1, n)`` positions of the step's columns.
    mask : StepMask, optional
        The step's columns of the attention mask; decides alone when given.

    Returns
    -------
    list of int
        Per row, the pads that open the step (``n``: the whole step is padding; 0 for a row that holds
        tokens already). Neither mask nor positions: 0 for every row (nothing marks padding).

    Raises
    ------
    PaddingError
        A row whose padding is not all before its first token.
    """
    if mask is not None:
        if not mask.padded:  # every column a token (read without copying the mask to the host)
            return [0] * len(held)
        return [_mask_row(row, cols, held[row]) for row, cols in enumerate(mask.columns.tolist())]
    ids = _positions(position_ids, len(held))
    if ids is None:
        return [0] * len(held)
    return [_position_row(row, p, held[row]) for row, p in enumerate(ids.tolist())]


def _positions(position_ids: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """``position_ids`` as ``(batch, n)``, or None when they are not 2-D positions of this batch (absent,
    multimodal 3-D positions)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2:
        return None
    if position_ids.shape[0] == 1 and batch > 1:
        return position_ids.expand(batch, -1)
    return position_ids if position_ids.shape[0] == batch else None


def _mask_row(row: int, cols: list[bool], held: int) -> int:
    """Leading pads of one row's mask columns (``held`` tokens before them)."""
    pads = next((i for i, c in enumerate(cols) if c), len(cols))
    if held and pads:
        raise refuse(row, f"the attention mask marks padding after the row's first token (columns {_bits(cols)})",
                     "its tokens would not be one run")  # fmt: skip
    if not all(cols[pads:]):
        raise refuse(row, f"the attention mask has padding after a token (columns {_bits(cols)})",
                     "right padding or a hole in the mask")  # fmt: skip
    return pads


def _position_row(row: int, p: list[int], held: int) -> int:
    """Leading pads of one row read from its positions (``held`` tokens before them)."""
    n = len(p)
    if held:
        if p != list(range(held, held + n)):
            raise refuse(
                row, f"its positions {_few(p)} do not continue its {held} token(s)",
                "a pad after the row's first token (right padding, a hole in the mask), or a chunk read as one "
                "token followed by padding: positions alone cannot tell a pad at position 0 from a row's first "
                f"token. To serve a chunked prompt of a padded batch, {MASK_REMEDY}",
            )  # fmt: skip
        return 0
    real = p[-1] + 1
    pads = n - real
    if real < 1 or pads < 0 or p[pads:] != list(range(real)) or any(p[:pads]):
        raise refuse(
            row, f"its positions {_few(p)} are not pads at position 0 followed by positions 0, 1, ...",
            "right padding or a hole in the mask (generate gives pads position 0 and counts each row's tokens from 0)",
        )  # fmt: skip
    return pads


def _few(values: list[int], most: int = 24) -> str:
    """``values`` for a message, the middle left out when long."""
    if len(values) <= most:
        return str(values)
    return f"[{', '.join(map(str, values[: most // 2]))}, ..., {', '.join(map(str, values[-most // 2 :]))}]"


def _bits(cols: list[bool]) -> str:
    """A mask row as ``0``/``1`` characters for a message."""
    text = "".join("1" if c else "0" for c in cols)
    return text if len(text) <= 64 else f"{text[:32]}...{text[-32:]}"
