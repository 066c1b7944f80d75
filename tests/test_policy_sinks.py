"""Sink tokens at full precision on top of any policy (``Sinks``; ``CompressedCache(..., sinks=S)``)."""

from __future__ import annotations

import pytest
import torch
from conftest import fused_and_materialized, teacher_forced_logits, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpolicy import CompressedCache
from kvpolicy.errors import ConfigError
from kvpolicy.policies import HeavyHitters, LogWindow, RecentWindow, Sinks, SinkWindow, log_full_positions
from kvpolicy.testing import check_policy, chunkings, run_policy

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _drive(policy, plan: list[int]) -> list[int]:
    state = policy.new_state()
    for n in plan:
        state.append(n)
    return list(state.full_positions())


# ------------------------------------------------------------------ the contract and the spec


def test_contract_over_the_log_policy():
    check_policy(
        st.builds(Sinks, policy=st.builds(LogWindow, window=st.integers(1, 12)), sinks=st.integers(0, 6)),
        max_full=lambda p, length, prompt: min(length, p.sinks) + min(max(length - p.sinks, 0), 3 * p.policy.window),
        chunking="any",
        max_length=160,
    )


def test_contract_over_the_recent_policy():
    check_policy(
        st.builds(Sinks, policy=st.builds(RecentWindow, window=st.integers(1, 12)), sinks=st.integers(0, 6)),
        max_full=lambda p, length, prompt: min(length, p.sinks + p.policy.window),
        chunking="any",
    )


def test_contract_over_h2o_per_head_and_score_based():
    check_policy(
        st.builds(
            Sinks,
            policy=st.builds(HeavyHitters, heavy=st.integers(0, 6), recent=st.integers(1, 6)),
            sinks=st.integers(0, 5),
        ),
        max_full=lambda p, length, prompt: (
            min(length, p.sinks) + min(max(length - p.sinks, 0), p.policy.heavy + p.policy.recent)
        ),
    )


@SETTINGS
@given(sinks=st.integers(0, 8), window=st.integers(1, 10), data=st.data())
def test_log_with_sinks_is_the_sinks_plus_the_shifted_closed_form(sinks, window, data):
    """``FP(T) = [0, min(S, T)) ∪ (S + FP_log(T - S))`` whatever the chunking."""
    total = data.draw(st.integers(0, 150))
    plan = data.draw(chunkings(total))
    got = _drive(Sinks(LogWindow(window), sinks), plan)
    rest = [sinks + p for p in log_full_positions(window, total - sinks)] if total > sinks else []
    assert got == list(range(min(sinks, total))) + rest


@SETTINGS
@given(sinks=st.integers(0, 8), window=st.integers(1, 10), data=st.data())
def test_sinks_over_a_sliding_window_is_the_sink_policy(sinks, window, data):
    """The reference: StreamingLLM's sink policy is exactly ``Sinks(RecentWindow(R), S)``."""
    plan = data.draw(chunkings(data.draw(st.integers(0, 120))))
    assert _drive(Sinks(RecentWindow(window), sinks), plan) == _drive(SinkWindow(sinks, window), plan)


@SETTINGS
@given(window=st.integers(1, 10), data=st.data())
def test_zero_sinks_is_the_wrapped_policy(window, data):
    plan = data.draw(chunkings(data.draw(st.integers(0, 120))))
    assert _drive(Sinks(LogWindow(window), 0), plan) == _drive(LogWindow(window), plan)


@settings(max_examples=30, deadline=None)
@given(sinks=st.integers(1, 5), heavy=st.integers(0, 5), recent=st.integers(1, 5), data=st.data())
def test_h2o_ranks_only_the_tokens_after_the_sinks(sinks, heavy, recent, data):
    """Driven with scores, the sinks never leave, and the rest is what H2O alone selects when given
    the same scores without the sink columns, positions shifted by ``S``."""
    plan = [sinks + data.draw(st.integers(1, 20)), *data.draw(st.lists(st.integers(1, 3), max_size=25))]
    wrapped = Sinks(HeavyHitters(heavy, recent), sinks).new_state(2)
    alone = HeavyHitters(heavy, recent).new_state(2)
    g = torch.Generator().manual_seed(sum(plan))
    for i, n in enumerate(plan):
        wrapped.append(n)
        alone.append(n - sinks if i == 0 else n)
        held = wrapped.full_positions()
        assert torch.equal(held[:, :sinks], torch.arange(sinks).expand(2, -1))
        assert torch.equal(held[:, sinks:], alone.full_positions() + sinks)
        scores = torch.randint(0, 9, held.shape, generator=g).float() / 8
        wrapped.observe(scores, held)
        alone.observe(scores[:, sinks:], held[:, sinks:] - sinks)


def test_state_saves_and_restores_mid_stream():
    policy = Sinks(HeavyHitters(3, 3), 2)
    plan = [10, 1, 1, 4, 1, 1, 1]
    steps = run_policy(policy, plan, heads=2, seed=3)
    again = run_policy(policy, plan, heads=2, seed=3, restore_after=3)
    assert again == steps


# ------------------------------------------------------------------ in a cache


def test_the_cache_keyword_wraps_any_policy_but_the_sink_policy_keeps_its_own():
    assert CompressedCache(policy="log", window=8, sinks=4).policy == Sinks(LogWindow(8), 4)
    assert CompressedCache(policy="h2o", heavy=2, recent=2, sinks=2).policy == Sinks(HeavyHitters(2, 2), 2)
    assert CompressedCache(policy=RecentWindow(5), sinks=3).policy == Sinks(RecentWindow(5), 3)
    assert CompressedCache(policy="sink", sinks=2, window=5).policy == SinkWindow(2, 5)
    assert "Sinks(policy=LogWindow(window=8), sinks=4)" in repr(CompressedCache(policy="log", window=8, sinks=4))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: CompressedCache(policy="log", sinks=-1), r"Sinks: sinks must be an integer >= 0; got sinks=-1"),
        (lambda: Sinks("log", 4), r"Sinks: policy must be a Policy object; got policy='log'"),
        (lambda: CompressedCache(policy="logg", sinks=4), r"unknown policy 'logg'; registered policies: \["),
        (
            lambda: CompressedCache(policy="sinks", sinks=4),
            r"policy='sinks' wraps another policy.*policy='log', sinks=4",
        ),
    ],
)
def test_bad_sinks_are_refused_naming_the_parameter(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def test_sinks_stay_at_full_precision_in_a_model():
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (1, 70), generator=torch.Generator().manual_seed(4))
    cache = CompressedCache(policy="log", window=8, sinks=4, bits=2, group_size=16)
    teacher_forced_logits(model, ids, 40, cache)
    full, length = cache.positions(0)["full"], cache.get_seq_length()
    assert length > 60
    assert full.flatten().tolist() == [0, 1, 2, 3] + [4 + p for p in log_full_positions(8, length - 4)]


def test_fused_equals_materialized_with_sinks(cpu_kernel):
    got, ref, cache = fused_and_materialized(sinks=4, backend="cpu", transform="hadamard")
    assert isinstance(cache.policy, Sinks)
    assert set(cache.attention_paths().values()) == {"fused (cpu)"}
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)


def test_saved_cache_with_sinks_loads_the_wrapped_policy(tmp_path):
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (2, 50), generator=torch.Generator().manual_seed(2))
    cache = CompressedCache(policy="h2o", heavy=4, recent=4, sinks=2, action="evict")
    from kvpolicy.attention import disable_scores, enable_scores

    enable_scores(model)
    try:
        with torch.no_grad():
            model(ids[:, :40], cache=cache, use_cache=True)
        cache.save(tmp_path / "c.kvc", model=model)
        loaded = CompressedCache.load(tmp_path / "c.kvc", model=model)
        assert loaded.policy == cache.policy == Sinks(HeavyHitters(4, 4), 2)
        for i in range(len(cache.layers)):
            assert torch.equal(loaded.positions(i)["full"], cache.positions(i)["full"])
    finally:
        disable_scores(model)
