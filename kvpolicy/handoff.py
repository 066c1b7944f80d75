"""The hand-off between ``CompressedLayer.update`` and the attention that consumes its keys.

A compressed layer's ``update`` cannot always return its history as plain tensors: on a decode
step the fused attention function (:mod:`kvpolicy.fused`) reads the quantized segment from its
packed codes, the score wrapper (:mod:`kvpolicy.attention`) must report attention mass to the
policy, and ``layout="agnostic"`` is only valid when the mask does not depend on key order. Which
of these can happen depends on the attention function the model runs, and the layer cannot know
that when ``update`` returns.

So ``update`` returns a pair of :class:`HandedOff` tensors. Each has the shape, dtype and device of
the full history it stands for, holds no storage, and carries a :class:`Ticket`: what the layer
offers (segments for fused attention, a reorderable view) and what it needs (scores, a key mask).

- kvpolicy's attention functions recognise the ticket (:func:`ticket_of`) and serve it: fused
  attention from the segments, or a materialised view in the layout the mask allows, reporting
  scores where asked.
- Any other consumer — a model's own attention after ``disable_fused``, a layer that reuses
  another layer's keys (shared-KV models), any tensor operation — goes through
  ``__torch_dispatch__``, which materialises the history in position order first. When the layer
  needs something only kvpolicy's functions can provide (scores, a key mask) or the cache was built
  with ``attention="fused"``, that raises instead of computing a wrong result.

A hand-off can therefore never be half-completed, and a placeholder never passes for a full
history. Nothing is kept in globals: a ticket holds its layer's engine (:mod:`kvpolicy.layer`) by
weak reference and dies with the tensors of the forward that consumed it. A ticket used after its
layer changed (a later update, ``crop``, a beam reorder, ``reset``) raises. A decode step that fused
attention may serve carries its parts (:class:`kvpolicy.layer.parts.Part`): fused attention reads
them from the ticket, never from the layer.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_map

from kvpolicy.layer.path import StepPath

_warned: set[str] = set()

#: the keyword through which a step traced by ``torch.compile`` hands its ticket to kvpolicy's attention functions
#: (the model passes its attention keywords on; see ``LayerEngine.step``)
TICKET_KWARG = "kvpolicy_ticket"

#: a decode step that materialises at least this many tokens because the model's attention is not
#: kvpolicy's fused function warns once (with the remedy)
LONG_HISTORY = 1024


def warn_once(message: str, key: str | None = None) -> None:
    """Issue ``message`` as a warning once per process (per ``key``, by default the message itself)."""
    key = message if key is None else key
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


class Ticket:
    """What one ``update`` of a compressed layer handed to attention.

    Parameters
    ----------
    layer : LayerEngine or PaddedEngine
        The layer's engine (held by weak reference, :mod:`kvpolicy.layer`).
    parts : list of Part, optional
        The held tokens, for fused decode attention (:mod:`kvpolicy.layer.parts`); ``None``: this
        step cannot run fused.
    basis : Basis, optional
        The transform bound to the layer (:class:`kvpolicy.transforms.base.Basis`), in whose basis the
        store's parts are held; ``None``: the model's.
    scores : bool
        Whether the layer's policy needs the attention mass of this forward.
    queries : bool
        Whether the layer's basis waits for this forward's queries (:meth:`kvpolicy.transforms.base.Basis.observe`).
    layout : {"ordered", "agnostic"}
        The view the layer would like when materialised; ``"agnostic"`` is used only when the
        consumer checked the mask.
    strict : bool
        ``attention="fused"``: a fusable step consumed by anything but the fused function raises.
    key_mask : torch.Tensor, optional
        ``(batch, keys)`` bool, False for key slots that hold no token of that row (padded batches
        with eviction); only kvpolicy's wrapper can apply it.
    views : (torch.Tensor, torch.Tensor), optional
        The materialised view, when the layer built it already (padded batches).
    version : int, optional
        The layer's version now (read from it when not given).
    """

    def __init__(
        self, layer: Any, *, parts: list[Any] | None = None, basis: Any = None, scores: bool = False,
        queries: bool = False,
        layout: str = "ordered", strict: bool = False, key_mask: torch.Tensor | None = None,
        views: tuple[torch.Tensor, torch.Tensor] | None = None, version: int | None = None,
    ) -> None:  # fmt: skip
        self._layer = weakref.ref(layer)
        self.version = layer.version if version is None else version
        self.parts = parts
        self.basis = basis
        #: whether fused decode attention may serve this step (from :attr:`parts`)
        self.fusable = parts is not None
        self.scores = scores
        self.queries = queries
        self.layout = layout
        self.strict = strict
        self.key_mask = key_mask
        self._views: dict[str, tuple[torch.Tensor, torch.Tensor]] = {} if views is None else {"ordered": views}
        self.reported = False
        self.noted = False  # the layer's path was set from this hand-off
        #: why the fused function declined this step (the path it records when it materialises)
        self.reason: str | None = None

    @property
    def wants_report(self) -> bool:
        """Whether the layer waits for :meth:`report` (scores, queries, or acknowledgement of a key mask)."""
        return self.scores or self.queries or self.key_mask is not None

    def layer(self) -> Any:
        """The layer's engine, checked to be alive and unchanged since it issued this ticket."""
        layer = self._layer()
        if layer is None:
            raise RuntimeError("a key/value tensor handed out by a CompressedCache outlived its cache")
        if layer.version != self.version:
            raise RuntimeError(
                f"a key/value tensor handed out by layer {layer.layer_idx} of a CompressedCache was used after "
                "that layer changed (a later update, crop, beam reorder or reset); attention must consume the "
                "keys and values of the update that returned them"
            )
        return layer

    def view(self, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The materialised history in ``layout`` (built once per layout)."""
        if layout not in self._views:
            self._views[layout] = self.layer().view(layout)
        return self._views[layout]

    def materialize(
        self, attention_mask: torch.Tensor | None = None, q_len: int = 1, kwargs: dict | None = None,
        *, checked: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, str]:  # fmt: skip
        """The materialised ``(keys, values, layout)`` for a consumer of kvpolicy's (``checked``: it
        passes the mask it applies) or any other (``checked=False``: position order)."""
        layer = self.layer()
        if checked and self.fusable and self.strict and self.reason is None:
            raise RuntimeError(
                f"CompressedCache(attention='fused'): layer {layer.layer_idx}'s keys reached kvpolicy's score "
                "wrapper, not its fused function. Call kvpolicy.fused.enable_fused(model) once before running "
                "the model, or use attention='auto' (materialises the history instead)."
            )
        layout = "ordered"
        note = None
        if self.layout == "agnostic":
            if not checked:
                note = (
                    "layout='agnostic' needs kvpolicy's attention wrapper (kvpolicy.fused.enable_fused or "
                    "kvpolicy.attention.enable_scores) to check the mask; the ordered view was used"
                )
            elif not reorder_safe(attention_mask, q_len, kwargs or {}):
                note = "layout='agnostic' with a mask that is not purely causal; the ordered view was used"
            else:
                layout = "agnostic"
        if not self.noted:  # the path of this hand-off is recorded once, by its first consumer
            self.noted = True
            if self.fusable:
                why = (
                    self.reason
                    or "the model's attention is not kvpolicy's fused function (kvpolicy.fused.enable_fused)"
                )
                layer.path = StepPath("materialized", why, layer.backend.name)
                if self.reason is None and layer.length >= LONG_HISTORY:
                    warn_once(
                        f"kvpolicy: decode steps rebuild the compressed history (here {layer.length} tokens) because "
                        "the model's attention is not kvpolicy's fused function; call kvpolicy.fused.enable_fused("
                        "model) once, or load the model with attn_implementation='kvpolicy_fused_sdpa', to attend "
                        "over the packed codes instead",
                        key="long history materialised",
                    )
            if note is not None:
                warn_once(f"kvpolicy: {note} (see CompressedCache.attention_paths())")
                name = layer.backend.name
                path = layer.path
                layer.path = StepPath("materialized", note, name) if path is None else path.noted(note, name)
        keys, values = self.view(layout)
        return keys, values, layout

    def report(
        self, scores: torch.Tensor | None, layout: str, queries: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        """Deliver the attention mass (``(batch, kv_heads, keys)`` in ``layout``'s key order) and, when
        :attr:`queries`, the forward's ``(query, keys)`` (``(batch, q_heads, q, head_dim)`` and the
        ``(batch, kv_heads, n, head_dim)`` history it read) once; later consumers of the same tensors
        (shared-KV layers) do not count again."""
        if self.reported:
            return
        self.reported = True
        layer = self.layer()
        if self.queries and queries is not None:
            layer.observe_queries(*queries)
        layer.report(scores, layout)

    def fused(self) -> None:
        """Fused attention served this step from :attr:`parts`: the layer records it (a stale ticket raises)."""
        layer = self._layer()
        if layer is None or layer.version != self.version:
            layer = self.layer()  # raises, naming why
        layer.path = layer.fused_path

    def foreign(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Serve a consumer that is not one of kvpolicy's attention functions: position order, or an
        error when the layer needs what only kvpolicy's functions provide."""
        layer = self.layer()
        if self.key_mask is not None:
            raise RuntimeError(
                f"layer {layer.layer_idx} holds a left-padded batch with action {layer.action.name!r}: its rows hold "
                "different numbers of tokens, and the empty key slots must be masked by kvpolicy's attention "
                "wrapper. Call kvpolicy.attention.enable_scores(model) once before running the model."
            )
        if self.scores:
            raise RuntimeError(
                f"policy {layer.policy.name!r} needs attention scores, but layer {layer.layer_idx}'s keys reached an "
                "attention function that does not report them. Call kvpolicy.attention.enable_scores(model) once "
                "before running the model: it wraps the model's sdpa/eager attention to report them "
                "(see docs/policies.md)."
            )
        if self.queries:
            raise RuntimeError(
                f"the cache's transform fits its key weights on the queries, but layer {layer.layer_idx}'s "
                "keys reached an attention function that does not report them. Call "
                "kvpolicy.attention.enable_scores(model) (or kvpolicy.fused.enable_fused(model)) once before running "
                "the model: it wraps the model's sdpa/eager attention to report them."
            )
        if self.fusable and self.strict:
            raise RuntimeError(
                f"CompressedCache(attention='fused'): layer {layer.layer_idx}'s keys reached an attention function "
                "that is not kvpolicy's fused function. Call kvpolicy.fused.enable_fused(model) once before running "
                "the model, or use attention='auto' (materialises the history instead)."
            )
        keys, values, _ = self.materialize(checked=False)
        return keys, values


def reorder_safe(attention_mask: torch.Tensor | None, q_len: int, kwargs: dict) -> bool:
    """Whether keys held before this forward may be reordered: every query sees every one of them with
    no bias (the mask over the first ``keys - q_len`` columns is all visible / all zero) and no
    sliding window is passed to the kernel."""
    if kwargs.get("sliding_window") is not None:
        return False
    if attention_mask is None:
        return True
    return all_visible(attention_mask[..., : attention_mask.shape[-1] - q_len])


def all_visible(mask: torch.Tensor) -> bool:
    """Whether ``mask`` (bool: True where visible; or additive float: 0 where visible) hides nothing."""
    return bool(mask.all() if mask.dtype == torch.bool else (mask == 0).all())


class HandedOff(torch.Tensor):
    """The keys or values of a compressed layer's history, as handed to attention.

    A tensor without storage whose shape, dtype and device are those of the history. kvpolicy's
    attention functions read its :attr:`ticket`; any other operation on it materialises the history
    in position order (or raises, see :meth:`Ticket.foreign`) and runs on that.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    ticket: Ticket
    role: int

    @staticmethod
    def __new__(cls, ticket: Ticket, role: int, like: torch.Size, dtype: torch.dtype, device: torch.device):
        out = torch.Tensor._make_wrapper_subclass(cls, like, dtype=dtype, device=device)
        out.ticket = ticket
        out.role = role
        return out

    def __repr__(self) -> str:  # no data to print
        return (
            f"HandedOff(role={'keys' if self.role == 0 else 'values'}, shape={tuple(self.shape)}, dtype={self.dtype})"
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def plain(x: Any) -> Any:
            return x.ticket.foreign()[x.role] if isinstance(x, HandedOff) else x

        return func(*tree_map(plain, args), **tree_map(plain, kwargs or {}))


def hand_out(
    ticket: Ticket, keys_shape: torch.Size, values_shape: torch.Size, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(keys, values)`` pair ``update`` returns for ``ticket``."""
    return HandedOff(ticket, 0, keys_shape, dtype, device), HandedOff(ticket, 1, values_shape, dtype, device)


def ticket_of(t: Any) -> Ticket | None:
    """The ticket of a handed-off tensor (``None`` for any other object)."""
    return t.ticket if isinstance(t, HandedOff) else None
