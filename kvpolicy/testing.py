"""Reusable hypothesis checks for policies and transforms (needs the ``test`` extra: hypothesis).

Any policy, built in or from a plugin, can be checked against the contract of
:mod:`kvpolicy.policies.base` from a plain pytest test::

    from hypothesis import strategies as st
    from kvpolicy.testing import check_policy

    def test_contract():
        check_policy(st.builds(MyPolicy, window=st.integers(1, 8)),
                     max_full=lambda policy, length, prompt: policy.window, chunking="any")

and any transform against :mod:`kvpolicy.transforms.base` with :func:`check_transform`.

:func:`run_policy` (drive a state as the cache does) and :func:`check_trace` (the contract over one
trace) are the pieces, for policies that need their own inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hypothesis import example
from hypothesis import strategies as st

if TYPE_CHECKING:
    import torch

    from kvpolicy.policies.base import Policy
    from kvpolicy.transforms.base import Transform


@st.composite
def chunkings(draw: st.DrawFn, total: int, first_nonzero: bool = False) -> list[int]:
    """Chunk sizes summing to ``total``: how a sequence of ``total`` appends may be split into calls.

    Zeros are allowed (except for the first chunk when ``first_nonzero``, e.g. to keep the prompt
    the first real append); at most about 400 chunks of at most 200.
    """
    sizes: list[int] = []
    left = total
    while left > 0:
        k = draw(st.integers(1 if first_nonzero and not sizes else 0, min(left, 200)))
        sizes.append(k)
        left -= k
        if len(sizes) > 400:  # keep draws bounded
            sizes.append(left)
            left = 0
    return sizes


def with_examples(argument: str, cases: list) -> Callable[[Callable], Callable]:
    """Decorate a ``@given`` test with ``@example(argument=case)`` for every case (edge cases that
    must always run, whatever hypothesis draws)."""

    def decorate(test: Callable) -> Callable:
        for case in cases:
            test = example(**{argument: case})(test)
        return test

    return decorate


# --------------------------------------------------------------------------------------------------
# the policy contract, checkable on any policy
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One ``append(n)`` of a driven policy state.

    Attributes
    ----------
    n : int
        Positions appended.
    length : int
        ``state.length`` after the append (the logical length ``T``).
    predicted : int
        ``full_count_after(n)`` asked just before the append.
    demoted : tuple of tuple of int
        Per row (kv-head for per-head policies, one row for shared ones): the positions ``append``
        returned, in its order.
    full : tuple of tuple of int
        Per row: ``full_positions()`` after the append.
    """

    n: int
    length: int
    predicted: int
    demoted: tuple[tuple[int, ...], ...]
    full: tuple[tuple[int, ...], ...]


def _rows(value: list[int] | torch.Tensor, policy: Policy, heads: int, what: str) -> tuple[tuple[int, ...], ...]:
    """Normalise an ``append``/``full_positions`` answer to rows of ints, checking its type and shape."""
    import torch

    if policy.per_head:
        assert isinstance(value, torch.Tensor), f"{what}: a per-head policy must return a tensor, got {type(value)}"
        assert value.dtype == torch.int64, f"{what}: dtype must be int64, got {value.dtype}"
        assert value.dim() == 2 and value.shape[0] == heads, (
            f"{what}: shape must be (num_heads={heads}, k) (equal counts per head), got {tuple(value.shape)}"
        )
        return tuple(tuple(row) for row in value.tolist())
    assert isinstance(value, list), f"{what}: a shared policy must return a list of int, got {type(value)}"
    assert all(isinstance(p, int) and not isinstance(p, bool) for p in value), f"{what}: not all ints: {value}"
    return (tuple(value),)


def reloaded(policy: Policy, state: Any, heads: int) -> Any:
    """``state`` saved and restored as a saved cache does it (``state_dict`` -> JSON for everything
    but tensors -> ``load_state_dict`` into ``policy.new_state(heads)``)."""
    import json

    import torch

    saved = state.state_dict()
    tensors = {k: v.clone() for k, v in saved.items() if isinstance(v, torch.Tensor)}
    plain = json.loads(json.dumps({k: v for k, v in saved.items() if k not in tensors}, allow_nan=False))
    fresh = policy.new_state(num_heads=heads)
    fresh.load_state_dict({**plain, **tensors})
    return fresh


def run_policy(
    policy: Policy, plan: list[int], heads: int = 1, seed: int = 0, restore_after: int | None = None
) -> list[Step]:
    """Drive ``policy.new_state(heads)`` through the appends of ``plan`` the way the cache does.

    ``plan[0]`` is the prompt, the rest are later forwards (1: a decode step). For policies that
    ``needs_scores``, each forward also calls ``observe`` as :class:`kvpolicy.cache.CompressedLayer`
    does: a multi-token forward is observed over the held positions plus its own (not appended yet)
    and appended at the start of the next forward; a single token is appended first, then observed
    over the held positions. Scores are seeded random multiples of 1/4 (exact in float32, with ties).

    ``restore_after=i``: after the ``i``-th forward of ``plan``, the state is replaced by its saved
    and restored copy (:func:`reloaded`), as when a cache is saved and loaded there.

    Returns
    -------
    list of Step
        One per ``append`` (zero-sized entries of ``plan`` are appended as ``append(0)``).
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    state = policy.new_state(num_heads=heads)
    steps: list[Step] = []

    def full_tensor() -> torch.Tensor:
        full = state.full_positions()
        return full.clone() if isinstance(full, torch.Tensor) else torch.tensor(full, dtype=torch.long).view(1, -1)

    def observe(positions: torch.Tensor) -> None:
        scores = torch.randint(0, 5, (heads, positions.shape[1]), generator=g).float() / 4
        state.observe(scores, positions)

    def do_append(n: int) -> None:
        predicted = state.full_count_after(n)
        assert isinstance(predicted, int) and not isinstance(predicted, bool), (
            f"full_count_after({n}) must return an int, got {predicted!r}"
        )
        demoted = _rows(state.append(n), policy, heads, f"append({n})")
        full = _rows(state.full_positions(), policy, heads, "full_positions()")
        steps.append(Step(n, state.length, predicted, demoted, full))

    pending = 0
    for i, n in enumerate(plan):
        if i and i - 1 == restore_after:
            state = reloaded(policy, state, heads)
        if not policy.needs_scores or n == 0:
            do_append(n)
            continue
        if pending:
            do_append(pending)
            pending = 0
        if n == 1:
            do_append(1)
            observe(full_tensor())
        else:
            held = full_tensor()
            new = torch.arange(state.length, state.length + n).expand(held.shape[0], n)
            observe(torch.cat([held, new], dim=1))
            pending = n
    if pending:
        do_append(pending)
    return steps


def check_trace(
    policy: Policy, steps: list[Step], prompt: int, max_full: Callable[[Policy, int, int], int] | None = None
) -> None:
    """Assert the policy contract over one driven trace (see :func:`check_policy`)."""
    rows = len(steps[0].full) if steps else 0
    before: list[set[int]] = [set() for _ in range(rows)]
    ever: list[set[int]] = [set() for _ in range(rows)]
    length = 0
    for i, step in enumerate(steps):
        where = f"{policy!r}, step {i} (append({step.n}), T={step.length})"
        assert step.length == length + step.n, f"{where}: state.length is {step.length}, expected {length + step.n}"
        new = set(range(length, step.length))
        length = step.length
        counts = {len(row) for row in step.full}
        assert len(counts) == 1, f"{where}: rows hold different numbers of positions: {sorted(counts)}"
        count = counts.pop()
        assert step.predicted == count, f"{where}: full_count_after predicted {step.predicted}, got {count}"
        if max_full is not None:
            bound = max_full(policy, length, prompt)
            assert count <= bound, f"{where}: {count} positions at full precision, bound {bound}"
        for h, (full, demoted) in enumerate(zip(step.full, step.demoted, strict=True)):
            full_set, demoted_set = set(full), set(demoted)
            assert list(full) == sorted(full_set), f"{where}, row {h}: full_positions not sorted/unique: {full}"
            assert all(0 <= p < length for p in full), f"{where}, row {h}: position out of [0, {length}): {full}"
            assert len(demoted_set) == len(demoted), f"{where}, row {h}: a position demoted twice in one step"
            assert not demoted_set & ever[h], f"{where}, row {h}: demoted again: {sorted(demoted_set & ever[h])}"
            assert not full_set & ever[h], (
                f"{where}, row {h}: demoted positions came back: {sorted(full_set & ever[h])}"
            )
            assert full_set <= before[h] | new, f"{where}, row {h}: FP(T+n) not within FP(T) ∪ new"
            expected = (before[h] | new) - full_set
            assert demoted_set == expected, (
                f"{where}, row {h}: append returned {sorted(demoted_set)}, but {sorted(expected)} left the "
                "full-precision set"
            )
            before[h] = full_set
            ever[h] |= demoted_set


@st.composite
def plans(draw: st.DrawFn, max_length: int = 120, max_chunk: int = 16) -> list[int]:
    """A prompt length (``>= 1``) followed by forwards of mostly single tokens, sometimes several,
    ``max_length`` positions in all at most."""
    total = draw(st.integers(1, max_length))
    prompt = draw(st.integers(1, total))
    plan = [prompt]
    left = total - prompt
    while left > 0:
        k = draw(st.one_of(st.just(1), st.just(1), st.integers(1, min(left, max_chunk))))
        plan.append(k)
        left -= k
    return plan


def check_policy(
    policy: Policy | Callable[[], Policy] | st.SearchStrategy[Policy],
    *,
    max_full: Callable[[Policy, int, int], int],
    chunking: str | None = None,
    max_length: int = 120,
    max_heads: int = 3,
    max_examples: int = 40,
) -> None:
    """Check the policy contract with hypothesis; call it from a plain pytest test.

    Over random prompt lengths, follow-up forwards (mostly single tokens), kv-head counts and
    attention scores, the state is driven as the cache drives it (:func:`run_policy`) and must:

    - demote monotonically: ``FP(T+n) ⊆ FP(T) ∪ new`` and a demoted position never returns;
    - answer ``append`` with exactly the positions that left the full-precision set (no duplicates);
    - keep ``full_positions()`` sorted, in ``[0, T)``, with ``len == full_count_after(n)`` asked before;
    - stay within the bound: ``|FP| <= max_full(policy, T, prompt)`` after every append;
    - hold equal counts in every head (per-head policies: ``(num_heads, k)`` int64 tensors);
    - be deterministic: the same inputs give the same trace;
    - survive saving: a state saved with ``state_dict`` (its non-tensor part through JSON) and
      restored with ``load_state_dict`` at a random point answers exactly as the original;
    - with ``chunking="any"``: give the same full-precision sets at every chunk boundary, whatever
      the chunking of the appends (the prompt included); ``"after_prompt"``: the same, once the
      first append (the prompt) is done. Only for policies that do not use scores;
    - if the policy declares ``splits_appends`` (``Policy.splits_appends``): demote, for every append of
      ``n`` tokens split into appends of ``k`` and ``n - k``, the positions the single append demotes, in
      the same order (the cache then demotes a prompt in parts, see ``kvpolicy.segments.CROP_WINDOW``).

    Parameters
    ----------
    policy : Policy, callable or hypothesis strategy
        The policy, a zero-argument factory (e.g. the class, for its defaults) or a strategy of
        policies (``st.builds(MyPolicy, window=st.integers(1, 8))``).
    max_full : callable
        ``max_full(policy, T, prompt) -> int``: the most positions allowed at full precision after
        ``T`` appended positions of which the first ``prompt`` were the prompt.
    chunking : {None, "any", "after_prompt"}
        Which chunking invariance the policy claims.
    max_length : int
        Longest sequence tried; keep the policy's parameters small enough to demote within it.
    max_heads : int
        Most kv-heads tried (per-head policies; shared ones run with one).
    max_examples : int
        Hypothesis examples.

    Examples
    --------
    >>> check_policy(st.builds(SinkWindow, sinks=st.integers(0, 4), window=st.integers(1, 8)),
    ...              max_full=lambda p, t, prompt: p.sinks + p.window, chunking="any")
    """
    from hypothesis import HealthCheck, given, settings

    from kvpolicy.errors import ConfigError

    if chunking not in (None, "any", "after_prompt"):
        raise ConfigError(f"check_policy: chunking must be one of [None, 'any', 'after_prompt']; got {chunking!r}")
    if isinstance(policy, st.SearchStrategy):
        policies = policy
    elif isinstance(policy, type) or (callable(policy) and not hasattr(policy, "new_state")):
        policies = st.builds(policy)  # a class (its defaults) or a factory
    elif hasattr(policy, "new_state"):
        policies = st.just(policy)
    else:
        raise ConfigError(f"check_policy: policy must be a Policy, a factory or a strategy; got {policy!r}")

    @settings(max_examples=max_examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(policy=policies, plan=plans(max_length), heads=st.integers(1, max_heads), seed=st.integers(0, 2**16))
    def contract(policy: Policy, plan: list[int], heads: int, seed: int) -> None:
        if not policy.per_head:
            heads = 1
        if chunking is not None and policy.needs_scores:
            raise ConfigError(f"check_policy: chunking={chunking!r} is for policies that do not use scores")
        steps = run_policy(policy, plan, heads, seed)
        check_trace(policy, steps, plan[0], max_full)
        assert run_policy(policy, plan, heads, seed) == steps, f"{policy!r}: not deterministic for plan {plan}"
        cut = seed % (len(plan) - 1) if len(plan) > 1 else None  # restored before a later forward
        assert cut is None or run_policy(policy, plan, heads, seed, restore_after=cut) == steps, (
            f"{policy!r}: a state saved and restored (state_dict/load_state_dict) after forward {cut} of plan "
            f"{plan} answers differently"
        )
        if getattr(policy, "splits_appends", False):
            _check_split_appends(policy, plan, heads, seed, steps)
        if chunking is not None:
            singles = [plan[0], *[1] * (sum(plan) - plan[0])] if chunking == "after_prompt" else [1] * sum(plan)
            reference = {s.length: s.full for s in run_policy(policy, singles, heads, seed)}
            for s in steps:
                if s.n:
                    assert s.full == reference[s.length], (
                        f"{policy!r}: after T={s.length}, appends {plan} give {s.full}, single appends "
                        f"{reference[s.length]}"
                    )

    contract()


def _check_split_appends(policy: Policy, plan: list[int], heads: int, seed: int, steps: list[Step]) -> None:
    """``splits_appends``: each append of ``plan`` split in two (at a point drawn from ``seed``) demotes,
    concatenated, what the unsplit append demotes, and leaves the same full-precision set."""
    assert not policy.needs_scores, f"{policy!r}: splits_appends is for policies that do not use scores"
    split: list[int] = []
    for i, n in enumerate(plan):
        k = (seed + 7 * i) % (n + 1)
        split += [k, n - k]
    parts = run_policy(policy, split, heads, seed)
    for i, whole in enumerate(steps):
        a, b = parts[2 * i], parts[2 * i + 1]
        joined = tuple(x + y for x, y in zip(a.demoted, b.demoted, strict=True))
        assert joined == whole.demoted and b.full == whole.full, (
            f"{policy!r} declares splits_appends, but append({whole.n}) after T={whole.length - whole.n} demotes "
            f"{whole.demoted}, and append({a.n}) then append({b.n}) demote {a.demoted} then {b.demoted}"
        )


# --------------------------------------------------------------------------------------------------
# the transform contract
# --------------------------------------------------------------------------------------------------

#: head dims :func:`check_transform` draws from (those a transform refuses are checked to be refused
#: with a ConfigError, then skipped)
HEAD_DIMS = (8, 16, 24, 32, 40, 48, 64, 80, 96, 112, 128, 160, 192, 256)


def check_transform(
    transform: Transform | Callable[[], Transform] | st.SearchStrategy[Transform],
    *,
    head_dims: tuple[int, ...] = HEAD_DIMS,
    max_examples: int = 40,
) -> None:
    """Check the transform contract with hypothesis; call it from a plain pytest test.

    Over random head dims, dtypes (float32, bfloat16, float16), shapes and inputs, the transform
    must:

    - keep shape and dtype;
    - be one linear map ``R`` for every vector (``forward(x) = x R`` row by row, whatever the
      batch, head and token axes), and orthogonal: ``R Rᵀ = I`` within float32 rounding;
    - preserve norms, and round-trip: ``inverse(forward(x)) = x`` within two roundings to the dtype
      (plus a few float32 ulps of the vector's norm);
    - be deterministic: a pickled copy (another process) computes the same ``forward`` bit for bit;
    - refuse a head dim it cannot serve with :class:`~kvpolicy.errors.ConfigError`, in
      ``check_head_dim``, before any use.

    Parameters
    ----------
    transform : Transform, callable or hypothesis strategy
        The transform, a zero-argument factory (e.g. the class) or a strategy of transforms.
    head_dims : tuple of int
        Head dims to draw from.
    max_examples : int
        Hypothesis examples.
    """
    import pickle

    import torch
    from hypothesis import HealthCheck, assume, given, settings

    from kvpolicy.errors import ConfigError

    if isinstance(transform, st.SearchStrategy):
        transforms = transform
    elif isinstance(transform, type) or (callable(transform) and not hasattr(transform, "forward")):
        transforms = st.builds(transform)
    elif hasattr(transform, "forward"):
        transforms = st.just(transform)
    else:
        raise ConfigError(f"check_transform: transform must be a Transform, a factory or a strategy; got {transform!r}")

    @settings(max_examples=max_examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        transform=transforms,
        d=st.sampled_from(head_dims),
        dtype=st.sampled_from((torch.float32, torch.bfloat16, torch.float16)),
        lead=st.lists(st.integers(1, 3), min_size=1, max_size=3),
        seed=st.integers(0, 2**16),
    )
    def contract(transform: Transform, d: int, dtype: torch.dtype, lead: list[int], seed: int) -> None:
        try:
            transform.check_head_dim(d)
        except ConfigError as exc:
            assert str(d) in str(exc), f"{transform!r}: the refusal of head_dim={d} does not name it: {exc}"
            assume(False)
        eye = torch.eye(d)
        r = transform.forward(eye)
        assert r.shape == (d, d) and r.dtype == torch.float32, f"{transform!r}: forward changed shape or dtype"
        gram = r @ r.T
        assert torch.allclose(gram, eye, atol=1e-5), f"{transform!r}: not orthogonal at head_dim={d}"
        assert torch.allclose(transform.inverse(eye), r.T, atol=1e-6), f"{transform!r}: inverse is not Rᵀ"
        x = torch.randn(*lead, d, generator=torch.Generator().manual_seed(seed)).to(dtype)
        y = transform.forward(x)
        assert y.shape == x.shape and y.dtype == x.dtype, f"{transform!r}: forward changed shape or dtype"
        # one rounding to the dtype per map, plus float32 arithmetic (a few ulps of the norm)
        eps = torch.finfo(dtype).eps + 8 * torch.finfo(torch.float32).eps
        norm = x.float().norm(dim=-1, keepdim=True)
        linear = x.float() @ r
        assert ((y.float() - linear).norm(dim=-1, keepdim=True) <= eps * norm + 1e-6).all(), (
            f"{transform!r}: forward is not the same linear map for every vector"
        )
        assert ((y.float().norm(dim=-1, keepdim=True) - norm).abs() <= 2 * eps * norm + 1e-6).all(), (
            f"{transform!r}: forward does not preserve norms"
        )
        back = transform.inverse(y)
        assert back.dtype == x.dtype and back.shape == x.shape, f"{transform!r}: inverse changed shape or dtype"
        assert ((back.float() - x.float()).norm(dim=-1, keepdim=True) <= 2 * eps * norm + 1e-6).all(), (
            f"{transform!r}: inverse(forward(x)) is not x within two roundings to {dtype}"
        )
        copy = pickle.loads(pickle.dumps(transform))
        assert copy == transform and torch.equal(copy.forward(x), y), f"{transform!r}: a pickled copy differs"

    contract()
