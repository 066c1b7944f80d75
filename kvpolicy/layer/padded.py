"""Left-padded batches: an engine of engines, one single-row engine per batch row, fed only that row's
real tokens.

Each row then selects, quantizes and evicts exactly as if its prompt had been run alone (sinks and
windows count its real tokens, never pads), and holds no bytes for pads. Which columns are pads is read
by :mod:`kvpolicy.layer.padding` at every multi-token step (a prompt in chunks may open with chunks of
padding only); padding that is not all before a row's first token is refused there. The rows' views are
put back into one rectangular tensor whose key slots line up with transformers' padding mask:

- when demoted tokens are kept (quantize), row ``b``'s tokens fill columns ``[pad_b, L)`` of an
  ``L``-column tensor, exactly where the 2-D attention mask expects them;
- with eviction rows hold different numbers of tokens: they are right-aligned in ``N`` slots and
  the empty slots are masked by :mod:`kvpolicy.attention`'s wrapper (the 2-D padding mask cannot
  express them), so eviction of padded batches needs :func:`kvpolicy.attention.enable_scores`.

:class:`PaddedEngine` is the batch form of :class:`~kvpolicy.layer.engine.LayerEngine`: it answers the same
methods, reads the same composition and plan, and keeps its own version and path, so the cache's layer does
not know whether its batch is padded.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from kvpolicy import handoff
from kvpolicy.layer.composition import Composed
from kvpolicy.layer.padding import StepMask, leading_pads
from kvpolicy.layer.path import StepPath
from kvpolicy.memory import LayerBytes


class PaddedEngine(Composed):
    """The per-row engines of one layer for a left-padded batch.

    Parameters
    ----------
    head : LayerEngine
        The started engine of the whole batch (:class:`~kvpolicy.layer.engine.LayerEngine`, which
        builds this object; not imported here, so the two modules form no cycle): it holds no tokens, its
        composition and plan are the batch's, and :meth:`reset` returns it.
    batch : int
        Rows of the batch.

    Attributes
    ----------
    rows : list of LayerEngine
        One single-row engine per batch row (unstarted while its row has had padding only).
    pads : list of int
        The pad columns of each row so far (all before its first token).
    fed : list of int
        The tokens each row was given in the latest step (its real columns, the last of the step).
    slots : list of slice
        Where each row's view lies in the latest step's assembled keys.
    length : int
        The batch's logical length (pads included).
    path : StepPath or None
        How the latest step's attention read the history (``None``: no step yet).
    """

    def __init__(self, head: Any, batch: int) -> None:
        self.head = head
        self.composition, self.plan, self.layer_idx = head.composition, head.plan, head.layer_idx
        self.path: StepPath | None = None
        self._version = head.version
        self.rows = [head.row() for _ in range(batch)]
        self.pads = [0] * batch
        self.fed = [0] * batch
        self.keeps_demoted = head.plan.action.keeps_demoted
        self.prefilled = False
        self.slots: list[slice] = []
        self.length = 0

    @property
    def version(self) -> int:
        """Grows with every change of the rows (see ``LayerEngine.version``)."""
        return self._version

    @property
    def is_croppable(self) -> bool:
        """Whether every row can undo its latest step."""
        if not self.composition.action.compresses:
            return True
        if self.composition.policy.needs_scores:
            return False
        return all(row.is_croppable for row in self.rows)

    # ------------------------------------------------------------------ what transformers reads
    @property
    def keys(self) -> torch.Tensor:
        """Each row's full-precision keys, right-aligned in ``(batch, kv_heads, n, head_dim)`` (``n``: the most any
        row holds; zeros before a shorter row's): while nothing is demoted, row ``b``'s tokens lie in the columns
        of the attention mask that mark them, as in transformers' ``DynamicLayer`` (with zeros for pads)."""
        return self._full(0)

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._refuse_set("keys", value)

    @property
    def values(self) -> torch.Tensor:
        """Each row's full-precision values, laid out as :attr:`keys`."""
        return self._full(1)

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._refuse_set("values", value)

    def _full(self, role: int) -> torch.Tensor:
        empty = self.head.keys if role == 0 else self.head.values
        views = [
            (row.keys if role == 0 else row.values) if row.started else empty[:1] for row in self.rows
        ]  # fmt: skip
        return _assemble(views, max(v.shape[2] for v in views))

    def _refuse_set(self, name: str, value: torch.Tensor | None) -> None:
        if value is not None:
            raise RuntimeError(
                f"layer {self.layer_idx} holds a left-padded batch: its {name} are assembled from its rows "
                "(rows[b]) and cannot be set"
            )

    # ------------------------------------------------------------------ a step
    def step(
        self, key_states: torch.Tensor, value_states: torch.Tensor, grad: bool = False,
        position_ids: torch.Tensor | None = None, mask: StepMask | None = None, side: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Each row runs alone: its real tokens are appended to its engine, and the rows' views are
        assembled into one batch (``(batch, kv_heads, keys, head_dim)``). ``side`` is not read: a padded
        batch hands its ticket on its tensors only (``torch.compile`` runs such a step eagerly).

        ``position_ids`` ``(batch, n)`` and ``mask`` (this step's columns of the attention mask) say which
        columns are pads (:func:`~kvpolicy.layer.padding.leading_pads`); a decode step reads the mask only."""
        n = key_states.shape[-2]
        pads = self._pads(n, position_ids, mask)
        self._version += 1
        self.length += n
        keys, values, key_mask = self._update(key_states, value_states, pads, grad)
        self.path = StepPath("materialized", "left-padded batch (one layer per row)", self.plan.backend.name)
        if self.composition.attention == "fused" and self.plan.fused_reason is None and self.keeps_demoted:
            raise NotImplementedError(
                "CompressedCache(attention='fused') does not support left-padded batches (rows run one by one); "
                "use attention='auto', which materialises their history"
            )
        needs_scores = self.composition.policy.needs_scores
        queries = self.wants_queries
        if not needs_scores and not queries and key_mask is None:
            return keys, values
        ticket = handoff.Ticket(self, scores=needs_scores, queries=queries, key_mask=key_mask, views=(keys, values))
        return handoff.hand_out(ticket, keys.shape, values.shape, keys.dtype, keys.device)

    def _pads(self, n: int, position_ids: torch.Tensor | None, mask: StepMask | None) -> list[int]:
        """The pad columns that open each row's share of a step of ``n`` columns, refusing padding after a row's
        first token. A decode step reads the mask alone (positions are read on multi-token steps)."""
        held = [row.length for row in self.rows]
        if n > 1 or not self.prefilled:
            return leading_pads(n, held, position_ids, mask)
        return [0] * len(held) if mask is None else leading_pads(n, held, None, mask)

    def _update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, pads: list[int], grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Feed each row its real tokens; return ``(keys, values, key_mask)`` for the whole batch."""
        views = []
        for row, engine in enumerate(self.rows):
            start = pads[row]
            self.pads[row] += start
            self.fed[row] = key_states.shape[-2] - start
            k, v = key_states[row : row + 1, :, start:], value_states[row : row + 1, :, start:]
            if not self.fed[row]:  # a row that has had padding only: nothing held yet
                views.append((k, v))
                continue
            if not engine.started:
                engine.start(k, v)
            views.append(engine.step(k, v, grad))
        aligned = self.keeps_demoted or not self.prefilled  # the first step: nothing evicted yet
        self.prefilled = True
        lengths = [k.shape[2] for k, _ in views]
        width = self.length if aligned else max(lengths)
        out_k = _assemble([k for k, _ in views], width)
        out_v = _assemble([v for _, v in views], width)
        self.slots = [slice(width - n, width) for n in lengths]
        if aligned:
            return out_k, out_v, None
        key_mask = torch.zeros(len(self.rows), width, dtype=torch.bool, device=key_states.device)
        for row, slot in enumerate(self.slots):
            key_mask[row, slot] = True
        return out_k, out_v, key_mask

    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(keys returned by the next step, logical position of the first)``."""
        if self.keeps_demoted:
            return self.length + query_length, 0
        width = max(row.mask_sizes(query_length)[0] for row in self.rows)
        return width, self.length + query_length - width

    def report(self, scores: torch.Tensor | None, layout: str = "ordered") -> None:
        """Hand each row given tokens in the latest step the scores of its own key slots (``scores``:
        ``(batch, kv_heads, keys)``)."""
        for row, engine in enumerate(self.rows):
            if self.fed[row]:
                engine.report(None if scores is None else scores[row : row + 1, :, self.slots[row]])

    @property
    def wants_queries(self) -> bool:
        """Whether a row's store waits for the queries of the next forward."""
        return any(row.wants_queries for row in self.rows)

    def observe_queries(self, query: torch.Tensor, keys: torch.Tensor) -> None:
        """Hand each row the queries of its own tokens of the latest step (the last ``fed[b]``: the queries of its
        pads are left out, so a row fits what it would alone) and the keys of its own slots."""
        for row, engine in enumerate(self.rows):
            if self.fed[row]:
                q = query[row : row + 1, :, query.shape[2] - self.fed[row] :]
                engine.observe_queries(q, keys[row : row + 1, :, self.slots[row]])

    def observe(self, scores: torch.Tensor, layout: str = "ordered") -> None:
        self.head.observe(scores, layout)

    def view(self, layout: str = "ordered") -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's materialised history (:meth:`LayerEngine.view`), right-aligned as :attr:`keys` lays out
        its rows (zeros before a shorter row's): ``(batch, kv_heads, n, head_dim)`` keys and values."""
        views = [row.view(layout) if row.started else self.head.view(layout) for row in self.rows]
        width = max(keys.shape[2] for keys, _ in views)
        return _assemble([k for k, _ in views], width), _assemble([v for _, v in views], width)

    #: tokens waiting for :meth:`release`: none, rows demote at their next step
    pending = 0

    def demote_ahead(self, n: int) -> None:
        """Rows demote at their own step (a padded batch's steps run eagerly, row by row)."""

    def release(self) -> int:
        """Rows demote at their next step (nothing is released in between)."""
        return 0

    def reset(self) -> Any:
        """Forget every row; returns the engine to use from now on (the head, unstarted)."""
        self._version += 1
        return self.head.reset()

    # ------------------------------------------------------------------ batch moves and crops
    def _select(self, indices: Sequence[int]) -> None:
        """Keep/reorder/repeat rows (beam search, batch select): every per-row record moves with its row, and a
        row taken twice is copied."""
        self._version += 1
        seen: set[int] = set()
        rows = []
        for i in indices:
            rows.append(self.rows[i] if i not in seen else copy.deepcopy(self.rows[i]))
            seen.add(i)
        self.rows = rows
        self.pads = [self.pads[i] for i in indices]
        self.fed = [self.fed[i] for i in indices]
        self.slots = [self.slots[i] for i in indices] if self.slots else []

    def reorder(self, beam_idx: torch.Tensor) -> None:
        self._select(beam_idx.tolist())

    def select(self, indices: torch.Tensor) -> None:
        self._select(torch.arange(len(self.rows))[indices].tolist())

    def repeat(self, repeats: int) -> None:
        self._select([i for i in range(len(self.rows)) for _ in range(repeats)])

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` columns of every row (a row's tokens among them, then pads)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop(tokens_to_remove={tokens_to_remove}): pass a negative number of tokens to remove")
        if tokens_to_remove == 0:
            return
        k = -tokens_to_remove
        mine = [min(k, engine.length) for engine in self.rows]
        for engine, m in zip(self.rows, mine, strict=True):
            if (
                m
                and self.composition.action.compresses
                and (self.composition.policy.needs_scores or m > engine.pending)
            ):
                engine.crop(-m)  # raises, naming what cannot be removed, before any row changes
        self._version += 1
        for row, (engine, m) in enumerate(zip(self.rows, mine, strict=True)):
            engine.crop(-m)
            self.pads[row] -= k - m
        self.length -= k

    def positions(self) -> dict[str, Any]:
        """Each row's positions (see ``CompressedLayer.positions``): a list per segment."""
        per_row = [engine.positions() for engine in self.rows]
        return {key: [p[key] for p in per_row] for key in per_row[0]}

    def memory(self, seen: set[tuple[str, int]] | None = None) -> LayerBytes:
        """The rows' bytes, summed by segment."""
        parts = [engine.memory(seen) for engine in self.rows]
        merged = dict.fromkeys(parts[0].segments, 0)
        for part in parts:
            for name, n in part.segments.items():
                merged[name] = merged.get(name, 0) + n
        return LayerBytes(
            self.layer_idx, self.length, merged, sum(part.baseline_bytes for part in parts),
            max(part.element_size for part in parts),
        )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(
            f"layer {self.layer_idx} holds a left-padded batch (one layer per row); saving it is not supported"
        )

    def load_state_dict(self, state: dict[str, Any]) -> torch.Tensor | None:
        raise NotImplementedError(f"layer {self.layer_idx} holds a left-padded batch; a saved layer loads fresh")


def _assemble(views: list[torch.Tensor], width: int) -> torch.Tensor:
    """Right-align ``(1, heads, n_b, d)`` views into one zero-filled ``(batch, heads, width, d)`` tensor."""
    first = views[0]
    out = first.new_zeros((len(views), first.shape[1], width, first.shape[3]))
    for row, view in enumerate(views):
        out[row, :, width - view.shape[2] :] = view[0]
    return out
