"""Property and example tests of the recent-window policy (policies-spec.md (b)).

The references are independent brute-force state machines written here from the spec text:

- sliding: ``FP.append(t)``; while ``len(FP) > R``: demote ``FP.pop(0)``;
- flush: the first append is the prompt of length ``L``: ``quantize`` demotes all of it, ``keep_tail``
  keeps the last ``L mod R`` positions; after it, ``FP.append(t)``; if ``len(FP) > R``: demote
  ``FP[:R]`` and keep ``FP[R:]``.

The flush variant is also checked against transformers' own ``QuantizedLayer`` residual logic.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvpolicy.errors import ConfigError
from kvpolicy.policies.recent import RecentWindow
from kvpolicy.testing import check_policy, chunkings, with_examples

MAX_R = 64
SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------------------------------
# references and helpers
# --------------------------------------------------------------------------------------------------


def sliding_ref(window: int, length: int) -> tuple[list[list[int]], list[list[int]]]:
    """Single-append state machine of the sliding variant.

    Returns
    -------
    fps, demoted
        ``fps[T]`` is ``FP(T)`` for ``T = 0..length``; ``demoted[T]`` what the append that made the
        length ``T`` demoted (``demoted[0] == []``), in demotion order.
    """
    fp: list[int] = []
    fps: list[list[int]] = [[]]
    demoted: list[list[int]] = [[]]
    for t in range(length):
        fp.append(t)
        out: list[int] = []
        while len(fp) > window:
            out.append(fp.pop(0))
        fps.append(list(fp))
        demoted.append(out)
    return fps, demoted


def flush_ref(window: int, prompt: str, prompt_len: int, length: int) -> tuple[list[list[int]], list[list[int]]]:
    """State machine of the flush variant: a prompt of ``prompt_len >= 1``, then single appends up to ``length``.

    ``fps`` / ``demoted`` are indexed by ``T`` for ``T = prompt_len .. length`` (entries below
    ``prompt_len`` are ``None``); ``demoted[prompt_len]`` is what the prompt append demoted.
    """
    assert 1 <= prompt_len <= length
    fps: list = [None] * (length + 1)
    demoted: list = [None] * (length + 1)
    if prompt == "quantize":
        fp: list[int] = []
    else:
        fp = [p for p in range(prompt_len) if p >= prompt_len - prompt_len % window]
    fps[prompt_len] = list(fp)
    demoted[prompt_len] = [p for p in range(prompt_len) if p not in fp]
    for t in range(prompt_len, length):
        fp.append(t)
        out: list[int] = []
        if len(fp) > window:
            out, fp = fp[:window], fp[window:]
        fps[t + 1] = list(fp)
        demoted[t + 1] = out
    return fps, demoted


def drive(policy: RecentWindow, chunks: list[int]) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Append ``chunks`` one call each; return FP after each call, demoted per call, and lengths."""
    state = policy.new_state()
    fps, demoted, lengths = [], [], []
    for k in chunks:
        out = state.append(k)
        assert isinstance(out, list)
        demoted.append(out)
        fps.append(state.full_positions())
        lengths.append(state.length)
    return fps, demoted, lengths


def check_monotone(fps: list[list[int]], demoted: list[list[int]], lengths: list[int]) -> None:
    """Monotone FP(T+1) ⊆ FP(T) ∪ new positions; demoted = what left; FP and demoted partition [0, T)."""
    ever: set[int] = set()
    prev_fp: set[int] = set()
    prev_len = 0
    for fp, out, t in zip(fps, demoted, lengths, strict=True):
        assert fp == sorted(fp)
        assert len(set(fp)) == len(fp)
        assert all(0 <= p < t for p in fp)
        arrived = set(range(prev_len, t))
        assert set(fp) <= prev_fp | arrived
        assert len(set(out)) == len(out)
        assert set(out) == (prev_fp | arrived) - set(fp)
        assert not (set(out) & ever), "a position was demoted twice"
        ever |= set(out)
        assert not (set(fp) & ever), "a demoted position came back"
        assert set(fp) | ever == set(range(t))
        prev_fp, prev_len = set(fp), t


@st.composite
def r_and_t(draw, max_r: int = MAX_R, t_factor: int = 40):
    r = draw(st.integers(1, max_r))
    return r, draw(st.integers(0, t_factor * r))


@st.composite
def flush_case(draw):
    """(window, prompt mode, prompt length L >= 1, total length T >= L)."""
    r = draw(st.integers(1, MAX_R))
    prompt = draw(st.sampled_from(("quantize", "keep_tail")))
    special = [1, r - 1, r, r + 1, 2 * r, 3 * r + 1]
    prompt_len = draw(st.one_of(st.sampled_from([x for x in special if x >= 1]), st.integers(1, 8 * r)))
    total = prompt_len + draw(st.integers(0, 40 * r))
    return r, prompt, prompt_len, total


SLIDING_EDGES = [(1, 0), (1, 1), (1, 5), (2, 2), (2, 3), (3, 10), (64, 64), (64, 65), (64, 2560), (7, 200)]
FLUSH_EDGES = [
    (1, "quantize", 1, 10),
    (1, "keep_tail", 1, 10),
    (4, "quantize", 3, 30),
    (4, "keep_tail", 3, 30),
    (4, "keep_tail", 8, 30),
    (4, "keep_tail", 10, 30),
    (5, "quantize", 5, 5),
    (64, "keep_tail", 200, 2760),
    (64, "quantize", 128, 2688),
    (3, "keep_tail", 7, 7),
]


with_sliding_edges = with_examples("rt", SLIDING_EDGES)
with_flush_edges = with_examples("case", FLUSH_EDGES)


# --------------------------------------------------------------------------------------------------
# sliding variant
# --------------------------------------------------------------------------------------------------


@SETTINGS
@with_sliding_edges
@given(rt=r_and_t())
def test_sliding_exact_sets_counts_and_one_demotion_per_step(rt):
    r, t = rt
    fps, demoted, lengths = drive(RecentWindow(window=r), [1] * t)
    ref_fps, ref_dem = sliding_ref(r, t)
    assert lengths == list(range(1, t + 1))
    assert fps == ref_fps[1:]
    assert demoted == ref_dem[1:]
    for tt in range(1, t + 1):
        fp = fps[tt - 1]
        assert fp == list(range(max(0, tt - r), tt))
        assert len(fp) == min(tt, r)
        # exactly one demotion per step once T > R, namely T - 1 - R; none before
        assert demoted[tt - 1] == ([tt - 1 - r] if tt > r else [])
        # the newest min(T, R) positions are full precision
        assert set(range(tt - min(tt, r), tt)) <= set(fp)


@SETTINGS
@with_sliding_edges
@given(rt=r_and_t())
def test_sliding_monotone(rt):
    r, t = rt
    check_monotone(*drive(RecentWindow(window=r), [1] * t))


@st.composite
def sliding_chunks(draw):
    r, t = draw(r_and_t())
    return r, t, draw(chunkings(t))


@SETTINGS
@example(rtc=(1, 10, [10]))
@example(rtc=(4, 30, [3, 0, 1, 5, 21]))
@example(rtc=(64, 2560, [560, 0, 2000]))
@example(rtc=(64, 9000, [8192, 1, 807]))
@given(rtc=sliding_chunks())
def test_sliding_chunked_appends_equal_single_appends(rtc):
    r, t, chunks = rtc
    ref_fps, ref_dem = sliding_ref(r, t)
    state = RecentWindow(window=r).new_state()
    flat: list[int] = []
    done = 0
    for k in chunks:
        out = state.append(k)
        done += k
        assert state.length == done
        assert state.full_positions() == ref_fps[done]
        flat.extend(out)
    assert state.full_positions() == list(range(max(0, t - r), t))
    assert flat == [p for d in ref_dem for p in d]  # same demotion order as single appends


@SETTINGS
@with_sliding_edges
@given(rt=r_and_t())
def test_sliding_prefill_then_decode(rt):
    """A prefill of L followed by single appends equals L + k single appends (prefill = L single appends)."""
    r, t = rt
    prefill = t // 2
    ref_fps, ref_dem = sliding_ref(r, t)
    state = RecentWindow(window=r).new_state()
    assert state.append(prefill) == [p for d in ref_dem[: prefill + 1] for p in d]
    assert state.full_positions() == ref_fps[prefill]
    for tt in range(prefill + 1, t + 1):
        assert state.append(1) == ref_dem[tt]
        assert state.full_positions() == ref_fps[tt]


@SETTINGS
@given(rt=r_and_t(max_r=32, t_factor=10), data=st.data())
def test_sliding_prompt_parameter_is_ignored_and_deterministic(rt, data):
    r, t = rt
    chunks = data.draw(chunkings(t))
    runs = [
        drive(RecentWindow(window=r, variant="sliding", prompt=p), chunks)
        for p in ("quantize", "keep_tail", "quantize")
    ]
    assert runs[0] == runs[1] == runs[2]


@settings(max_examples=25, deadline=None)
@example(rt=(1, 5))
@example(rt=(4, 4))
@example(rt=(64, 2560))
@given(rt=r_and_t(max_r=64, t_factor=10))
def test_sliding_equals_transformers_sliding_window_mask(rt):
    """Spec: with the evict action this is Mistral's ``sliding_window=R`` attention."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    r, t = rt
    pos = torch.arange(t)
    allowed = sliding_window_causal_mask_function(r)(0, 0, pos[:, None], pos[None, :])  # (query, key)
    state = RecentWindow(window=r).new_state()
    for q in range(t):
        state.append(1)  # length q + 1: FP(q + 1) is what query q attends to
        assert state.full_positions() == allowed[q].nonzero().flatten().tolist()


def test_sliding_worked_example_r3():
    state = RecentWindow(window=3).new_state()
    assert state.append(1) == []
    assert state.full_positions() == [0]
    assert state.append(2) == []
    assert state.full_positions() == [0, 1, 2]
    assert state.append(1) == [0]
    assert state.full_positions() == [1, 2, 3]
    assert state.append(1) == [1]
    assert state.append(4) == [2, 3, 4, 5]
    assert state.full_positions() == [6, 7, 8]
    assert state.append(0) == []
    assert state.full_positions() == [6, 7, 8]
    assert state.length == 9


def test_sliding_large_prefill_is_cheap():
    state = RecentWindow(window=128).new_state()
    out = state.append(1_000_000)
    assert out == list(range(1_000_000 - 128))
    assert state.full_positions() == list(range(1_000_000 - 128, 1_000_000))


# --------------------------------------------------------------------------------------------------
# flush variant
# --------------------------------------------------------------------------------------------------


def flush_single(r: int, prompt: str, prompt_len: int, total: int):
    """Prompt append then single appends; returns fps/demoted indexed like :func:`flush_ref`."""
    state = RecentWindow(window=r, variant="flush", prompt=prompt).new_state()
    fps: list = [None] * (total + 1)
    demoted: list = [None] * (total + 1)
    demoted[prompt_len] = state.append(prompt_len)
    fps[prompt_len] = state.full_positions()
    assert state.length == prompt_len
    for tt in range(prompt_len + 1, total + 1):
        demoted[tt] = state.append(1)
        fps[tt] = state.full_positions()
        assert state.length == tt
    return fps, demoted


@SETTINGS
@with_flush_edges
@given(case=flush_case())
def test_flush_exact_sets_vs_reference(case):
    r, prompt, prompt_len, total = case
    assert flush_single(r, prompt, prompt_len, total) == flush_ref(r, prompt, prompt_len, total)


@SETTINGS
@with_flush_edges
@given(case=flush_case())
def test_flush_prompt_modes(case):
    r, prompt, prompt_len, total = case
    fps, demoted = flush_single(r, prompt, prompt_len, total)
    tail = prompt_len % r
    if prompt == "quantize":
        assert fps[prompt_len] == []
        assert demoted[prompt_len] == list(range(prompt_len))
    else:
        assert fps[prompt_len] == list(range(prompt_len - tail, prompt_len))
        assert demoted[prompt_len] == list(range(prompt_len - tail))
    # the kept tail has < R positions, so the first decoding step only adds its token
    if total > prompt_len:
        assert demoted[prompt_len + 1] == []
        assert fps[prompt_len + 1] == fps[prompt_len] + [prompt_len]


@SETTINGS
@with_flush_edges
@given(case=flush_case())
def test_flush_decoding_bounds_and_r_at_a_time(case):
    r, prompt, prompt_len, total = case
    fps, demoted = flush_single(r, prompt, prompt_len, total)
    start = 0 if prompt == "quantize" else prompt_len % r  # |FP| right after the prompt
    for tt in range(prompt_len + 1, total + 1):
        fp = fps[tt]
        assert 1 <= len(fp) <= r
        # FP is a contiguous suffix that always holds the newest token
        assert fp == list(range(tt - len(fp), tt))
        # closed form of the size: it cycles 1..R, starting from the kept tail
        assert len(fp) == (start + tt - prompt_len - 1) % r + 1
        out = demoted[tt]
        if out:
            # a flush: exactly the oldest R full-precision positions, leaving FP = {t}
            assert len(out) == r
            assert out == fps[tt - 1]
            assert out == list(range(tt - 1 - r, tt - 1))
            assert fp == [tt - 1]
            assert len(fps[tt - 1]) == r
        else:
            assert fp == fps[tt - 1] + [tt - 1]


@SETTINGS
@with_flush_edges
@given(case=flush_case())
def test_flush_monotone(case):
    r, prompt, prompt_len, total = case
    policy = RecentWindow(window=r, variant="flush", prompt=prompt)
    check_monotone(*drive(policy, [prompt_len] + [1] * (total - prompt_len)))


@st.composite
def flush_chunked_case(draw):
    r, prompt, prompt_len, total = draw(flush_case())
    leading_zeros = draw(st.integers(0, 2))
    return r, prompt, prompt_len, total, [0] * leading_zeros + [prompt_len] + draw(chunkings(total - prompt_len))


@SETTINGS
@example(case=(4, "quantize", 3, 30, [3, 27]))
@example(case=(4, "keep_tail", 10, 30, [0, 10, 0, 5, 1, 14]))
@example(case=(1, "keep_tail", 1, 20, [1, 19]))
@example(case=(64, "quantize", 8192, 8192 + 500, [8192, 1, 64, 63, 128, 244]))
@given(case=flush_chunked_case())
def test_flush_chunked_appends_after_prompt_equal_single_appends(case):
    """A later multi-token append (second user turn) behaves as single appends; zero appends are no-ops."""
    r, prompt, prompt_len, total, chunks = case
    ref_fps, ref_dem = flush_ref(r, prompt, prompt_len, total)
    state = RecentWindow(window=r, variant="flush", prompt=prompt).new_state()
    flat: list[int] = []
    done = 0
    for k in chunks:
        out = state.append(k)
        done += k
        assert state.length == done
        if done >= prompt_len:
            assert state.full_positions() == ref_fps[done]
        else:
            assert done == 0 and out == [] and state.full_positions() == []
        flat.extend(out)
    assert flat == [p for d in ref_dem[prompt_len:] for p in d]  # same demotion order


@SETTINGS
@with_flush_edges
@given(case=flush_case())
def test_flush_deterministic(case):
    r, prompt, prompt_len, total = case
    policy = RecentWindow(window=r, variant="flush", prompt=prompt)
    chunks = [prompt_len] + [1] * (total - prompt_len)
    a, b = policy.new_state(), RecentWindow(window=r, variant="flush", prompt=prompt).new_state()
    other = policy.new_state()
    for k in chunks:
        assert a.append(k) == b.append(k)
        other.append(2)  # an unrelated state of the same policy, to catch shared state
        assert a.full_positions() == b.full_positions()
        assert a.length == b.length


def test_flush_worked_example_quantize_r4():
    state = RecentWindow(window=4, variant="flush", prompt="quantize").new_state()
    assert state.append(6) == [0, 1, 2, 3, 4, 5]
    assert state.full_positions() == []
    sizes, flushes = [], {}
    for t in range(6, 16):
        out = state.append(1)
        sizes.append(len(state.full_positions()))
        if out:
            flushes[t] = out
    assert sizes == [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    assert flushes == {10: [6, 7, 8, 9], 14: [10, 11, 12, 13]}
    assert state.full_positions() == [14, 15]


def test_flush_worked_example_keep_tail_r4():
    state = RecentWindow(window=4, variant="flush", prompt="keep_tail").new_state()
    assert state.append(10) == list(range(8))
    assert state.full_positions() == [8, 9]
    assert state.append(1) == []
    assert state.append(1) == []
    assert state.full_positions() == [8, 9, 10, 11]
    assert state.append(1) == [8, 9, 10, 11]
    assert state.full_positions() == [12]
    # a second user turn of 9 tokens = 9 single appends: sizes 2, 3, 4, (flush) 1, 2, 3, 4, (flush) 1, 2
    assert state.append(9) == [12, 13, 14, 15, 16, 17, 18, 19]
    assert state.full_positions() == [20, 21]


def test_flush_keep_tail_prompt_multiple_of_r_keeps_nothing():
    state = RecentWindow(window=4, variant="flush", prompt="keep_tail").new_state()
    assert state.append(8) == list(range(8))
    assert state.full_positions() == []
    assert state.append(1) == []
    assert state.full_positions() == [8]


def test_flush_zero_append_does_not_consume_prompt():
    state = RecentWindow(window=4, variant="flush", prompt="keep_tail").new_state()
    assert state.append(0) == []
    assert state.length == 0
    assert state.append(5) == [0, 1, 2, 3]
    assert state.full_positions() == [4]


def test_flush_large_prefill_is_cheap():
    state = RecentWindow(window=128, variant="flush", prompt="keep_tail").new_state()
    assert state.append(1_000_000) == list(range(1_000_000 - 1_000_000 % 128))
    assert state.full_positions() == list(range(1_000_000 - 64, 1_000_000))
    # a second turn of 1M tokens (as single appends): FP stays a contiguous suffix of 1..R positions
    out = state.append(1_000_000)
    fp = state.full_positions()
    assert state.length == 2_000_000
    assert 1 <= len(fp) <= 128
    assert fp == list(range(2_000_000 - len(fp), 2_000_000))
    assert out == list(range(1_000_000 - 64, fp[0]))
    assert len(out) % 128 == 0


# --------------------------------------------------------------------------------------------------
# flush == transformers' QuantizedLayer residual logic
# --------------------------------------------------------------------------------------------------


def _identity_layer(residual_length: int):
    from transformers.cache_utils import QuantizedLayer

    class FlaggingQuantizedLayer(QuantizedLayer):
        """Identity "quantizer" that marks what went through it: channel 1 is set to 1.

        Channel 0 carries the position unchanged, so the returned keys say, per position, whether HF
        served it from its quantized storage (flag 1) or at full precision (flag 0).
        """

        def _quantize(self, tensor, axis):
            out = tensor.clone()
            out[..., 1] = 1.0
            return out

        def _dequantize(self, q_tensor):
            return q_tensor

    return FlaggingQuantizedLayer(nbits=2, q_group_size=64, residual_length=residual_length)


def _keys(start: int, n: int) -> torch.Tensor:
    """``(1, 1, n, 2)`` keys: channel 0 = position, channel 1 = 0 (not quantized)."""
    k = torch.zeros(1, 1, n, 2, dtype=torch.float64)
    k[0, 0, :, 0] = torch.arange(start, start + n, dtype=torch.float64)
    return k


@pytest.mark.parametrize("r", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("prompt_kind", ["one", "lt", "eq", "gt", "mult", "mult_plus"])
def test_flush_quantize_matches_transformers_quantized_layer(r, prompt_kind):
    prompt_len = {
        "one": 1,
        "lt": max(1, r - 1),
        "eq": r,
        "gt": r + 1,
        "mult": 3 * r,
        "mult_plus": 2 * r + max(1, r // 2),
    }[prompt_kind]
    steps = 3 * r + 5
    layer = _identity_layer(r)
    state = RecentWindow(window=r, variant="flush", prompt="quantize").new_state()

    keys = _keys(0, prompt_len)
    out_k, _ = layer.update(keys, keys.clone())
    state.append(prompt_len)
    # prefill attention uses the full-precision prompt; afterwards HF holds it all quantized
    assert torch.equal(out_k, keys)
    assert layer.keys.numel() == 0
    assert layer._quantized_keys[0, 0, :, 1].eq(1).all()
    assert state.full_positions() == []

    for t in range(prompt_len, prompt_len + steps):
        residual_before = [int(p) for p in layer.keys[0, 0, :, 0].tolist()] if layer.keys.dim() == 4 else []
        new = _keys(t, 1)
        out_k, _ = layer.update(new, new.clone())
        assert out_k[0, 0, :, 0].tolist() == list(range(t + 1))  # every position, in order
        hf_full = [int(p) for p, flag in out_k[0, 0].tolist() if flag == 0]
        # two independent readings of HF's full-precision set at attention time agree
        assert hf_full == [*residual_before, t]
        state.append(1)
        assert state.full_positions() == hf_full, f"R={r} L={prompt_len} t={t}"
        assert state.length == layer.get_seq_length() == t + 1


# --------------------------------------------------------------------------------------------------
# validation and defaults
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "8", None])
def test_window_validation(bad):
    with pytest.raises(ConfigError) as info:
        RecentWindow(window=bad)
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert "window" in msg
    assert repr(bad) in msg


@pytest.mark.parametrize(
    ("param", "bad"), [("variant", "flushed"), ("variant", None), ("prompt", "keep"), ("prompt", 1)]
)
def test_choice_validation(param, bad):
    with pytest.raises(ConfigError) as info:
        RecentWindow(**{param: bad})
    msg = str(info.value)
    assert param in msg
    assert repr(bad) in msg


def test_prompt_validated_for_sliding_too():
    with pytest.raises(ConfigError, match="prompt"):
        RecentWindow(variant="sliding", prompt="nope")


def test_defaults_and_class_attributes():
    policy = RecentWindow()
    assert (policy.window, policy.variant, policy.prompt) == (128, "sliding", "quantize")
    assert RecentWindow.name == "recent"
    assert RecentWindow.per_head is False
    assert RecentWindow.needs_scores is False
    assert policy.new_state().window == 128
    assert policy.new_state(num_heads=8).full_positions() == []
    with pytest.raises(Exception):  # noqa: B017 - frozen dataclass
        policy.window = 3  # type: ignore[misc]
    assert RecentWindow(window=5) == RecentWindow(window=5)
    assert hash(RecentWindow(window=5)) == hash(RecentWindow(window=5))


@pytest.mark.parametrize("variant", ["sliding", "flush"])
@pytest.mark.parametrize("bad", [-1, 1.0, True])
def test_append_rejects_bad_counts(variant, bad):
    state = RecentWindow(window=4, variant=variant).new_state()
    with pytest.raises(ValueError):
        state.append(bad)


def test_policy_contract_sliding():
    """kvpolicy.testing's generic contract: monotone, |FP| <= min(T, R), consistent, chunking-invariant."""
    check_policy(
        st.builds(RecentWindow, window=st.integers(1, 16), prompt=st.sampled_from(["quantize", "keep_tail"])),
        max_full=lambda policy, length, prompt: min(length, policy.window),
        chunking="any",
    )


def test_policy_contract_flush():
    """The flush variant: |FP| <= R; the prompt is special, so chunking-invariant only after it."""
    check_policy(
        st.builds(
            RecentWindow,
            window=st.integers(1, 16),
            variant=st.just("flush"),
            prompt=st.sampled_from(["quantize", "keep_tail"]),
        ),
        max_full=lambda policy, length, prompt: policy.window,
        chunking="after_prompt",
    )
