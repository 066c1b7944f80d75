"""One layer's engine in plain torch: the held tokens, the policy loop and what to hand attention.

:class:`LayerEngine` owns a :class:`~kvpolicy.layer.held.HeldTokens` (the tokens, by segment) and adds what
a step needs beyond them: the plan of its first update (:meth:`Composition.plan
<kvpolicy.layer.composition.Composition.plan>`), the decision what to hand attention (plain tensors, or a
:mod:`kvpolicy.handoff` pair whose ticket carries the parts fused attention reads, :mod:`kvpolicy.layer.parts`),
the path the step took (:mod:`kvpolicy.layer.path`) and the version that makes stale hand-offs fail. A
left-padded batch is the engine's batch form, an engine of engines behind the same methods
(:class:`~kvpolicy.layer.padded.PaddedEngine`). Both read the cache's one
:class:`~kvpolicy.layer.composition.Composition` and the layer's :class:`~kvpolicy.layer.composition.Plan`.

It knows nothing of transformers: :class:`kvpolicy.cache.CompressedLayer` translates transformers'
calls into these methods, and ``tests/layer/`` drives it with bare tensors.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from kvpolicy import handoff, state_check
from kvpolicy.layer.composition import Composed, Composition, Plan
from kvpolicy.layer.held import SEGMENTS, HeldTokens
from kvpolicy.layer.padded import PaddedEngine
from kvpolicy.layer.padding import MASK_REMEDY, StepMask, is_padded, refuse, rows_differ
from kvpolicy.layer.parts import Part
from kvpolicy.layer.path import FULL_PRECISION, HANDED_OUT, StepPath
from kvpolicy.memory import LayerBytes

#: the warning (once per process) of a padded batch whose padding was read from positions alone
POSITIONS_ONLY = (
    "CompressedCache: this batch is padded, and no attention mask reached the cache (transformers hands a cache "
    "only the positions of each column), so its padding was read from positions: a row whose first token is "
    "followed by padding (right padding of a one-token row, a hole just after the first token) reads as left "
    "padding and is served as such. To have every layout read exactly (and refused when it cannot be served), "
    f"{MASK_REMEDY}; kvpolicy.attention.watch_forward(model) installs the hook alone"
)


class LayerEngine(Composed):
    """One layer of a compressed cache, in plain torch.

    Parameters
    ----------
    composition : Composition
        The cache's parts, shared with every layer (read, never copied).
    layer_idx : int
        The layer's index (error messages, per-layer stores and widths).
    plan : Plan, optional
        A row of a padded batch: its batch's plan (a row plans nothing itself).
    internal : bool
        A row of a padded batch: every step returns plain tensors to its :class:`PaddedEngine`.

    Attributes
    ----------
    plan : Plan or None
        The layer's resolution of the composition, decided at :meth:`start` (``None`` before).
    held : HeldTokens or None
        The tokens (``None`` until :meth:`start`).
    path : StepPath or None
        How the latest step's attention read the history (``None``: no step yet).
    """

    def __init__(
        self, composition: Composition, layer_idx: int, plan: Plan | None = None, internal: bool = False
    ) -> None:  # fmt: skip
        self.composition = composition
        self.layer_idx = layer_idx
        self.plan = plan
        self.internal = internal
        self.held: HeldTokens | None = None
        self.path: StepPath | None = None
        self.fused_path: StepPath | None = None
        self._unfused_path: StepPath | None = None
        self._version = 0
        #: the ticket of the latest multi-token hand-off (None: plain tensors, or a decode step), see release
        self._handed: weakref.ref[handoff.Ticket] | None = None

    # ------------------------------------------------------------------ what is held
    @property
    def started(self) -> bool:
        return self.held is not None

    @property
    def version(self) -> int:
        """Grows with every change of the held tokens (steps, crops, beam moves, demotions applied by
        an inspection); a hand-off of an older version is refused (:mod:`kvpolicy.handoff`)."""
        return self._version if self.held is None else self._version + self.held.moves

    @property
    def length(self) -> int:
        """Tokens seen (the logical length)."""
        return 0 if self.held is None else self.held.length

    @property
    def keys(self) -> torch.Tensor | None:
        """The full-precision segment's keys, ``(batch, kv_heads, n_full, head_dim)``."""
        return None if self.held is None else self.held.keys

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._set_held("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        """The full-precision segment's values, ``(batch, kv_heads, n_full, head_dim_v)``."""
        return None if self.held is None else self.held.values

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._set_held("values", value)

    def _set_held(self, name: str, value: torch.Tensor | None) -> None:
        if self.held is not None:
            setattr(self.held, name, value)
        elif value is not None:
            raise RuntimeError(f"layer {self.layer_idx} holds no tokens yet; its {name} cannot be set")

    @property
    def pending(self) -> int:
        """Tokens of the latest multi-token step whose demotion waits for :meth:`release`."""
        return 0 if self.held is None else self.held.pending

    @property
    def is_croppable(self) -> bool:
        """Whether :meth:`crop` can undo the latest step now (see ``CompressedLayer.is_croppable``)."""
        if not self.composition.action.compresses:
            return True
        if self.composition.policy.needs_scores:
            return False
        return self.held is None or self.held.is_croppable

    # ------------------------------------------------------------------ starting
    def start(
        self, key_states: torch.Tensor, value_states: torch.Tensor, position_ids: torch.Tensor | None = None,
        mask: StepMask | None = None,
    ) -> LayerEngine | PaddedEngine:  # fmt: skip
        """Plan for ``key_states``/``value_states`` (``(batch, kv_heads, n, head_dim)``: device, dtype,
        head dims) and start empty segments shaped like them. Returns this engine, or the
        :class:`~kvpolicy.layer.padded.PaddedEngine` over it when the first step is padded (with compression):
        ``mask`` (its columns of the attention mask) says so, else ``position_ids`` (``(batch, n)``) do
        (:func:`~kvpolicy.layer.padding.is_padded`). A row of a padded batch keeps its batch's plan."""
        if not self.internal:
            self.plan = self.composition.plan(self.layer_idx, key_states, value_states)
        reason, name = self.plan.fused_reason, self.plan.backend.name
        #: the paths of a decode step served fused, and of one this composition cannot fuse
        self.fused_path = StepPath("fused", None, name)
        self._unfused_path = None if reason is None else StepPath("materialized", reason, name)
        book = None if self.internal else self.composition.book  # a row's positions are its own
        held = HeldTokens(self.composition, self.plan, self.layer_idx, book)
        held.start(key_states, value_states)
        self._drop()
        self.held = held
        if self.plan.action.compresses and is_padded(position_ids, mask, key_states.shape[0]):
            if mask is None:
                handoff.warn_once(POSITIONS_ONLY)
            return PaddedEngine(self, key_states.shape[0])
        return self

    def row(self) -> LayerEngine:
        """An unstarted engine for one row of a padded batch (this engine's plan, plain tensors)."""
        return LayerEngine(self.composition, self.layer_idx, self.plan, internal=True)

    def _drop(self) -> None:
        """Forget the held tokens, keeping :attr:`version` growing."""
        if self.held is not None:
            self._version += self.held.moves
        self._version += 1
        self.held = None

    def reset(self) -> LayerEngine:
        """Forget everything held; returns the engine to use from now on (this one, unstarted)."""
        self._drop()
        self.path = None
        return self

    # ------------------------------------------------------------------ a step
    def step(
        self, key_states: torch.Tensor, value_states: torch.Tensor, grad: bool = False,
        position_ids: torch.Tensor | None = None, mask: StepMask | None = None, side: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Append ``key_states``/``value_states`` (``(batch, kv_heads, n, head_dim)``) and return the keys
        and values attention must use (:meth:`mask_sizes` announced how many): plain tensors, or a
        hand-off (:mod:`kvpolicy.handoff`).

        ``grad``: autograd records this step and the new keys or values require gradients (a hand-off
        materialises below autograd, so such a step gets plain position-ordered tensors, see
        :meth:`_hand_out`). A step that shows padding (``mask``: its columns of the attention mask; else for a
        multi-token step ``position_ids`` ``(batch, n)`` whose rows differ) is refused: this batch was not padded
        in its first step, and padding that appears later cannot be served.

        ``side``: the keywords the model passes on to its attention function (``None``: not known). While
        ``torch.compile`` traces the step, the hand-off cannot be a tensor subclass: the step returns the
        materialised history (right for any consumer) and puts the ticket in ``side``, from which kvpolicy's
        attention functions read it (:data:`kvpolicy.handoff.TICKET_KWARG`); the materialisation is then dead
        code the compiler drops."""
        held = self.held
        keys = held.keys
        if (keys.shape[0], keys.shape[1], keys.shape[-1], held.values.shape[-1], keys.dtype) != (
            key_states.shape[0], key_states.shape[1], key_states.shape[-1], value_states.shape[-1], key_states.dtype
        ):  # fmt: skip
            self._refuse_shape(key_states, value_states)
        self._version += 1
        n = key_states.shape[-2]
        if not self.plan.action.compresses:
            held.append(key_states, value_states)
            return held.keys, held.values
        if (mask is not None or n > 1) and rows_differ(position_ids, mask, key_states.shape[0]):
            raise refuse(
                None, "this step pads its rows differently from the first forward (new padding after the first "
                "step)", "the rows' tokens would not line up with what the cache holds",
            )  # fmt: skip
        held.append(key_states, value_states)
        return self._hand_out(n, grad, side)

    def _refuse_shape(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Refuse tensors that do not continue what the layer holds (another model's keys reaching a
        loaded cache, say) with the difference named, before anything changes."""
        keys, values = self.held.keys, self.held.values
        held = (keys.shape[0], keys.shape[1], keys.shape[-1], values.shape[-1], keys.dtype)
        new = (key_states.shape[0], key_states.shape[1], key_states.shape[-1], value_states.shape[-1], key_states.dtype)
        names = ("batch", "kv_heads", "key head_dim", "value head_dim", "dtype")
        diff = ", ".join(f"{n} {a} -> {b}" for n, a, b in zip(names, held, new, strict=True) if a != b)
        raise ValueError(
            f"layer {self.layer_idx} of this CompressedCache holds {self.length} tokens whose shape the new keys "
            f"and values do not continue ({diff}); a cache serves one model, one batch and one dtype"
        )

    def _hand_out(self, n: int, grad: bool, side: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """What :meth:`step` returns: plain tensors when any consumer may use them as they are, else a
        hand-off that kvpolicy's attention functions serve and any other consumer materialises in
        position order (or refuses).

        ``grad``: a hand-off materialises below autograd, so it would cut the graph of keys or values
        that require gradients: such a step gets plain position-ordered tensors (score-based policies
        still go through kvpolicy's wrapper, which materialises above autograd)."""
        segments = self.held
        # HeldTokens.holds_demoted, inlined (len(store), inlined)
        held = self.plan.action.keeps_demoted and segments.store.positions.shape[-1] > 0
        scores = self.composition.policy.needs_scores
        basis = segments.basis
        queries = basis is not None and basis.wants_queries
        reason = self.plan.fused_reason
        if scores:
            segments.scored = False
        if not held:
            self.path = FULL_PRECISION  # nothing compressed to read: the plain view is the segment
        elif reason is not None:
            self.path = self._unfused_path
        elif n > 1:
            self.path = StepPath("materialized", "multi-token update", self.plan.backend.name)
        elif grad:
            if self.composition.attention == "fused" and not self.internal:
                raise RuntimeError(
                    f"CompressedCache(attention='fused'): layer {self.layer_idx}'s forward records gradients, which "
                    "the fused decode path does not propagate; run under torch.no_grad()/inference_mode(), or use "
                    "attention='auto'"
                )
            self.path = StepPath(
                "materialized", "autograd is recording (the fused path computes no gradients)", self.plan.backend.name
            )
        else:
            self.path = HANDED_OUT  # set by whoever consumes it
        fusable = n == 1 and held and reason is None and not grad
        layout = self.composition.layout
        agnostic = layout == "agnostic" and held and not grad
        self._handed = None
        if self.internal or not (fusable or agnostic or scores or queries):
            return self.view("ordered")
        parts = None
        if fusable:  # the store's parts, then the full-precision segment
            parts = segments.store.parts()
            parts.append(Part(segments.keys, segments.values))
        ticket = handoff.Ticket(
            self, parts=parts, basis=basis, scores=scores, queries=queries,
            layout=layout if agnostic else "ordered", strict=self.composition.attention == "fused",
            version=self._version + segments.moves,
        )  # fmt: skip
        if torch.compiler.is_compiling():
            return self._traced(ticket, side)
        if n > 1:  # only a multi-token update is released later (decode steps demote in step)
            self._handed = weakref.ref(ticket)
        keys, values = segments.keys, segments.values
        b, h, count, d = keys.shape
        if held:
            count = segments.length
        return (
            handoff.HandedOff(ticket, 0, torch.Size((b, h, count, d)), keys.dtype, keys.device),
            handoff.HandedOff(ticket, 1, torch.Size((b, h, count, values.shape[-1])), keys.dtype, keys.device),
        )

    def _traced(self, ticket: handoff.Ticket, side: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The hand-off of a step ``torch.compile`` traces: the materialised history in position order, the
        ticket in ``side`` for kvpolicy's attention functions (see :meth:`step`)."""
        if ticket.scores or ticket.queries:
            raise RuntimeError(
                f"layer {self.layer_idx}: policy {self.composition.policy.name!r} or the cache's transform reads "
                "attention scores or queries, which a step compiled with torch.compile cannot report; run this cache "
                "eagerly (CompressedCache.compiles says which caches compile)"
            )
        if side is not None and ticket.fusable:
            side[handoff.TICKET_KWARG] = ticket
        else:
            self.path = StepPath(
                "materialized", "a compiled step whose attention function is not known", self.plan.backend.name
            )
        return self.view("ordered")

    def demote_ahead(self, n: int) -> None:
        """Before a forward that appends ``n`` tokens: apply the demotions its append would apply
        (:meth:`HeldTokens.demote_ahead`)."""
        if self.held is not None:
            self.held.demote_ahead(n)

    def release(self) -> int:
        """Attention has read the latest multi-token step: demote what may be demoted now
        (:meth:`HeldTokens.release`). Nothing happens while the hand-off of that step is still alive
        (a shared-KV layer reads it later in the forward): the next call demotes.

        Returns
        -------
        int
            Tokens the policy was told of.
        """
        if self.held is None or not self.held.pending:
            return 0
        if self._handed is not None and self._handed() is not None:
            return 0
        return self.held.release()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the reference to the latest hand-off (a weak reference; it never outlives
        the forward that consumed it)."""
        state = self.__dict__.copy()
        state["_handed"] = None
        return state

    # ------------------------------------------------------------------ what attention reports
    def report(self, scores: torch.Tensor | None, layout: str = "ordered") -> None:
        """kvpolicy's wrapper ran the attention over this step's keys; ``scores`` (``(batch, kv_heads,
        keys)``, keys in ``layout``'s order) when the policy asked for them."""
        if scores is not None:
            self.observe(scores.sum(dim=0), layout)

    @property
    def wants_queries(self) -> bool:
        """Whether the layer's basis waits for the queries of the next forward (:meth:`Basis.observe`)."""
        return self.held is not None and self.held.wants_queries

    def observe_queries(self, query: torch.Tensor, keys: torch.Tensor) -> None:
        """The queries ``(batch, q_heads, q, head_dim)`` of a forward over this layer and the keys ``(batch,
        kv_heads, n, head_dim)`` they read, for a basis that waits for them."""
        if self.held is not None:
            self.held.observe_queries(query, keys)

    def observe(self, scores: torch.Tensor, layout: str = "ordered") -> None:
        """Attention mass per returned key, ``(kv_heads, keys)`` with keys in ``layout``'s order;
        forwarded to the policy for the full-precision tokens."""
        self.held.observe(scores, layout)

    def view(self, layout: str = "ordered") -> tuple[torch.Tensor, torch.Tensor]:
        """The whole history, materialised (see :meth:`HeldTokens.view`)."""
        return self.held.view(layout)

    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(keys the next step returns, logical position of the first)``."""
        if self.held is None:
            return query_length, 0
        return self.held.mask_sizes(query_length)

    # ------------------------------------------------------------------ batch moves and crops
    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Reorder the batch rows (beam search)."""
        self._version += 1
        if self.held is not None:
            idx = beam_idx.to(self.held.keys.device)
            self.held.map_batch(lambda t: t.index_select(0, idx))

    def select(self, indices: torch.Tensor) -> None:
        """Keep the batch rows ``indices`` selects."""
        self._version += 1
        if self.held is not None:
            self.held.map_batch(lambda t: t[indices, ...])

    def repeat(self, repeats: int) -> None:
        """Repeat each batch row ``repeats`` times."""
        self._version += 1
        if self.held is not None:
            self.held.map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (see ``CompressedLayer.crop``)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop(tokens_to_remove={tokens_to_remove}): pass a negative number of tokens to remove")
        if tokens_to_remove == 0 or self.held is None:
            return
        self._version += 1
        self.held.crop(-tokens_to_remove)

    # ------------------------------------------------------------------ inspection and saving
    def positions(self) -> dict[str, torch.Tensor]:
        """Logical positions by segment (see ``CompressedLayer.positions``)."""
        if self.held is None:
            empty = torch.empty(0, dtype=torch.long)
            return {"full": empty, "compressed": empty, "staged_keys": empty}
        return self.held.positions()

    def memory(self, seen: set[tuple[str, int]] | None = None) -> LayerBytes:
        """Bytes of every tensor held, by segment (see ``CompressedLayer.memory``)."""
        if self.held is None:
            return LayerBytes(self.layer_idx, 0, dict.fromkeys(SEGMENTS, 0), 0, 2)
        return self.held.memory(seen)

    def state_dict(self) -> dict[str, Any]:
        """Everything held, as JSON values and tensors (see ``CompressedCache.save``)."""
        if self.held is None:
            return {"kind": "compressed", "initialized": False}
        return {"kind": "compressed", "initialized": True, "backend": self.plan.backend.name, **self.held.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> torch.Tensor | None:
        """Restore :meth:`state_dict`'s output into this unstarted engine, checking that its parts agree;
        raises ``ValueError`` naming what does not. Returns the saved keys (``None``: an empty layer)."""
        initialized = state.get("initialized") if isinstance(state, dict) else None
        if not state_check.flag(initialized, "initialized"):
            state_check.entries(state, "an empty layer", ("kind", "initialized"))
            return None
        kept = HeldTokens.STATE_KEYS if self.composition.action.compresses else HeldTokens.STATE_KEYS[:3]
        state_check.entries(state, "layer", ("kind", "initialized", "backend", *kept))
        keys, values = state_check.layer_tokens(state["keys"], state["values"])
        self.start(keys[:, :, :0], values[:, :, :0])  # checks, and a fresh state and store
        self.held.load_state_dict(state)
        return keys
