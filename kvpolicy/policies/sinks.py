"""Attention sinks on top of any policy (``CompressedCache(policy="log", sinks=4)``); spec: docs/policies.md.

StreamingLLM, IntactKV and KVQuant all find that the first few tokens draw attention out of
proportion to their content and lose most when compressed. :class:`Sinks` keeps the first ``S``
tokens at full precision for good and hands every later token to the policy it wraps, as if the
stream started after the sinks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpolicy import state_check
from kvpolicy.errors import ConfigError
from kvpolicy.policies.base import Policy, PolicyState, check_int


@dataclass(frozen=True)
class Sinks(Policy):
    """The first ``sinks`` tokens at full precision, and ``policy`` over the tokens after them.

    With ``S = sinks`` and the wrapped policy's selection ``FP_p``:
    ``FP(T) = [0, min(S, T)) ∪ {S + i : i ∈ FP_p(max(T - S, 0))}``. Positions ``< S`` are never
    demoted; the wrapped policy sees positions ``S, S + 1, ...`` as its ``0, 1, ...`` (the first
    append reaching past the sinks is its prompt), and attention scores of positions ``≥ S`` only
    (a score-based policy such as H2O ranks the tokens after the sinks). Per-head and score-based
    policies stay so: :attr:`per_head`, :attr:`needs_scores` and :attr:`score_queries` are the
    wrapped policy's.

    Parameters
    ----------
    policy : Policy
        Any policy (built-in or plugin).
    sinks : int
        ``S >= 0``, default 4 (StreamingLLM's choice). ``0`` is the wrapped policy itself.
    """

    policy: Policy
    sinks: int = 4

    name = "sinks"

    def __post_init__(self) -> None:
        if not isinstance(self.policy, Policy):
            raise ConfigError(f"Sinks: policy must be a Policy object; got policy={self.policy!r}")
        check_int("sinks", self.sinks, 0, "Sinks")

    @property  # type: ignore[override]
    def per_head(self) -> bool:
        return self.policy.per_head

    @property  # type: ignore[override]
    def needs_scores(self) -> bool:
        return self.policy.needs_scores

    @property  # type: ignore[override]
    def score_queries(self) -> int | None:
        return self.policy.score_queries

    @property  # type: ignore[override]
    def splits_appends(self) -> bool:
        return self.policy.splits_appends

    def new_state(self, num_heads: int = 1) -> SinksState:
        return SinksState(self.policy.new_state(num_heads), self.sinks, self.policy.per_head, num_heads)


class SinksState(PolicyState):
    """Incremental state of :class:`Sinks`: the wrapped state, driven with shifted positions."""

    def __init__(self, inner: PolicyState, sinks: int, per_head: bool, num_heads: int = 1) -> None:
        self.inner = inner
        self.sinks = sinks
        self.per_head = per_head
        self.num_heads = num_heads
        self.length = 0

    def append(self, n: int) -> list[int] | Any:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"append: n must be an integer >= 0; got n={n!r}")
        past = max(self.length + n - self.sinks, 0) - max(self.length - self.sinks, 0)
        self.length += n
        if past == 0 and self.inner.length == 0:
            return self._empty()
        return self._shift(self.inner.append(past))

    def full_positions(self) -> list[int] | Any:
        sinks = list(range(min(self.sinks, self.length)))
        rest = self._shift(self.inner.full_positions()) if self.length > self.sinks else self._empty()
        if not self.per_head:
            return sinks + rest
        import torch

        head = torch.tensor(sinks, dtype=torch.int64).expand(rest.shape[0], -1)
        return torch.cat([head, rest], dim=1)

    def full_count_after(self, n: int) -> int:
        past = max(self.length + n - self.sinks, 0)
        inner = self.inner.full_count_after(past - self.inner.length) if past else 0
        return min(self.sinks, self.length + n) + inner

    def observe(self, scores: Any, positions: Any) -> None:
        """The wrapped policy's ``observe`` over the keys after the sinks (positions shifted by ``-S``)."""
        if not self.per_head and positions.shape[0] == 1:
            keep = positions[0] >= self.sinks
            if bool(keep.any()):
                self.inner.observe(scores[:, keep], positions[:, keep] - self.sinks)
            return
        keep = positions >= self.sinks
        counts = keep.sum(dim=1)
        if bool((counts != counts[0]).any()):
            raise RuntimeError(
                "Sinks.observe: the scored keys hold different numbers of sink positions per head; every head "
                f"must hold each of the first {self.sinks} positions exactly once"
            )
        m = int(counts[0])
        if m:
            rows = scores.shape[0]
            if positions.shape[0] == 1:
                positions = positions.expand(rows, -1)
                keep = keep.expand(rows, -1)
            self.inner.observe(scores[keep].reshape(rows, m), positions[keep].reshape(rows, m) - self.sinks)

    def _shift(self, demoted: list[int] | Any) -> list[int] | Any:
        if isinstance(demoted, list):
            return [p + self.sinks for p in demoted]
        return demoted + self.sinks

    def _empty(self) -> list[int] | Any:
        if not self.per_head:
            return []
        import torch

        return torch.empty(self.num_heads, 0, dtype=torch.int64)

    def state_dict(self) -> dict[str, Any]:
        """Flat, as the contract asks: the wrapped state's entries under ``inner.``."""
        inner = {f"inner.{name}": value for name, value in self.inner.state_dict().items()}
        return {"length": self.length, "sinks": self.sinks, **inner}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The wrapped state's entries (under ``inner.``) restored into it; ``sinks`` must be this policy's."""
        if not isinstance(state, dict):
            raise ValueError(f"SinksState: a saved state is a mapping; got a {type(state).__name__}")
        inner = {k[len("inner.") :]: v for k, v in state.items() if isinstance(k, str) and k.startswith("inner.")}
        state_check.entries(
            {k: v for k, v in state.items() if not k.startswith("inner.")}, "SinksState", ("length", "sinks")
        )
        if type(state["sinks"]) is not int or state["sinks"] != self.sinks:
            raise ValueError(
                f"a Sinks state saved with sinks={state['sinks']!r:.40} cannot load into sinks={self.sinks}"
            )
        self.length = state["length"]
        self.validate()
        self.inner.load_state_dict(inner)
        if self.inner.length != max(self.length - self.sinks, 0):
            raise ValueError(
                f"SinksState: the wrapped state's length {self.inner.length} is not length {self.length} - sinks "
                f"{self.sinks}"
            )
