"""H2O heavy hitters (Zhang et al., NeurIPS 2023); spec: policies-spec.md (d)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpolicy import state_check
from kvpolicy.errors import ConfigError
from kvpolicy.policies.base import Policy, PolicyState, check_int


@dataclass(frozen=True)
class HeavyHitters(Policy):
    """Keep the ``recent`` newest tokens and the ``heavy`` tokens with the most accumulated attention.

    Per (layer, kv-head), each held token has a score: the sum of the attention probabilities it
    has received from every query so far, **summed over the batch rows and over the query heads of
    its group** (GQA). A new token starts with the attention it receives in its own step. When
    more than ``heavy + recent`` tokens are held, the newest ``recent`` stay, the ``heavy`` highest
    scores among the rest stay (ties: the earlier position wins), and the others are demoted and
    their scores dropped. ``|FP| = min(T, heavy + recent)``; heads may keep different positions but
    always the same number.

    The prompt is selected once, after prefill, from the column sums of the whole prefill attention
    (the usual H2O practice), not as single appends. Scores come from the attention function of
    :mod:`kvpolicy.attention`; see :func:`kvpolicy.attention.enable_scores`.

    Parameters
    ----------
    heavy : int
        ``H >= 0`` heavy-hitter tokens.
    recent : int
        ``R >= 0`` newest tokens.
    """

    heavy: int = 64
    recent: int = 64

    name = "h2o"
    per_head = True
    needs_scores = True

    def __post_init__(self) -> None:
        check_int("heavy", self.heavy, 0, "HeavyHitters")
        check_int("recent", self.recent, 0, "HeavyHitters")
        if self.heavy + self.recent < 1:
            raise ConfigError("HeavyHitters: heavy + recent must be >= 1; got heavy=0, recent=0")

    def new_state(self, num_heads: int = 1) -> HeavyHittersState:
        return HeavyHittersState(self.heavy, self.recent, num_heads)


class HeavyHittersState(PolicyState):
    """Per-head positions ``pos`` (``(heads, n)``, sorted) and accumulated scores ``acc``."""

    fixed = ("heavy", "recent", "num_heads")

    def __init__(self, heavy: int, recent: int, num_heads: int) -> None:
        self.heavy = heavy
        self.recent = recent
        self.num_heads = num_heads
        self.length = 0
        self.pos = torch.empty(num_heads, 0, dtype=torch.long)
        self.acc = torch.empty(num_heads, 0, dtype=torch.float32)
        # scores observed for positions not appended yet (the tokens of the current forward)
        self._pending = torch.empty(num_heads, 0, dtype=torch.float32)

    def observe(self, scores: torch.Tensor, positions: torch.Tensor) -> None:
        scores = scores.detach().float().cpu()
        positions = positions.cpu().expand(self.num_heads, -1)
        held = self.pos.shape[1]
        if not torch.equal(positions[:, :held], self.pos):
            raise RuntimeError("HeavyHitters.observe: scored positions do not match the held positions")
        self.acc = self.acc + scores[:, :held]
        extra = scores[:, held:]
        if extra.shape[1]:
            expected = torch.arange(self.length, self.length + extra.shape[1]).expand(self.num_heads, -1)
            if not torch.equal(positions[:, held:], expected):
                raise RuntimeError("HeavyHitters.observe: scores for unknown positions")
            self._pending = extra.clone()

    def append(self, n: int) -> torch.Tensor:
        new = torch.arange(self.length, self.length + n).expand(self.num_heads, -1)
        own = torch.zeros(self.num_heads, n)
        k = min(n, self._pending.shape[1])
        own[:, :k] = self._pending[:, :k]
        self._pending = self._pending[:, k:]
        self.pos = torch.cat([self.pos, new], dim=1)
        self.acc = torch.cat([self.acc, own], dim=1)
        self.length += n
        budget = self.heavy + self.recent
        held = self.pos.shape[1]
        if held <= budget:
            return torch.empty(self.num_heads, 0, dtype=torch.long)
        old = held - self.recent  # candidates: everything but the newest `recent`
        # highest score first; ties: earlier position first (a stable sort on the negated score)
        order = torch.sort(-self.acc[:, :old], dim=1, stable=True).indices
        keep_old = torch.sort(order[:, : self.heavy], dim=1).values
        drop = torch.sort(order[:, self.heavy :], dim=1).values
        keep = torch.cat([keep_old, torch.arange(old, held).expand(self.num_heads, -1)], dim=1)
        demoted = self.pos.gather(1, drop)
        self.pos = self.pos.gather(1, keep)
        self.acc = self.acc.gather(1, keep)
        return demoted

    def full_count_after(self, n: int) -> int:
        return min(self.pos.shape[1] + n, self.heavy + self.recent)

    def full_positions(self) -> torch.Tensor:
        return self.pos.clone()

    def validate(self) -> None:
        """``pos`` holds ``min(length, heavy + recent)`` distinct ascending positions in ``[0, length)`` per
        head, the newest ``recent`` among them; ``acc`` and the pending scores are finite and non-negative."""
        super().validate()
        held = min(self.length, self.heavy + self.recent)
        state_check.tensor(self.pos, "HeavyHittersState.pos", torch.long, (self.num_heads, held))
        state_check.tensor(self.acc, "HeavyHittersState.acc", torch.float32, (self.num_heads, held))
        state_check.positions(self.pos, "HeavyHittersState.pos", self.length)
        if held and bool((self.pos[:, 1:] <= self.pos[:, :-1]).any()):
            raise ValueError("HeavyHittersState.pos is not ascending in every head")
        newest = min(held, self.recent)
        if newest and not torch.equal(
            self.pos[:, held - newest :], torch.arange(self.length - newest, self.length).expand(self.num_heads, -1)
        ):
            raise ValueError(f"HeavyHittersState.pos does not end with the newest {newest} positions in every head")
        for name in ("acc", "_pending"):
            scores = state_check.finite(getattr(self, name), f"HeavyHittersState.{name}")
            if bool((scores < 0).any()):
                raise ValueError(f"HeavyHittersState.{name} holds negative attention mass")
