"""``Policy.score_queries``: the attention wrapper reports only the last ``k`` query rows of a forward.

Reference: transformers' own eager attention weights ``(batch, q_heads, q_len, k_len)`` of the
same model, cut to their last ``k`` query rows and summed over the batch, those rows and the query
heads of each kv group.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache

from kvpolicy import CompressedCache
from kvpolicy.attention import enable_scores
from kvpolicy.errors import ConfigError
from kvpolicy.policies.base import Policy, PolicyState

KV_HEADS = 2  # tiny_model("llama"): 4 query heads, 2 kv heads


class RecordingState(PolicyState):
    """Keeps everything at full precision and records what ``observe`` receives."""

    def __init__(self, num_heads: int, log: list) -> None:
        self.num_heads = num_heads
        self.length = 0
        self.log = log

    def append(self, n: int) -> torch.Tensor:
        self.length += n
        return torch.empty(self.num_heads, 0, dtype=torch.long)

    def full_positions(self) -> torch.Tensor:
        return torch.arange(self.length).expand(self.num_heads, -1).clone()

    def full_count_after(self, n: int) -> int:
        return self.length + n

    def observe(self, scores: torch.Tensor, positions: torch.Tensor) -> None:
        self.log.append((scores.clone(), positions.clone()))


@dataclass(frozen=True)
class LastQueries(Policy):
    queries: int | None = 3

    name = "last-queries"
    per_head = True
    needs_scores = True

    @property
    def score_queries(self) -> int | None:
        return self.queries

    def new_state(self, num_heads: int = 1) -> RecordingState:
        log = LOGS.setdefault(self, [])
        return RecordingState(num_heads, log)


LOGS: dict[LastQueries, list] = {}


@pytest.fixture(autouse=True)
def _clean():
    LOGS.clear()
    yield


def _mass(weights: torch.Tensor, rows: int) -> torch.Tensor:
    b, hq, q, k = weights.shape
    w = weights[:, :, q - min(rows, q) :, :].float()
    return w.reshape(b, KV_HEADS, hq // KV_HEADS, -1, k).sum(dim=(0, 2, 3))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize(("queries", "prompt"), [(3, 12), (1, 12), (20, 12), (None, 12)])
def test_prefill_and_decode_scores_come_from_the_last_queries(attn, queries, prompt):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 96, (2, prompt + 1), generator=g)
    reference = tiny_model("llama", "eager", layers=1)
    ref_cache = DynamicCache()
    pre = reference(ids[:, :prompt], cache=ref_cache, use_cache=True, output_attentions=True).attentions[0]
    step = reference(ids[:, prompt:], cache=ref_cache, use_cache=True, output_attentions=True).attentions[0]

    model = tiny_model("llama", attn, layers=1)
    enable_scores(model)
    policy = LastQueries(queries=queries)
    cache = CompressedCache(policy=policy, action="evict")
    model(ids[:, :prompt], cache=cache, use_cache=True)
    model(ids[:, prompt:], cache=cache, use_cache=True)
    (prefill_scores, prefill_pos), (decode_scores, decode_pos) = LOGS[policy]
    rows = prompt if queries is None else queries
    assert prefill_scores.shape == (KV_HEADS, prompt)
    assert prefill_pos.tolist()[0] == list(range(prompt))
    assert torch.allclose(prefill_scores, _mass(pre, rows), atol=1e-5)
    # each query row is a probability distribution: batch 2 x 4 query heads x rows
    assert torch.allclose(prefill_scores.sum(), torch.tensor(2.0 * 4 * min(rows, prompt)), atol=1e-4)
    assert torch.allclose(decode_scores, _mass(step, 1), atol=1e-5)  # one query: the same whatever k
    assert decode_pos.tolist()[0] == list(range(prompt + 1))


def test_h2o_still_gets_every_query_row():
    assert CompressedCache(policy="h2o", action="evict").policy.score_queries is None


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_invalid_score_queries_is_refused(bad):
    model = tiny_model("llama", "sdpa", layers=1)
    enable_scores(model)
    cache = CompressedCache(policy=LastQueries(queries=bad), action="evict")
    with pytest.raises(ConfigError, match=f"score_queries must be None or an integer >= 1; got {bad!r}"):
        model(torch.randint(3, 96, (1, 6)), cache=cache, use_cache=True)
