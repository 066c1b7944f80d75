"""The tokens one layer holds, by segment, and the moves between segments: plain torch, no transformers.

:class:`HeldTokens` owns a full-precision segment (the policy's set) and the action's store of
demoted tokens, which may itself hold several compressed tiers (:mod:`kvpolicy.actions.tiered`),
each with the logical positions of its tokens. It applies the policy's decisions (demotion) and
answers what attention needs (the materialised history, positions, bytes held). It knows nothing
of transformers: :class:`kvpolicy.cache.CompressedLayer` translates transformers' calls into these
methods (padded batches, the hand-off to attention, backend choice), and this object is testable
with bare tensors.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from kvpolicy import state_check
from kvpolicy.actions.base import DemotedStore
from kvpolicy.layer.composition import Composition, Plan
from kvpolicy.memory import LayerBytes
from kvpolicy.policies.base import PolicyState
from kvpolicy.positions import MAX_POSITION, POSITION_DTYPE, PositionBook, check_length, storage_bytes
from kvpolicy.transforms.base import Basis, BindContext

#: the segments of a memory report, in order
SEGMENTS = ("full_precision", "codes", "scales", "zeros", "staging", "positions")
#: tokens at the end of a multi-token append that :meth:`HeldTokens.release` keeps undemoted (and
#: unknown to the policy) for a policy that needs no scores: the tokens a ``crop`` could still remove
#: (assisted decoding's rollback of rejected drafts; its verification forwards are shorter)
CROP_WINDOW = 64
#: demotions move tokens into the store in chunks of at most this many tokens, so the temporaries of
#: a demotion (gathered copies, fitting, rotation, tier moves) stay within a small multiple of one
#: chunk's full-precision keys and values, however long the prompt
DEMOTE_CHUNK = 512


class HeldTokens:
    """One layer's held tokens: a full-precision segment and the action's store.

    Parameters
    ----------
    composition : Composition
        The cache's parts, shared: its policy chooses, its transform is the change of basis of demoted tokens.
    plan : Plan
        The layer's resolution of them (shared with its engine): ``plan.action`` demotes and its store's blocks
        are packed by ``plan.backend``.
    layer_idx : int
        The layer's index (error messages, per-layer stores).
    book : PositionBook, optional
        Where a shared policy's demoted positions are held once for every layer that demoted the same
        (``None``: not shared, as for the rows of a padded batch).

    Attributes
    ----------
    keys, values : torch.Tensor
        The full-precision segment: ``(batch, kv_heads, n_full, head_dim)``.
    full_pos : torch.Tensor or None
        Its logical positions, int32, sorted: ``(1, n_full)`` for shared policies, ``(kv_heads, n_full)``
        for per-head ones (``None`` when the action does not compress).
    store : DemotedStore or None
        The demoted tokens (``store.positions`` is laid out like ``full_pos``), in :attr:`basis`.
    basis : Basis or None
        The transform bound to this layer (:meth:`Transform.bind`), which maps what the store receives and
        gives back; ``None`` for the identity, or an action that keeps no demoted tokens.
    length : int
        Tokens seen (logical length).
    pending : int
        Tokens of the latest multi-token append whose demotion is deferred to the next call.
    moves : int
        Demotions applied so far: it grows whenever tokens move between segments, including a
        deferred demotion applied by an inspection, so views of the segments taken earlier can be
        told stale.
    """

    def __init__(
        self, composition: Composition, plan: Plan, layer_idx: int, book: PositionBook | None = None
    ) -> None:  # fmt: skip
        self.composition = composition
        self.plan = plan
        self.layer_idx = layer_idx
        self.book = book
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.full_pos: torch.Tensor | None = None
        self.state: PolicyState | None = None
        self.store: DemotedStore | None = None
        self.basis: Basis | None = None
        self.length = 0
        self.pending = 0
        self.moves = 0
        #: whether the latest forward delivered the attention scores the policy needs
        self.scored = True
        #: an error that left the policy and the store out of step (the layer cannot go on)
        self.failed: str | None = None
        self._first_block_taken = False  # see _awaits_first_block
        #: the store took centres or a fit from the pending append before holding anything (_set_first_centres)
        self._adopted = False
        #: the basis as it was before that fit, restored by a crop that takes the append back
        self._unfitted: Basis | None = None
        #: the latest single-token appends that demoted nothing (a crop can take them back: :meth:`crop`)
        self._quiet = 0
        #: once :meth:`demote_ahead` told the policy of the coming token: whether held tokens left the segment then;
        #: the next single-token append takes it (``None``: nothing announced)
        self._ahead: bool | None = None
        #: the length when it was announced (read by eager checks only: a compiled step compares no two lengths,
        #: which would have the compiler equate two of its integer inputs)
        self._ahead_at = 0
        #: demotions told ahead that name the coming token itself, applied once it is held
        self._late: list[int] | torch.Tensor | None = None

    # ------------------------------------------------------------------ building
    def start(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Empty segments shaped like ``key_states``/``value_states`` (``(batch, kv_heads, n, head_dim)``),
        after checking that the composition can hold them (``ConfigError`` naming what cannot)."""
        self.keys = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[3]))
        self.values = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[3]))
        if not self.plan.action.compresses:
            return
        multiple = self.plan.backend.capabilities.group_size_multiple
        self.plan.action.check_head_dim(key_states.shape[-1], multiple, role="key")
        self.plan.action.check_head_dim(value_states.shape[-1], multiple, role="value")
        self.plan.backend.check_tensor(key_states)
        basis = None
        if self.plan.action.keeps_demoted:
            transform = self.composition.transform
            transform.check_head_dim(key_states.shape[-1])
            transform.check_head_dim(value_states.shape[-1])
            transform.check_key_head_dim(key_states.shape[-1])
            if not transform.identity:  # bound before anything is allocated: a bind may refuse the layer
                basis = transform.bind(
                    BindContext.of(self.layer_idx, key_states, value_states, self.composition.config)
                )
        rows = key_states.shape[1] if self.composition.policy.per_head else 1
        device = key_states.device
        self.state = self.composition.policy.new_state(num_heads=key_states.shape[1])
        self.store = self._new_store(torch.empty(rows, 0, dtype=POSITION_DTYPE, device=device))
        self.basis = basis
        self.full_pos = torch.empty(rows, 0, dtype=POSITION_DTYPE, device=device)

    @property
    def compressing(self) -> bool:
        """Whether the action compresses (a policy state and a store exist once started)."""
        return self.store is not None

    def _new_store(self, positions: torch.Tensor) -> DemotedStore:
        store = self.plan.action.new_store(self.plan.backend, self.layer_idx)
        store.positions = positions
        return store

    def _put(self, store: DemotedStore, basis: Basis | None, keys: torch.Tensor, values: torch.Tensor,
             positions: torch.Tensor) -> None:  # fmt: skip
        """Give demoted tokens ``(batch, kv_heads, n, head_dim)`` at ``positions`` to ``store``, through
        ``basis`` (fitted on them first if it has not been)."""
        if basis is None:
            store.add(keys, values, positions)
            return
        if not basis.fitted:
            basis.fit(keys, values)
        basis.add(store, keys, values, positions)

    @property
    def wants_queries(self) -> bool:
        """Whether the basis waits for the queries of the next forward (:meth:`Basis.observe`)."""
        return self.basis is not None and self.basis.wants_queries

    def observe_queries(self, query: torch.Tensor, keys: torch.Tensor) -> None:
        """The queries ``(batch, q_heads, q, head_dim)`` of a forward and the keys ``(batch, kv_heads, n,
        head_dim)`` they read, for a basis that waits for them."""
        if self.wants_queries:
            self.basis.observe(query, keys)

    def awaits_first_block(self) -> bool:
        """Whether the store or the basis still takes a statistic from the first block it receives (a centred
        stream's centre: :meth:`DemotedStore.awaits_first_block`; a basis that fits on the first demotion's keys
        and is not fitted yet): how the first demotion is batched would then change what is stored, so it is
        demoted in one piece and at the time it always was (the call after a multi-token append)."""
        basis = self.basis
        return self.store.awaits_first_block() or (basis is not None and basis.fits_keys and not basis.fitted)

    @property
    def holds_demoted(self) -> bool:
        """Whether attention must read compressed tokens besides the full-precision segment."""
        return self.plan.action.keeps_demoted and self.store is not None and len(self.store) > 0

    # ------------------------------------------------------------------ appending and demoting
    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append ``n`` new tokens at full precision.

        Deferred demotions of the previous multi-token append are applied first (they index the
        segment as it was). A single token (decode) is demoted for at once, so the next read sees
        ``FP(T)``; a multi-token append (prefill) stays whole until attention has read it, so its
        attention sees the uncompressed prompt and score-based policies get its scores before choosing:
        :meth:`release` demotes it then (the cache calls it once the model has moved past this layer),
        else the next call does.
        """
        n = key_states.shape[-2]
        compressing = self.store is not None
        ahead = self._ahead
        if ahead is not None:
            self._take_ahead(n)
        elif compressing and (
            self.pending or self.failed is not None or (self.composition.policy.needs_scores and not self.scored)
        ):
            self.settle()
        start, moves = self.length, self.moves
        self.length += n
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        if not compressing:
            return
        if self.length > MAX_POSITION:
            check_length(self.length)
        new = torch.arange(start, start + n, dtype=POSITION_DTYPE, device=self.keys.device)
        self.full_pos = torch.cat([self.full_pos, new.expand(self.full_pos.shape[0], n)], dim=1)
        quiet, self._quiet = self._quiet, 0
        if ahead is not None:  # the policy already knows of this token
            late, self._late = self._late, None
            if late is not None:
                self._guarded(self._move, late)
            self._quiet = quiet + 1 if not ahead and self.moves == moves else 0
            return
        self.pending = n
        if n == 1:
            self.settle()
            self._quiet = quiet + 1 if self.moves == moves else 0

    def demote_ahead(self, n: int) -> None:
        """Before a forward that appends ``n`` tokens: apply now the demotions its append would apply, so that the
        forward itself changes no layout (a compiled forward then runs as one graph, and the eager demotion runs
        ahead of it, outside the model's frames).

        Only a single-token append (decode) of a policy that needs no scores is taken ahead; anything else waits for
        the append, as before. The deferred demotion of the latest multi-token append is applied first (the append
        would apply it first). The policy is then told of the coming token, and the tokens it demotes move to the
        store now if they are all held already; a demotion that names the coming token itself waits until it is
        held. Attention reads what it would have read: the demoted tokens are older ones, and they move into the
        same store in the same order. Calling it again before the append changes nothing.
        """
        if (
            n != 1
            or self.store is None
            or self._ahead is not None
            or self.failed is not None
            or self.composition.policy.needs_scores
        ):
            return
        if self.pending:
            self.settle()
        start, moves = self.length, self.moves
        demoted = self._guarded(self.state.append, 1)
        self._ahead, self._ahead_at = False, start
        if len(demoted):
            self._guarded(self._move_ahead, demoted, start)
        self._ahead = self.moves != moves

    def _refuse_ahead(self, what: str) -> None:
        """Refuse ``what`` while the policy knows of a token :meth:`demote_ahead` announced and the layer has not
        received (a forward stopped between the two): the policy and the held tokens disagree by that token."""
        if self._ahead is not None:
            raise RuntimeError(
                f"{what} on layer {self.layer_idx}: a forward announced token {self._ahead_at} to this layer's policy "
                "and stopped before the layer received it; run that forward again (the announcement stands) or "
                "start a new cache"
            )

    def _take_ahead(self, n: int) -> None:
        """The append of ``n`` tokens after :meth:`demote_ahead`: it must be the single token announced, at the
        length announced; anything else leaves the policy told of a token the layer never held (an error)."""
        # a crop refuses while a token is announced, so the length cannot change before the append;
        # an eager step checks it all the same
        if n != 1 or (not torch.compiler.is_compiling() and self._ahead_at != self.length):
            told = self._ahead_at
            self._ahead = self._late = None
            self.failed = (
                f"the policy was told of one new token at position {told} before the forward, but the layer received "
                f"{n} token(s) at position {self.length}"
            )
            self.settle()  # raises with the reason
        self._ahead = None

    @torch.compiler.disable
    def _move_ahead(self, demoted: list[int] | torch.Tensor, start: int) -> None:
        """Move ``demoted`` now when every position is below ``start`` (held already); else keep it for the append
        of the token at ``start`` (:attr:`_late`)."""
        if int(self._positions(demoted).max()) < start:
            self._move(demoted)
        else:
            self._late = demoted

    def _guarded(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``; an exception leaves the policy and the store out of step, which :attr:`failed` records."""
        try:
            return fn(*args)
        except Exception as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            raise

    def settle(self) -> None:
        """Apply deferred demotions (and check that score-based policies got their scores)."""
        if self.composition.policy.needs_scores and not self.scored:
            raise RuntimeError(
                f"policy {self.composition.policy.name!r} needs attention scores, but layer {self.layer_idx} received "
                "none in the last forward. Call kvpolicy.attention.enable_scores(model) once before running the model: "
                "it wraps the model's sdpa/eager attention to report them (see docs/policies.md)."
            )
        if self.failed is not None:
            raise RuntimeError(
                f"layer {self.layer_idx} of this CompressedCache failed while demoting tokens ({self.failed}); its "
                "policy and its store no longer agree, so it cannot go on. Start a new cache (or call reset())."
            )
        if self.pending:
            n, self.pending = self.pending, 0
            self._guarded(self._demote, n)

    def release(self) -> int:
        """Attention has read the latest multi-token append: demote what may be demoted now.

        A policy that needs scores must have received them (else nothing happens here, and the next
        call raises); it is then told of the whole append. A policy whose appends split
        (``Policy.splits_appends``) is told of all but the last ``min(pending, CROP_WINDOW)`` tokens,
        which stay pending so that ``crop`` can still remove them. Any other policy keeps the whole
        append pending until the next call. The demotions are those the next call would apply.

        Returns
        -------
        int
            Tokens the policy was told of (0: nothing released).
        """
        if not self.compressing or not self.pending or self.failed is not None:
            return 0
        if self.awaits_first_block():
            self._set_first_centres()
            if self.awaits_first_block():
                return 0  # the next call demotes the whole append at once, as the store's first block
        if self.composition.policy.needs_scores:
            if not self.scored:
                return 0
            keep = 0
        elif self.composition.policy.splits_appends:
            keep = min(self.pending, CROP_WINDOW)
        else:
            return 0
        n = self.pending - keep
        if n <= 0:
            return 0
        self.pending = keep
        self._guarded(self._demote, n)
        return n

    def _set_first_centres(self) -> None:
        """Give the store's centred streams that hold nothing yet the centre the next call's unsplit
        demotion of the whole pending append would give them: that demotion is run once into a fresh
        store of the action (a copy of the policy's state choosing), whose first-block centres this store
        then takes (:meth:`DemotedStore.take_first_block`); an unfitted basis is fitted on that block first.
        The demotion itself can then be split and chunked and still store what it always did. Streams that
        fresh store leaves empty keep waiting for their first block."""
        if self.composition.policy.needs_scores and not self.scored:
            return
        pos = self._positions(copy.deepcopy(self.state).append(self.pending))
        if pos.shape[1] == 0:
            return
        idx = torch.searchsorted(self.full_pos, pos)
        keys, values = take(self.keys, idx), take(self.values, idx)
        basis = self.basis
        if basis is not None and not basis.fitted:
            self._unfitted = copy.copy(basis)
            basis.fit(keys, values)
        probe = self._new_store(self.store.positions[:, :0])
        self._put(probe, None if basis is None else copy.copy(basis), keys, values, pos)
        self.store.take_first_block(probe)
        self._adopted = len(self.store) == 0

    def _positions(self, demoted: list[int] | torch.Tensor) -> torch.Tensor:
        """What ``PolicyState.append`` returned, as ``(rows, k)`` int32 positions on the layer's device."""
        device = self.keys.device
        if isinstance(demoted, torch.Tensor):
            return demoted.to(device, POSITION_DTYPE)
        return torch.tensor(demoted, dtype=POSITION_DTYPE, device=device).view(1, -1)

    def _demote(self, n: int) -> None:
        """Tell the policy of ``n`` new tokens and move the tokens it demotes into the store, in chunks
        of at most :data:`DEMOTE_CHUNK` tokens."""
        assert self.state is not None and self.store is not None and self.full_pos is not None
        demoted = self.state.append(n)
        if len(demoted):
            self._move(demoted)

    @torch.compiler.disable
    def _move(self, demoted: list[int] | torch.Tensor) -> None:
        """Move the ``demoted`` positions into the store. The layout changes here, so a compiled step runs
        this eagerly (one graph break in a step that demotes) and the compiler never specialises on the
        positions a step demotes."""
        pos = self._positions(demoted)
        device = self.keys.device
        k = pos.shape[1]
        if k == 0:
            return
        rows, full = self.full_pos.shape
        idx = torch.searchsorted(self.full_pos, pos)
        keep = torch.ones(rows, full, dtype=torch.bool, device=device)
        keep.scatter_(1, idx, False)
        keep_idx = torch.arange(full, device=device).expand(rows, full)[keep].view(rows, full - k)
        self.moves += 1
        chunk = k if self._awaits_first_block() else DEMOTE_CHUNK
        for lo in range(0, k, chunk):
            part = idx[:, lo : lo + chunk]
            self._put(self.store, self.basis, take(self.keys, part), take(self.values, part), pos[:, lo : lo + chunk])
        if self.book is not None and rows == 1:
            self.store.positions = self.book.intern(self.store.positions)
        self.keys = take(self.keys, keep_idx)
        self.values = take(self.values, keep_idx)
        self.full_pos = self.full_pos.gather(1, keep_idx)

    def _awaits_first_block(self) -> bool:
        """:meth:`awaits_first_block`, remembered once False (a stream that has its first block or centre
        keeps it, and so does a fitted basis)."""
        if self._first_block_taken:
            return False
        waiting = self.awaits_first_block()
        self._first_block_taken = not waiting
        return waiting

    def observe(self, scores: torch.Tensor, layout: str = "ordered") -> None:
        """Attention mass per key of the latest read, ``(kv_heads, keys)`` with keys in ``layout``'s
        order; the full-precision tokens' share goes to the policy."""
        if not self.holds_demoted:
            full = scores
        elif layout == "agnostic":
            full = scores[:, len(self.store) :]
        else:
            full = scores.gather(1, self.full_pos.long().expand(scores.shape[0], -1))
        self.state.observe(full, self.full_pos.long())
        self.scored = True

    @property
    def is_croppable(self) -> bool:
        """Whether :meth:`crop` can remove the latest append now (see ``CompressedLayer.is_croppable``)."""
        if not self.compressing:
            return True
        return not self.composition.policy.needs_scores and (self.pending > 0 or self._rewinds > 0)

    @property
    def _rewinds(self) -> int:
        """How many of the latest single-token appends a crop can take back: those that demoted nothing, for a
        policy whose state is a function of the length (``Policy.splits_appends``), so that a fresh state told of
        the length left is the state the policy had then."""
        return self._quiet if self.composition.policy.splits_appends and not self.pending else 0

    def crop(self, k: int) -> None:
        """Remove the last ``k`` tokens: exact while they are the latest multi-token append's and still undemoted
        (the policy never learnt of them), or the latest single-token appends when they demoted nothing and the
        policy's state is a function of the length (:attr:`_rewinds`); anything else raises ``ValueError``."""
        self._refuse_ahead(f"crop(tokens_to_remove={-k})")
        if self.compressing and self.composition.policy.needs_scores:
            raise ValueError(
                f"crop(tokens_to_remove={-k}): policy {self.composition.policy.name!r} has already accumulated the "
                "attention of the tokens to remove into the scores of the tokens it holds, which cannot be taken "
                "back; assisted decoding is not supported with score-based policies"
            )
        rewind = self.compressing and k > self.pending
        if rewind and k > self._rewinds:
            raise ValueError(
                f"crop(tokens_to_remove={-k}) on layer {self.layer_idx}: only the {self.pending} token(s) of the "
                f"latest multi-token update, or the {self._rewinds} latest single-token step(s) that demoted "
                f"nothing, can be removed; older tokens were already handed to the policy "
                f"({self.composition.policy.name!r}) and demoted, or its state cannot be wound back"
                + ("" if self.composition.policy.splits_appends else " (its selection depends on more than the length)")
            )
        if rewind:
            self._rewind(k)
        self.keys = self.keys[:, :, :-k]
        self.values = self.values[:, :, :-k]
        self.length -= k
        if self.compressing:
            self.full_pos = self.full_pos[:, :-k].clone(memory_format=torch.contiguous_format)
            if not rewind:  # a rewind happens with nothing pending
                self.pending -= k
            if self._adopted and len(self.store) == 0:
                self._forget_adopted()

    def _rewind(self, k: int) -> None:
        """Put the policy's state back to before the latest ``k`` single-token appends (none demoted anything): a
        fresh state told of the length left, checked to hold the full-precision positions left."""
        state = self.composition.policy.new_state(num_heads=self.keys.shape[1])
        state.append(self.length - k)
        told = torch.as_tensor(state.full_positions(), dtype=torch.long).cpu()
        told = told if self.composition.policy.per_head else told.reshape(1, -1)
        left = self.full_pos[:, :-k].long().cpu()
        if tuple(told.shape) != tuple(left.shape) or not torch.equal(told, left):
            raise ValueError(
                f"crop(tokens_to_remove={-k}) on layer {self.layer_idx}: policy {self.composition.policy.name!r} "
                f"told of {self.length - k} tokens holds other positions than the layer kept; it cannot be wound back"
            )
        self.state = state
        self._quiet -= k

    def _forget_adopted(self) -> None:
        """A crop removed tokens of the append whose demotion gave the empty store its centres or fit: a fresh
        store (with the positions and the query moments held) waits for the first block again, which the demotion
        of what is left gives it, as if the removed tokens had never come."""
        self.store = self._new_store(self.store.positions)
        if self._unfitted is not None:
            self.basis, self._unfitted = self._unfitted, None
        self._adopted = self._first_block_taken = False

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply ``fn`` to the batch dimension of every held tensor (beam reorder, batch select)."""
        self.keys = fn(self.keys)
        self.values = fn(self.values)
        if self.store is not None:
            self.store.map_batch(fn)
        if self.basis is not None:
            self.basis.map_batch(fn)
        if self._unfitted is not None:
            self._unfitted.map_batch(fn)

    # ------------------------------------------------------------------ reading
    def view(self, layout: str = "ordered") -> tuple[torch.Tensor, torch.Tensor]:
        """The whole history, materialised: ``(batch, kv_heads, keys, head_dim)`` keys and values in
        position order (``"ordered"``) or as ``[demoted tokens, full-precision tokens]``
        (``"agnostic"``, valid only under a purely causal mask)."""
        if not self.holds_demoted:
            return self.keys, self.values
        dk, dv = self.store.keys(), self.store.values()
        if self.basis is not None:
            dk, dv = self.basis.unmap_keys(dk, self.store.positions), self.basis.unmap_values(dv)
        if layout == "agnostic":
            return torch.cat([dk, self.keys], dim=-2), torch.cat([dv, self.values], dim=-2)
        return (
            scatter_ordered(self.length, (self.store.positions, dk), (self.full_pos, self.keys)),
            scatter_ordered(self.length, (self.store.positions, dv), (self.full_pos, self.values)),
        )

    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(keys the next append's read returns, logical position of the first)``."""
        if self.store is None or self.plan.action.keeps_demoted:
            return self.length + query_length, 0
        self.settle()
        held = self.full_pos.shape[1]
        if query_length == 1:  # the policy's count once told of the token (it may have been, ahead of the forward)
            kv_length = self.state.full_count_after(0 if self._ahead is not None else 1)
        else:
            kv_length = held + query_length
        return kv_length, self.length + query_length - kv_length

    def positions(self) -> dict[str, torch.Tensor]:
        """Logical positions by segment, sorted int64 (see ``CompressedLayer.positions``)."""
        if not self.compressing:
            device = self.keys.device
            empty = torch.empty(0, dtype=torch.long, device=device)
            return {"full": torch.arange(self.length, device=device), "compressed": empty, "staged_keys": empty}
        self.settle()
        staged = self.store.staged_key_positions()
        out = {
            "full": self.full_pos.long(),
            "compressed": torch.sort(self.store.positions.long(), dim=1).values,
            "staged_keys": torch.sort(staged.long(), dim=1).values,
        }
        if not self.composition.policy.per_head:
            return {key: value[0] for key, value in out.items()}
        batch = self.keys.shape[0]
        return {key: value.unsqueeze(0).expand(batch, -1, -1) for key, value in out.items()}

    def memory(self, seen: set[tuple[str, int]] | None = None) -> LayerBytes:
        """Bytes of every tensor held, by segment; positions count the whole storage they live in,
        once across the layers that share it (``seen``: storages already counted, updated here)."""
        if self.compressing:
            self.settle()
        segments = dict.fromkeys(SEGMENTS, 0)
        segments["full_precision"] = nbytes(self.keys) + nbytes(self.values)
        b, h, _, d = self.keys.shape
        baseline = self.length * b * h * (d + self.values.shape[-1]) * 2
        if self.full_pos is not None:
            segments["positions"] += storage_bytes(self.full_pos, seen)
        if self.store is not None:
            shared = self.store.shared()  # counted from their storage: other layers may hold them too
            own = [self.store.nbytes()]
            if self.basis is not None:
                shared += self.basis.shared()
                own.append(self.basis.nbytes())
            kinds = {role for role, _ in shared}
            for role, n in (item for held in own for item in held.items()):
                if role not in kinds:
                    segments[role] = segments.get(role, 0) + n
            for role, t in shared:
                segments[role] = segments.get(role, 0) + storage_bytes(t, seen)
        return LayerBytes(self.layer_idx, self.length, segments, baseline, self.keys.element_size())

    # ------------------------------------------------------------------ saving (kvpolicy.persist)
    def state_dict(self) -> dict[str, Any]:
        """Everything held, as JSON values and tensors; deferred demotions are applied first, so what
        is saved is what the next step attends over."""
        if self.failed is not None:
            raise RuntimeError(f"layer {self.layer_idx} failed while demoting tokens ({self.failed}); not saved")
        self._refuse_ahead("saving the cache")
        if self.compressing:
            self.settle()
        out: dict[str, Any] = {"length": self.length, "keys": self.keys, "values": self.values}
        if self.compressing:
            out.update(
                full_pos=self.full_pos, pending=self.pending, scored=self.scored, state=self.state.state_dict(),
                store=self._store_state(),
            )  # fmt: skip
        return out

    def _store_state(self) -> dict[str, Any]:
        """The store's state; with a basis, the basis' state holding the store's under ``"inner"``."""
        if self.basis is None:
            return self.store.state_dict()
        return {"inner": self.store.state_dict(), **self.basis.state_dict()}

    #: the entries :meth:`state_dict` writes (the first three always, the rest when compressing)
    STATE_KEYS = ("length", "keys", "values", "full_pos", "pending", "scored", "state", "store")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output into these started, empty segments (started with the
        saved keys' shape and dtype); a ``ValueError`` names the layer and what is wrong (see
        :meth:`_restore`)."""
        try:
            self._restore(state)
        except ValueError as exc:
            raise ValueError(f"layer {self.layer_idx}: {exc}") from None

    def _restore(self, state: dict[str, Any]) -> None:
        """What :meth:`load_state_dict` does.

        ``state`` is untrusted: every part is checked before it is kept, and ``ValueError`` names what
        is wrong. Checked: the policy's state (:meth:`PolicyState.load_state_dict`), the store's
        (:meth:`DemotedStore.load_state_dict` and :meth:`DemotedStore.validate`), and that the parts
        agree: the full-precision positions are ascending and as many as the full-precision tokens;
        every position, full-precision or demoted, is in ``[0, length)`` and held once per row; kept
        tokens account for the whole length; the policy's length and full-precision set are the layer's.
        """
        keys, values = state_check.layer_tokens(state["keys"], state["values"])
        length = state_check.integer(state["length"], "length", 0, MAX_POSITION)
        self.keys, self.values, self.length = keys, values, length
        if not self.compressing:
            if keys.shape[2] != length:
                raise ValueError(f"{keys.shape[2]} tokens held for length {length}")
            return
        rows = keys.shape[1] if self.composition.policy.per_head else 1
        full = keys.shape[2]
        self.full_pos = state_check.tensor(state["full_pos"], "full-precision positions", POSITION_DTYPE, (rows, full))
        self.pending = state_check.integer(state["pending"], "pending", 0, full)
        self.scored = state_check.flag(state["scored"], "scored")
        if self.composition.policy.needs_scores and not self.scored:  # save() refuses such a layer (settle raises)
            raise ValueError(
                f"scored=false: policy {self.composition.policy.name!r} saved without the scores of its last forward"
            )
        self.state.load_state_dict(state["state"])
        self._load_store(state["store"], keys, values)
        demoted = state_check.tensor(self.store.positions, "demoted positions", POSITION_DTYPE, (rows, None))
        stored = demoted.shape[1]
        if not self.plan.action.keeps_demoted and stored:
            raise ValueError(f"an evicting store holds {stored} positions")
        problems = []
        if self.full_pos.numel() and bool((self.full_pos[:, 1:] <= self.full_pos[:, :-1]).any()):
            problems.append("the full-precision positions are not ascending")
        state_check.positions(torch.cat([self.full_pos, demoted], dim=1), "positions", length)
        if self.plan.action.keeps_demoted and full + stored != length:
            problems.append(f"{full} full-precision + {stored} demoted tokens for length {length}")
        if self.state.length != length - self.pending:
            problems.append(f"policy length {self.state.length}, layer length {length} - {self.pending} pending")
        else:
            told = torch.as_tensor(self.state.full_positions(), dtype=torch.long).cpu()
            told = told if self.composition.policy.per_head else told.reshape(1, -1)
            mine = self.full_pos[:, : full - self.pending].long().cpu()
            if tuple(told.shape) != tuple(mine.shape) or not torch.equal(told, mine):
                problems.append("the policy's full-precision positions differ from the layer's")
        if problems:
            raise ValueError(f"the saved parts disagree: {'; '.join(problems)}")

    def _load_store(self, state: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Restore the store's state (and the basis', around it: :meth:`_store_state`) and check it against the
        layer's full-precision ``keys``/``values``."""
        basis = self.basis
        if basis is None:
            self.store.load_state_dict(state)
            self.store.validate(keys, values)
            return
        if not isinstance(state, dict) or "inner" not in state:
            raise ValueError(
                f"transformed store: expected a mapping holding the store's state under 'inner'; got {state!r:.60}"
            )
        self.store.load_state_dict(state["inner"])
        basis.load_state_dict({k: v for k, v in state.items() if k != "inner"}, self.store.positions.device)
        held = basis.held_dtype(keys.dtype)
        self.store.validate(keys[:, :, :0].to(held), values[:, :, :0].to(held))
        basis.validate(keys, values, self.store.positions)


def take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Tokens of ``x`` (``(batch, heads, n, d)``) at ``idx`` (``(1 or heads, k)``) along dim 2."""
    if idx.shape[0] == 1:
        return x.index_select(2, idx[0])
    b, h, _, d = x.shape
    return x.gather(2, idx[None, :, :, None].expand(b, h, idx.shape[1], d))


def scatter_ordered(length: int, *parts: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Place each part's tokens at their positions: ``(batch, heads, length, d)``."""
    first = parts[0][1]
    b, h, _, d = first.shape
    out = first.new_empty((b, h, length, d))
    for pos, x in parts:
        if pos.shape[0] == 1:
            out.index_copy_(2, pos[0].long(), x)
        else:
            out.scatter_(2, pos.long()[None, :, :, None].expand(b, h, pos.shape[1], d), x)
    return out


def nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements."""
    return t.numel() * t.element_size()
