"""SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024,
arXiv 2404.14469) as a kvpolicy token-selection policy."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpolicy.errors import ConfigError
from kvpolicy.policies.base import Policy, PolicyState, check_choice, check_int


@dataclass(frozen=True)
class SnapKV(Policy):
    """Keep, per kv-head, the prompt tokens the end of the prompt attends to, plus the end itself.

    After the prompt (the first append, ``L`` tokens), each head keeps:

    - the *observation window*: the last ``window`` prompt positions ``[L - window, L)``;
    - the ``capacity`` positions of the prefix ``[0, L - window)`` with the highest *vote*: the
      attention mass each prefix key received from the observation window's queries (summed over
      those queries, the batch rows and the query heads of the head's GQA group), smoothed along
      the positions by a 1-D pooling of width ``kernel_size`` (stride 1, ``kernel_size // 2``
      padding: zeros for ``"avg"``, which count in the average, nothing for ``"max"``) so that
      neighbours of a strong token come with it. Ties: the earlier position wins.

    The rest of the prompt is demoted. A prompt of at most ``capacity + window`` tokens is kept
    whole. Heads select different positions but always the same number.

    Generated tokens (everything appended after the prompt, a second multi-token turn included):
    SnapKV compresses the prompt once and keeps every generated token, and so does this policy with
    ``recent=None`` (the default). With ``recent=R`` only the newest ``R`` of them stay at full
    precision (one is demoted per step), which bounds ``|FP|`` by ``capacity + window + R``:
    useful with ``action="quantize"``, where demoted tokens stay, quantized.

    Only the first append counts as the prompt: a prefill split into chunks compresses only the
    first chunk. Scores come from :mod:`kvpolicy.attention` (call
    :func:`kvpolicy.attention.enable_scores` on the model); the policy sets ``score_queries =
    window``, so only the observation window's queries are scored.

    Differences from the authors' code: their selection is per query head (keys repeated over the
    GQA group); here it is per kv-head with the group's votes summed, which is what a cache holding
    each key once can do. Their ``max_capacity_prompt`` is ``capacity + window`` here.

    Parameters
    ----------
    capacity : int
        ``>= 0`` prefix positions kept per head (default 2016: with ``window=32`` the authors'
        default ``max_capacity_prompt = 2048``).
    window : int
        ``>= 1`` observation window: the last prompt positions, always kept, whose queries vote.
    kernel_size : int
        Odd ``>= 1`` width of the pooling (1: none). Default 5, the authors' default.
    pooling : {"avg", "max"}
        Pooling of the votes (the authors' default: average).
    recent : int or None
        ``None`` keeps every generated token; an int ``>= 1`` keeps only the newest ``recent``.
    """

    capacity: int = 2016
    window: int = 32
    kernel_size: int = 5
    pooling: str = "avg"
    recent: int | None = None

    name = "snapkv"
    per_head = True
    needs_scores = True

    def __post_init__(self) -> None:
        check_int("capacity", self.capacity, 0, "SnapKV")
        check_int("window", self.window, 1, "SnapKV")
        check_int("kernel_size", self.kernel_size, 1, "SnapKV")
        if self.kernel_size % 2 == 0:
            raise ConfigError(f"SnapKV: kernel_size must be odd (centred pooling); got kernel_size={self.kernel_size}")
        check_choice("pooling", self.pooling, ("avg", "max"), "SnapKV")
        if self.recent is not None:
            check_int("recent", self.recent, 1, "SnapKV")

    @property
    def score_queries(self) -> int:
        """Only the observation window's queries vote (read by :mod:`kvpolicy.attention`)."""
        return self.window

    def new_state(self, num_heads: int = 1) -> SnapKVState:
        return SnapKVState(self, num_heads)


def votes(scores: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """Pool ``(heads, n)`` attention mass along positions (stride 1, same length ``n``)."""
    if kernel_size == 1 or scores.shape[1] == 0:
        return scores
    x = scores[None]  # (1, heads, n): pooling runs along the last axis
    pad = kernel_size // 2
    if pooling == "avg":
        return torch.nn.functional.avg_pool1d(x, kernel_size, stride=1, padding=pad)[0]
    return torch.nn.functional.max_pool1d(x, kernel_size, stride=1, padding=pad)[0]


class SnapKVState(PolicyState):
    """Per-head prompt selection ``kept`` (``(heads, k)``, sorted) and the generated range ``[lo, length)``."""

    fixed = ("num_heads",)

    def __init__(self, policy: SnapKV, num_heads: int) -> None:
        self.policy = policy
        self.num_heads = num_heads
        self.length = 0
        self.kept = torch.empty(num_heads, 0, dtype=torch.long)
        self.lo = 0  # first generated position still at full precision
        self._prompt_scores: torch.Tensor | None = None

    def observe(self, scores: torch.Tensor, positions: torch.Tensor) -> None:
        if self.length:  # after the prompt the selection is final: later attention is not used
            return
        m = scores.shape[-1]
        expected = torch.arange(m).expand(self.num_heads, -1)
        if positions.shape[-1] != m or not torch.equal(positions.cpu().expand(self.num_heads, -1), expected):
            raise RuntimeError("SnapKV.observe: before the prompt is appended, scores must be for positions 0..m-1")
        self._prompt_scores = scores.detach().float().cpu()

    def _select_prompt(self, n: int) -> torch.Tensor:
        p = self.policy
        everything = torch.arange(n).expand(self.num_heads, -1)
        if n <= p.capacity + p.window:
            return everything.clone()
        if self._prompt_scores is None or self._prompt_scores.shape[1] < n:
            raise RuntimeError(
                f"SnapKV: the prompt ({n} tokens) exceeds capacity + window = {p.capacity + p.window}, but no "
                "attention scores for it were observed; call kvpolicy.attention.enable_scores(model)"
            )
        prefix = n - p.window
        pooled = votes(self._prompt_scores[:, :prefix], p.kernel_size, p.pooling)
        order = torch.sort(-pooled, dim=1, stable=True).indices  # highest vote first, ties: earlier first
        top = torch.sort(order[:, : p.capacity], dim=1).values
        return torch.cat([top, torch.arange(prefix, n).expand(self.num_heads, -1)], dim=1)

    def append(self, n: int) -> torch.Tensor:
        check_int("n", n, 0, "SnapKVState.append")
        if n == 0:
            return torch.empty(self.num_heads, 0, dtype=torch.long)
        if self.length == 0:  # the prompt
            self.kept = self._select_prompt(n)
            self._prompt_scores = None
            self.length = self.lo = n
            keep = torch.zeros(self.num_heads, n, dtype=torch.bool)
            keep.scatter_(1, self.kept, True)
            return torch.arange(n).expand(self.num_heads, -1)[~keep].view(self.num_heads, -1)
        self.length += n
        lo = self.lo if self.policy.recent is None else max(self.lo, self.length - self.policy.recent)
        demoted = torch.arange(self.lo, lo).expand(self.num_heads, -1).clone()
        self.lo = lo
        return demoted

    def full_count_after(self, n: int) -> int:
        p = self.policy
        if self.length == 0:
            return min(n, p.capacity + p.window)
        generated = self.length + n - self.lo
        return self.kept.shape[1] + (generated if p.recent is None else min(generated, p.recent))

    def full_positions(self) -> torch.Tensor:
        generated = torch.arange(self.lo, self.length).expand(self.num_heads, -1)
        return torch.cat([self.kept, generated], dim=1)
