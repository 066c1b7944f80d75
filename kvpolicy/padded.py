"""Left-padded batches: one single-row layer per batch row, fed only that row's real tokens.

Each row then selects, quantizes and evicts exactly as if its prompt had been run alone (sinks and
windows count its real tokens, never pads), and holds no bytes for pads. The rows' views are put
back into one rectangular tensor whose key slots line up with transformers' padding mask:

- when demoted tokens are kept (quantize), row ``b``'s tokens fill columns ``[pad_b, L)`` of an
  ``L``-column tensor, exactly where the 2-D attention mask expects them;
- with eviction rows hold different numbers of tokens: they are right-aligned in ``N`` slots and
  the empty slots are masked by :mod:`kvpolicy.attention`'s wrapper (the 2-D padding mask cannot
  express them), so eviction of padded batches needs :func:`kvpolicy.attention.enable_scores`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch


def left_pads(position_ids: torch.Tensor | None, n: int) -> list[int] | None:
    """Leading pad count of each row of a left-padded prefill, or ``None`` if rows are not padded.

    ``generate`` gives pads position 0 and real tokens ``0, 1, ...``; a row with ``r`` real tokens
    ends at position ``r - 1``.
    """
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[0] < 2:
        return None
    if not bool((position_ids != position_ids[:1]).any()):
        return None
    pads = [n - 1 - int(p) for p in position_ids[:, -1].tolist()]
    for row, pad in enumerate(pads):
        real = position_ids[row, pad:].tolist()
        if pad < 0 or real != list(range(n - pad)):
            raise NotImplementedError(
                "CompressedCache supports left-padded batches only (pads first, then positions 0, 1, ...); "
                f"row {row} has position_ids {position_ids[row].tolist()}"
            )
    return pads


class PaddedRows:
    """The per-row layers of one cache layer for a left-padded batch.

    Parameters
    ----------
    rows : list
        One single-row ``CompressedLayer`` per batch row.
    pads : list of int
        Leading pads of each row in the prefill.
    keeps_demoted : bool
        Whether the action keeps demoted tokens (then every row returns all its tokens).
    """

    def __init__(self, rows: list[Any], pads: list[int], keeps_demoted: bool) -> None:
        self.rows = rows
        self.pads = pads
        self.keeps_demoted = keeps_demoted
        self.prefilled = False
        self.slots: list[slice] = []

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Feed each row its real tokens; return ``(keys, values, key_mask)`` for the whole batch.

        ``length`` is the batch's logical length after this update (pads included).
        """
        views = []
        for row, layer in enumerate(self.rows):
            start = 0 if self.prefilled else self.pads[row]
            views.append(layer.update(key_states[row : row + 1, :, start:], value_states[row : row + 1, :, start:]))
        aligned = self.keeps_demoted or not self.prefilled  # prefill: nothing evicted yet
        self.prefilled = True
        lengths = [k.shape[2] for k, _ in views]
        width = length if aligned else max(lengths)
        out_k = _assemble([k for k, _ in views], width)
        out_v = _assemble([v for _, v in views], width)
        self.slots = [slice(width - n, width) for n in lengths]
        if aligned:
            return out_k, out_v, None
        key_mask = torch.zeros(len(self.rows), width, dtype=torch.bool, device=key_states.device)
        for row, slot in enumerate(self.slots):
            key_mask[row, slot] = True
        return out_k, out_v, key_mask

    def mask_sizes(self, query_length: int, length: int) -> tuple[int, int]:
        """``(keys returned by the next update, logical position of the first)``; ``length`` is the
        batch's logical length before it."""
        if self.keeps_demoted:
            return length + query_length, 0
        width = max(layer.get_mask_sizes(query_length)[0] for layer in self.rows)
        return width, length + query_length - width

    def attention_done(self, scores: torch.Tensor | None) -> None:
        """Hand each row the scores of its own key slots (``scores``: ``(batch, kv_heads, keys)``)."""
        for row, layer in enumerate(self.rows):
            layer.attention_done(None if scores is None else scores[row : row + 1, :, self.slots[row]])

    def select(self, indices: Sequence[int]) -> None:
        """Keep/reorder/repeat rows (beam search, batch select); repeated rows are copied."""
        seen: set[int] = set()
        rows, pads = [], []
        for i in indices:
            rows.append(self.rows[i] if i not in seen else copy.deepcopy(self.rows[i]))
            pads.append(self.pads[i])
            seen.add(i)
        self.rows, self.pads = rows, pads


def _assemble(views: list[torch.Tensor], width: int) -> torch.Tensor:
    """Right-align ``(1, heads, n_b, d)`` views into one zero-filled ``(batch, heads, width, d)`` tensor."""
    first = views[0]
    out = first.new_zeros((len(views), first.shape[1], width, first.shape[3]))
    for row, view in enumerate(views):
        out[row, :, width - view.shape[2] :] = view[0]
    return out
