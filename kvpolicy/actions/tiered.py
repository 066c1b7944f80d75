"""The ``"tiered"`` action: demoted tokens step down through precision tiers.

The cache's policy decides which tokens stay at full precision. Every token it lets go enters the
first tier (for example 4-bit keys and values); a second policy, ``keep[0]``, run over the order in
which tokens entered that tier, decides which of them stay there; the others move to the next tier
(for example 2 bits), and so on down to the last tier, which keeps what it gets. Tokens only ever
move down, and each sits in exactly one tier.

A token moving down is **re-quantized from its reconstruction** in the tier it leaves (it was never
held at full precision after its demotion). The alternative, quantizing each token to both tiers at
demotion, holds a second copy of every middle-tier token; docs/explanation/quantization.md ("Precision tiers")
measures the difference in reconstruction error and finds it small, so the re-quantizing store is
the one built.

Tokens leave a middle tier one at a time, in any order, so middle tiers hold every token on its own:
keys and values grouped per token (``key_axis="token"``) or the codebook scheme. The last tier can
be any :class:`~kvpolicy.actions.quantize.Quantize` (keys per channel by default).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvpolicy import state_check
from kvpolicy.actions.base import Action, DemotedStore
from kvpolicy.actions.quantize import Quantize, QuantizedStore
from kvpolicy.backends.base import Backend
from kvpolicy.derived import Derived
from kvpolicy.errors import ConfigError
from kvpolicy.layer.parts import Part
from kvpolicy.policies.base import Policy, PolicyState
from kvpolicy.positions import POSITION_DTYPE


def _as_quantize(tier: Any, index: int) -> Quantize:
    if isinstance(tier, Quantize):
        return tier
    if isinstance(tier, Mapping):
        try:
            return Quantize(**tier)
        except TypeError as exc:
            raise ConfigError(f"Tiered: tiers[{index}]={dict(tier)!r}: {exc}") from None
    raise ConfigError(f"Tiered: tiers[{index}] must be a Quantize or a dict of its parameters; got {tier!r}")


def _as_policy(spec: Any, index: int) -> Policy:
    if isinstance(spec, Policy):
        return spec
    if isinstance(spec, Mapping) and isinstance(spec.get("name"), str):
        raise ConfigError(
            f"Tiered: keep[{index}]={dict(spec)!r} is a policy by name; names become policies in CacheSpec.resolve: "
            f"pass keep=[{dict(spec)!r}] as a keyword of CompressedCache (action='tiered'), or a Policy object"
        )
    raise ConfigError(
        f"Tiered: keep[{index}] must be a Policy or a dict with its registered 'name' and parameters; got {spec!r}"
    )


@dataclass(frozen=True)
class Tiered(Action):
    """Demoted tokens held in precision tiers, top to bottom (see the module docstring).

    Parameters
    ----------
    tiers : sequence of Quantize (or dicts of its parameters)
        At least two, from the highest precision to the lowest. Widths may not increase downward
        (per kind). Every tier but the last must hold tokens on their own: keys and values grouped
        per token, or ``scheme="codebook"``.
    keep : sequence of Policy (or dicts ``{"name": ..., **params}``)
        One per tier but the last: which tokens of that tier stay there, as a policy over the order
        in which tokens entered it (the first batch of tokens to enter is its "prompt"). Shared,
        data-independent policies only (``log``, ``recent``, ``sink``...): nothing scores the tokens
        of a tier.

    Examples
    --------
    The log rule at two scales: W = 16 tokens at full precision, the log rule at 64 over the demoted
    tokens at 4 bits, the rest at 2 bits::

        Tiered(tiers=[Quantize(bits=4, scheme="codebook"), Quantize(bits=2)], keep=[LogWindow(64)])
    """

    tiers: tuple[Quantize, ...]
    keep: tuple[Policy, ...]

    name = "tiered"
    part_parameters: ClassVar[Mapping[str, str]] = {"keep": "policies"}

    def __post_init__(self) -> None:
        if isinstance(self.tiers, (str, bytes)) or not isinstance(self.tiers, (list, tuple)):
            raise ConfigError(f"Tiered: tiers must be a list of Quantize actions; got tiers={self.tiers!r}")
        if isinstance(self.keep, (str, bytes, Policy, Mapping)) or not isinstance(self.keep, (list, tuple)):
            raise ConfigError(f"Tiered: keep must be a list of policies; got keep={self.keep!r}")
        tiers = tuple(_as_quantize(t, i) for i, t in enumerate(self.tiers))
        keep = tuple(_as_policy(p, i) for i, p in enumerate(self.keep))
        object.__setattr__(self, "tiers", tiers)
        object.__setattr__(self, "keep", keep)
        if len(tiers) < 2:
            raise ConfigError(f"Tiered: give at least two tiers (one is Quantize itself); got {len(tiers)}")
        if len(keep) != len(tiers) - 1:
            raise ConfigError(
                f"Tiered: keep needs one policy per tier but the last ({len(tiers) - 1}); got {len(keep)}"
            )
        for i, (upper, lower) in enumerate(itertools.pairwise(tiers)):
            for (kind, above), (_, below) in zip(upper.roles(), lower.roles(), strict=True):
                a, b = above.bits, below.bits
                if b > a:
                    raise ConfigError(
                        f"Tiered: tier widths may not increase downward; tiers[{i + 1}] has {kind}_bits={b} below "
                        f"tiers[{i}] with {kind}_bits={a}"
                    )
        for i, tier in enumerate(tiers[:-1]):
            for kind, fmt in tier.roles():
                if fmt.grouped and fmt.axis != "token":
                    raise ConfigError(
                        f"Tiered: tiers[{i}] is a middle tier, whose tokens leave one at a time; its {kind}s must be "
                        f"grouped per token ({kind}_axis='token') or use scheme='codebook'; got "
                        f"{kind}_axis={fmt.axis!r}"
                    )
        for i, policy in enumerate(keep):
            if policy.per_head or policy.needs_scores:
                raise ConfigError(
                    f"Tiered: keep[{i}]={policy!r} selects per head or needs attention scores; a tier's tokens are "
                    "not scored, so keep policies must be shared and data-independent (log, recent, sink)"
                )

    def check_backend(self, backend: Backend) -> None:
        for tier in self.tiers:
            tier.check_backend(backend)

    def serving(
        self, backend: Backend, key_dim: int | None = None, value_dim: int | None = None
    ) -> tuple[Tiered, tuple[str, ...]]:
        """Each tier's :meth:`Quantize.serving`; the notes name the tier (``tiers[1].key_fit=...``)."""
        served = [tier.serving(backend, key_dim, value_dim) for tier in self.tiers]
        notes = tuple(f"tiers[{i}].{note}" for i, (_, ns) in enumerate(served) for note in ns)
        if not notes:
            return self, ()
        return dataclasses.replace(self, tiers=tuple(tier for tier, _ in served)), notes

    def check_transform(self, transform: Any) -> None:
        for tier in self.tiers:
            tier.check_transform(transform)

    def check_head_dim(self, head_dim: int, multiple: int = 4, role: str | None = None) -> None:
        for tier in self.tiers:
            tier.check_head_dim(head_dim, multiple, role)

    def new_store(self, backend: Backend, layer_idx: int) -> TieredStore:
        return TieredStore(self, backend, layer_idx)


class TierStore:
    """One middle tier: tokens quantized per token, any of which can leave.

    ``arrival`` holds, for each held token, the index of its arrival in this tier's stream (what the
    tier's keep policy calls positions).
    """

    def __init__(self, action: Quantize, backend: Backend, layer_idx: int) -> None:
        self.inner = QuantizedStore(action, backend, layer_idx)
        self.backend = backend
        self.arrival = torch.empty(0, dtype=POSITION_DTYPE)

    @property
    def positions(self) -> torch.Tensor:
        return self.inner.positions

    def add(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, first: int) -> None:
        """Take tokens arriving as ``first, first + 1, ...`` of this tier's stream."""
        self.inner.add(keys, values, positions)
        n = keys.shape[2]
        new = torch.arange(first, first + n, dtype=POSITION_DTYPE, device=positions.device)
        self.arrival = torch.cat([self.arrival.to(positions.device), new])

    def take(self, arrivals: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Remove the tokens that arrived as ``arrivals`` (in that order) and return their reconstruction.

        Returns
        -------
        keys, values : torch.Tensor
            ``(batch, kv_heads, k, head_dim)`` as this tier held them (dequantized).
        positions : torch.Tensor
            ``(rows, k)`` their positions.
        """
        device = self.arrival.device
        wanted = torch.tensor(arrivals, dtype=POSITION_DTYPE, device=device)
        cols = torch.searchsorted(self.arrival, wanted)
        if bool((cols >= self.arrival.numel()).any()) or not torch.equal(self.arrival[cols], wanted):
            raise RuntimeError(f"tier: arrivals {arrivals} are not all held (held: {self.arrival.tolist()})")
        keep = torch.ones(self.arrival.numel(), dtype=torch.bool, device=device)
        keep[cols] = False
        rest = keep.nonzero().flatten()
        st = self.inner
        assert st.k.q is not None and st.v.q is not None and st.k.staging is None and st.v.staging is None
        keys = self.backend.dequantize(st.k.q.select(cols))
        values = self.backend.dequantize(st.v.q.select(cols))
        positions = st.positions.index_select(1, cols.to(st.positions.device))
        st.k.q = st.k.q.select(rest)
        st.v.q = st.v.q.select(rest)
        st.positions = st.positions.index_select(1, rest.to(st.positions.device))
        self.arrival = self.arrival[rest]
        return keys, values, positions


class TieredStore(DemotedStore):
    """The stores of a :class:`Tiered` action for one layer: middle tiers, then the last tier.

    ``positions``, ``keys()`` and ``values()`` list the middle tiers' tokens, top first, then the
    last tier's, in one consistent order (tokens that moved down are no longer in demotion order:
    readers place them by position).
    """

    def __init__(self, action: Tiered, backend: Backend, layer_idx: int) -> None:
        self.action = action
        self.backend = backend
        self.middles = [TierStore(t, backend, layer_idx) for t in action.tiers[:-1]]
        self.bottom = QuantizedStore(action.tiers[-1], backend, layer_idx)
        self.states: list[PolicyState] = [p.new_state(1) for p in action.keep]
        #: what :attr:`positions` and :meth:`parts` last built, with the objects they built them from
        self._positions: Derived | None = None
        self._parts: Derived | None = None

    # -------------------------------------------------------------- the moves
    def add(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        moving = (keys, values, positions)
        for tier, state in zip(self.middles, self.states, strict=True):
            n = moving[0].shape[2]
            if n == 0:
                return
            tier.add(*moving, first=state.length)
            leaving = state.append(n)
            if not leaving:
                return
            moving = tier.take(list(leaving))
        self.bottom.add(*moving)

    # -------------------------------------------------------------- reading
    @property
    def positions(self) -> torch.Tensor:  # type: ignore[override]
        # read at every decode step: joined again only when a tier's positions were replaced since
        held = self._positions
        if held is not None:
            was = held.sources
            same = was[-1] is self.bottom.positions
            for tier, before in zip(self.middles, was, strict=False):
                same = same and tier.inner.positions is before
            if same:
                return held.value
        tiers = self.tier_positions()
        self._positions = Derived(tuple(tiers), torch.cat(tiers, dim=1))
        return self._positions.value

    @positions.setter
    def positions(self, value: torch.Tensor) -> None:
        # an empty store takes the rows and device of its positions; later, a cache may hand back an
        # equal tensor (shared between layers), and the tiers keep their own
        if value.shape[-1] == 0 and len(self) == 0:
            for store in self._stores():
                store.positions = value.clone()
            return
        if not torch.equal(value.to(self.bottom.positions.device), self.positions):
            raise ValueError("TieredStore.positions can only be set to the positions it holds")

    def tier_positions(self) -> list[torch.Tensor]:
        """Positions held by each tier, top first (``(rows, n_i)`` each, in storage order)."""
        return [t.positions for t in self.middles] + [self.bottom.positions]

    def _stores(self) -> list[QuantizedStore]:
        return [t.inner for t in self.middles] + [self.bottom]

    def keys(self) -> torch.Tensor:
        return torch.cat([s.keys() for s in self._stores() if len(s)], dim=2)

    def values(self) -> torch.Tensor:
        return torch.cat([s.values() for s in self._stores() if len(s)], dim=2)

    def parts(self) -> list[Part]:
        """The last tier's staged tail (full precision), then every tier's quantized segment, top first
        (:func:`kvpolicy.fused.attend_parts` merges any number of them). Kept, as a
        :class:`~kvpolicy.actions.quantize.QuantizedStore` keeps its own, until a tier's blocks or positions
        are replaced."""
        # read at every decode step: built again only when what they are built from was replaced since (the last
        # tier's parts, kept by that tier while its own sources are held, stand for it)
        held = self.bottom.parts()
        built = self._parts
        if built is not None:
            was = built.sources
            same = was[0] is self.bottom._parts
            for tier, (kq, vq, positions) in zip(self.middles, was[1:], strict=True):
                inner = tier.inner
                same = same and inner.k.q is kq and inner.v.q is vq and inner.positions is positions
            if same:
                return list(built.value)
        tail = [p for p in held if p.backend is None]
        middles = [Part(t.inner.k.q, t.inner.v.q, self.backend, t.positions) for t in self.middles if len(t.inner)]
        out = tail + middles + [p for p in held if p.backend is not None]
        sources = (self.bottom._parts, *((t.inner.k.q, t.inner.v.q, t.inner.positions) for t in self.middles))
        self._parts = Derived(sources, tuple(out))
        return out

    def awaits_first_block(self) -> bool:
        return any(s.awaits_first_block() for s in self._stores())

    def take_first_block(self, probe: DemotedStore) -> None:
        for mine, theirs in zip(self._stores(), probe._stores(), strict=True):  # type: ignore[attr-defined]
            mine.take_first_block(theirs)

    def staged_key_positions(self) -> torch.Tensor:
        return self.bottom.staged_key_positions()

    def staged_value_positions(self) -> torch.Tensor:
        return self.bottom.staged_value_positions()

    # -------------------------------------------------------------- bookkeeping
    def nbytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for store in self._stores():
            for role, n in store.nbytes().items():
                out[role] = out.get(role, 0) + n
        # each middle-tier token's arrival index (what its keep policy calls its position)
        out["positions"] += sum(t.arrival.numel() * t.arrival.element_size() for t in self.middles)
        return out

    def shared(self) -> list[tuple[str, torch.Tensor]]:
        return []  # positions are the tiers' own (counted in nbytes)

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for store in self._stores():
            store.map_batch(fn)

    def state_dict(self) -> dict[str, Any]:
        return {
            "middles": [{"store": t.inner.state_dict(), "arrival": t.arrival} for t in self.middles],
            "bottom": self.bottom.state_dict(),
            "keep": [s.state_dict() for s in self.states],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state_check.entries(state, "tiered store", ("middles", "bottom", "keep"))
        for name, want in (("middles", len(self.middles)), ("keep", len(self.states))):
            if not isinstance(state[name], list) or len(state[name]) != want:
                got = len(state[name]) if isinstance(state[name], list) else type(state[name]).__name__
                raise ValueError(f"tiered store: {name} holds {got} entries; this action has {want}")
        for i, (tier, saved) in enumerate(zip(self.middles, state["middles"], strict=True)):
            state_check.entries(saved, f"tier {i}", ("store", "arrival"))
            tier.inner.load_state_dict(saved["store"])
            tier.arrival = state_check.tensor(saved["arrival"], f"tier {i} arrivals", POSITION_DTYPE, (None,))
        self.bottom.load_state_dict(state["bottom"])
        for keeper, saved in zip(self.states, state["keep"], strict=True):
            keeper.load_state_dict(saved)

    def validate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Each tier fits the layer, a middle tier stages nothing and holds exactly the arrivals its
        keep policy keeps, and every tier's positions have the same rows."""
        for i, (tier, keeper) in enumerate(zip(self.middles, self.states, strict=True)):
            try:
                tier.inner.validate(keys, values)
            except ValueError as exc:
                raise ValueError(f"tier {i}: {exc}") from None
            if tier.inner.k.staging is not None or tier.inner.v.staging is not None:
                raise ValueError(f"tier {i} stages tokens; only the last tier does")
            kept = torch.as_tensor(keeper.full_positions(), dtype=POSITION_DTYPE)
            if not torch.equal(tier.arrival.cpu(), kept):
                raise ValueError(f"tier {i} holds arrivals other than those its keep policy keeps")
        try:
            self.bottom.validate(keys, values)
        except ValueError as exc:
            raise ValueError(f"the last tier: {exc}") from None
        if len({p.shape[0] for p in self.tier_positions()}) != 1:
            raise ValueError("the tiers' positions have different numbers of rows")

    def __len__(self) -> int:
        return sum(len(t.inner) for t in self.middles) + len(self.bottom)
