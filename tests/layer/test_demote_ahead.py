"""``HeldTokens.demote_ahead``: a decode step's demotions applied before its append (as the forward pre-hook does, so
that a compiled forward changes no layout) leave the layer holding exactly what the plain append would, step for
step: the same views bit for bit, the same positions, moves, crops and mask sizes. An announcement that the append
does not match is an error, never a silent drift between the policy and the held tokens."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy.actions.evict import Evict
from kvpolicy.actions.quantize import Quantize
from kvpolicy.actions.tiered import Tiered
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.layer.composition import Composition, Plan
from kvpolicy.layer.held import HeldTokens
from kvpolicy.policies import LogWindow, RecentWindow, Sinks, SinkWindow
from kvpolicy.policies.base import Policy, PolicyState
from kvpolicy.transforms import NoTransform

D = 16


class _KeepFirstState(PolicyState):
    """Keeps position 0 and demotes every later token in the append that brings it: the coming token itself."""

    def __init__(self) -> None:
        self.length = 0

    def append(self, n: int) -> list[int]:
        start, self.length = self.length, self.length + n
        return [p for p in range(start, self.length) if p > 0]

    def full_positions(self) -> list[int]:
        return [0] if self.length else []


@dataclass(frozen=True)
class _KeepFirst(Policy):
    name = "keep-first-test"

    def new_state(self, num_heads: int = 1) -> PolicyState:
        return _KeepFirstState()


POLICIES = {
    "log": lambda w: LogWindow(w),
    "recent": lambda w: RecentWindow(w),
    "sink": lambda w: SinkWindow(sinks=2, window=w),
    "sinks+log": lambda w: Sinks(LogWindow(w), sinks=3),
    "keep-first": lambda w: _KeepFirst(),
}
ACTIONS = {
    "quantize": lambda: Quantize(bits=2, group_size=8),
    "evict": Evict,
    "tiered": lambda: Tiered(
        tiers=[Quantize(bits=4, group_size=8, key_axis="token"), Quantize(bits=2, group_size=8)], keep=[LogWindow(2)]
    ),
}


def _started(policy: Policy, action: object) -> HeldTokens:
    backend = TorchBackend()
    held = HeldTokens(Composition(policy, action, backend, NoTransform()), Plan(backend, action), layer_idx=0)
    held.start(*_tokens(0, 0))
    return held


def _tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, n, D, generator=g), torch.randn(1, 2, n, D, generator=g)


def _same(a: HeldTokens, b: HeldTokens) -> None:
    for x, y in zip(a.view("ordered"), b.view("ordered"), strict=True):
        assert torch.equal(x, y)
    pa, pb = a.positions(), b.positions()
    assert pa.keys() == pb.keys()
    for key in pa:
        assert torch.equal(pa[key], pb[key]), key
    assert (a.moves, a.length, a.pending, a._rewinds) == (b.moves, b.length, b.pending, b._rewinds)


@settings(max_examples=50, deadline=None)
@given(
    policy=st.sampled_from(list(POLICIES)),
    action=st.sampled_from(list(ACTIONS)),
    window=st.integers(1, 5),
    prompt=st.integers(1, 40),
    steps=st.lists(st.integers(0, 2), min_size=1, max_size=40),
)
def test_demoting_ahead_holds_what_the_plain_append_holds(policy, action, window, prompt, steps):
    """A prompt, then single-token steps, each announced 0, 1 or 2 times (an announcement stands until its append)
    to one layer and never to its twin: after every step both hold the same, bit for bit."""
    ahead, plain = (_started(POLICIES[policy](window), ACTIONS[action]()) for _ in range(2))
    for held in (ahead, plain):
        held.append(*_tokens(prompt, 0))
    ahead.demote_ahead(2)  # an announcement of several tokens changes nothing
    assert ahead._ahead is None
    for i, announced in enumerate(steps):
        for _ in range(announced):
            ahead.demote_ahead(1)
        assert ahead.mask_sizes(1) == plain.mask_sizes(1)  # what the step's attention mask is built for
        for held in (ahead, plain):
            held.append(*_tokens(1, i + 1))
        assert ahead._ahead is None and ahead._late is None
        _same(ahead, plain)


def test_the_demotion_happens_at_the_announcement_and_the_append_only_appends():
    """LogWindow(2) thins when its seventh token comes: announced, the thinning moves the tokens before the append,
    which then moves nothing."""
    held = _started(LogWindow(2), Quantize(bits=2, group_size=8))
    for i in range(6):
        held.append(*_tokens(1, i))
    moves = held.moves
    held.demote_ahead(1)  # the seventh token makes R hold 3W + 1 = 7 positions: the oldest 2W thin
    assert held.moves == moves + 1 and held.length == 6
    assert held.positions()["compressed"].tolist() == [1, 3]
    held.append(*_tokens(1, 6))
    assert held.moves == moves + 1 and held.positions()["full"].tolist() == [0, 2, 4, 5, 6]


def test_a_demotion_that_names_the_coming_token_waits_for_it():
    held, twin = _started(_KeepFirst(), Evict()), _started(_KeepFirst(), Evict())
    for h in (held, twin):
        h.append(*_tokens(1, 0))
    held.demote_ahead(1)
    assert held._late == [1] and held.moves == 0
    for h in (held, twin):
        h.append(*_tokens(1, 1))
    _same(held, twin)
    assert held.positions()["full"].tolist() == [0]


@pytest.mark.parametrize("n", [2, 0])
def test_an_append_that_is_not_the_announced_token_fails_the_layer(n):
    held = _started(LogWindow(2), Quantize(bits=2, group_size=8))
    held.append(*_tokens(5, 0))
    held.demote_ahead(1)
    with pytest.raises(RuntimeError, match=r"told of one new token at position 5 before the forward, but the layer "
                       rf"received {n} token\(s\) at position 5"):  # fmt: skip
        held.append(*_tokens(n, 1))
    with pytest.raises(RuntimeError, match="failed while demoting"):
        held.append(*_tokens(1, 2))


def test_crop_and_save_refuse_while_an_announced_token_has_not_come():
    held = _started(LogWindow(4), Quantize(bits=2, group_size=8))  # 8 tokens thin nothing: a crop may take one back
    held.append(*_tokens(5, 0))
    held.append(*_tokens(1, 1))
    held.demote_ahead(1)
    for act, what in ((lambda: held.crop(1), r"crop\(tokens_to_remove=-1\)"), (held.state_dict, "saving the cache")):
        with pytest.raises(RuntimeError, match=rf"{what} on layer 0: a forward announced token 6 .* stopped before"):
            act()
    held.append(*_tokens(1, 2))  # the announced token: the layer goes on
    held.crop(1)
    assert held.length == 6
