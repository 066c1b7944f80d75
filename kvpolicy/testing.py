"""Reusable hypothesis checks for policies and transforms (needs the ``test`` extra: hypothesis).

Any policy, built in or from a plugin, can be checked against the contract of
:mod:`kvpolicy.policies.base` from a plain pytest test::

    from hypothesis import strategies as st
    from kvpolicy.testing import check_policy

    def test_contract():
        check_policy(st.builds(MyPolicy, window=st.integers(1, 8)),
                     max_full=lambda policy, length, prompt: policy.window, chunking="any")

and any transform against :mod:`kvpolicy.transforms.base` with :func:`check_transform`, any action with
:func:`check_action`, any backend with :func:`check_backend`, and any composition of parts (a plugin's among
them) with :func:`check_batch_operations`: a row moved by ``reorder_cache``, ``batch_select_indices`` or
``batch_repeat_interleave`` gives the logits of the row run alone.

:func:`run_policy` (drive a state as the cache does) and :func:`check_trace` (the contract over one
trace) are the pieces, for policies that need their own inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hypothesis import example
from hypothesis import strategies as st

if TYPE_CHECKING:
    import torch

    from kvpolicy.policies.base import Policy
    from kvpolicy.transforms.base import BindContext, Transform


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
      the same order (the cache then demotes a prompt in parts, see ``kvpolicy.layer.held.CROP_WINDOW``).

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
      ``check_head_dim``, before any use;
    - bind a :class:`~kvpolicy.transforms.base.Basis` (``transform.bind(context)``, given a layer's
      :class:`~kvpolicy.transforms.base.BindContext`) that, driven the way a layer
      drives it (queries observed while it wants them, ``fit`` on the first demotion, ``add`` into a plain
      full-precision store), gives the tokens back (``unmap_keys``/``unmap_values``) and serves fused
      attention over the store's parts (``map_query``, ``score_term``, ``unmap_output``:
      :func:`kvpolicy.fused.attend_parts`) equal to softmax attention over the tokens; saves and loads its
      state so that the loaded basis reads the store bit for bit; and moves its per-row state with a batch
      operation (``map_batch``) as the row run alone.

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

    @settings(max_examples=max(4, max_examples // 4), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(transform=transforms, d=st.sampled_from(head_dims), seed=st.integers(0, 2**16))
    def seam(transform: Transform, d: int, seed: int) -> None:
        try:
            transform.check_head_dim(d)
            transform.check_key_head_dim(d)
        except ConfigError:
            assume(False)
        check_basis(transform, d, seed)

    contract()
    seam()


class _PlainStore:
    """A store that keeps demoted tokens as given, in arrival order (the seam check's: exact, so that what
    :func:`check_basis` measures is the basis alone)."""

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def add(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        import torch

        self.k = keys if self.k is None else torch.cat([self.k, keys], dim=2)
        self.v = values if self.v is None else torch.cat([self.v, values], dim=2)
        self.positions = torch.cat([self.positions, positions], dim=1)

    def keys(self) -> torch.Tensor:
        return self.k

    def values(self) -> torch.Tensor:
        return self.v

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.k, self.v = fn(self.k), fn(self.v)


def check_basis(transform: Transform, head_dim: int = 64, seed: int = 0, context: BindContext | None = None) -> None:
    """The seam half of :func:`check_transform`, for one transform and head dim (see there).

    ``context``: the :class:`~kvpolicy.transforms.base.BindContext` the basis is bound with (its shapes must be
    2 KV heads of ``head_dim`` channels, float32 on the CPU); default: layer 3 of a model the cache was given
    no config of. A transform that reads something per layer and model (a file of statistics) passes its own.
    """
    import torch

    from kvpolicy.fused import attend_parts
    from kvpolicy.layer.parts import Part
    from kvpolicy.transforms.base import Basis, BindContext

    g = torch.Generator().manual_seed(seed)
    b, h, n, d = 2, 2, 24, head_dim
    keys = torch.randn(b, h, n, d, generator=g) * (1 + torch.rand(1, h, 1, d, generator=g) * 4)
    values = torch.randn(b, h, n, d, generator=g)
    positions = torch.randperm(n + 8, generator=g)[:n].view(1, n).to(torch.int32)
    context = BindContext.of(3, keys, values) if context is None else context
    assert (context.num_kv_heads, context.key_head_dim, context.value_head_dim) == (h, d, d), (
        f"check_basis: a context for {context.num_kv_heads} KV heads of {context.key_head_dim} channels; the check "
        f"drives {h} of {d}"
    )
    basis = transform.bind(context)
    assert isinstance(basis, Basis) and basis.transform == transform, f"{transform!r}: bind() is not its Basis"
    assert basis.wants_queries == transform.needs_queries, f"{transform!r}: wants_queries disagrees with needs_queries"
    for _ in range(2 if basis.wants_queries else 0):  # the prompt's forwards
        basis.observe(torch.randn(b, 2 * h, 5, d, generator=g), keys)
    if not basis.fitted:
        basis.fit(keys[:, :, :16], values[:, :, :16])
    assert basis.fitted and not basis.wants_queries, f"{transform!r}: fit() left the basis unfitted"
    store = _PlainStore(positions[:, :0])
    basis.add(store, keys[:, :, :16], values[:, :, :16], positions[:, :16])  # the first demotion, then another
    basis.add(store, keys[:, :, 16:], values[:, :, 16:], positions[:, 16:])

    def read(bs: Basis, st_: _PlainStore) -> tuple[torch.Tensor, torch.Tensor]:
        return bs.unmap_keys(st_.keys(), st_.positions), bs.unmap_values(st_.values())

    got_k, got_v = read(basis, store)
    for what, got, want in (("keys", got_k, keys), ("values", got_v, values)):
        # what a basis holds beside the store may be coded (8-bit coefficients of a part of each key): 2⁻⁶ RMS
        err = float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
        assert err <= 2**-6, f"{transform!r}: unmap_{what} differs from the {what} added by {err:.3g} relative RMS"
    # fused attention over the store's parts (and a full-precision segment) equals softmax attention over
    # the tokens the basis gives back (the materialised path)
    query = torch.randn(b, 2 * h, 1, d, generator=g)
    full_k, full_v = torch.randn(b, h, 3, d, generator=g), torch.randn(b, h, 3, d, generator=g)
    parts = [Part(store.keys(), store.values(), None, store.positions), Part(full_k, full_v)]
    fused = attend_parts(query, parts, d**-0.5, basis)
    k_all = torch.cat([got_k, full_k], dim=2).repeat_interleave(2, dim=1)
    v_all = torch.cat([got_v, full_v], dim=2).repeat_interleave(2, dim=1)
    want = torch.softmax(query @ k_all.transpose(-1, -2) * d**-0.5, dim=-1) @ v_all
    worst = float((fused - want).abs().max())
    assert worst <= 1e-4, f"{transform!r}: fused attention over its parts differs from softmax by {worst:.3g}"
    # saved and loaded, the basis reads the store bit for bit
    loaded = transform.bind(context)
    loaded.load_state_dict(basis.state_dict(), keys.device)
    loaded.validate(keys[:, :, :0], values[:, :, :0], store.positions)
    again = read(loaded, store)
    assert torch.equal(again[0], got_k) and torch.equal(again[1], got_v), f"{transform!r}: a loaded basis differs"
    # a batch operation moves the basis' per-row state with the store's rows
    row = torch.tensor([1])
    basis.map_batch(lambda t: t.index_select(0, row))
    store.map_batch(lambda t: t.index_select(0, row))
    moved = read(basis, store)
    assert torch.equal(moved[0], got_k[1:]) and torch.equal(moved[1], got_v[1:]), (
        f"{transform!r}: after map_batch the basis reads another row than it held"
    )


# --------------------------------------------------------------------------------------------------
# the action contract (check_action)
# --------------------------------------------------------------------------------------------------


def action_error_bound(bits: int | None, dtype: torch.dtype) -> float:
    """The relative RMS error :func:`check_action` allows a store of ``bits``-bit codes on standard normal
    tokens of ``dtype``: that of a uniform grid over ``±4`` standard deviations, ``8 / ((2**bits - 1) √12)``,
    plus the dtype's machine epsilon (rounding the output). ``bits=None``: 0, the store must be exact."""
    import math

    import torch

    if bits is None:
        return 0.0
    return 8 / (((1 << bits) - 1) * math.sqrt(12)) + torch.finfo(dtype).eps


def _action_widths(action: Any, bits: int | tuple[int, int] | None) -> tuple[int | None, int | None]:
    """``(key bits, value bits)`` the error bound is for: ``bits`` as given, else the widths of a built-in
    :class:`~kvpolicy.actions.quantize.Quantize` (its last tier's, for :class:`~kvpolicy.actions.tiered.Tiered`)."""
    from kvpolicy.actions.quantize import Quantize
    from kvpolicy.actions.tiered import Tiered
    from kvpolicy.errors import ConfigError

    if isinstance(bits, tuple):
        return bits
    if bits is not None:
        return bits, bits
    lowest = action.tiers[-1] if isinstance(action, Tiered) else action
    if isinstance(lowest, Quantize):
        return lowest.keys.bits, lowest.values.bits
    raise ConfigError(
        f"check_action: {action!r} compresses and keeps its tokens; give bits= (the code width of its keys and "
        "values, or of its lowest tier: the error bound is computed from it) or bits=0 for a store that keeps "
        "them exactly"
    )


def _held_bytes(store: Any) -> int:
    """Bytes of every distinct tensor reachable from ``store`` through attributes and containers (the
    backend, the action and policies are configuration, not held data, and are not walked)."""
    import torch

    from kvpolicy.actions.base import Action
    from kvpolicy.backends.base import Backend
    from kvpolicy.policies.base import Policy

    seen: set[int] = set()
    total = 0
    stack = [store]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, Backend | Action | Policy | type):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return total


def _through_a_file(state: Any) -> Any:
    """``state`` written to a saved-cache file and read back (:mod:`kvpolicy.persist`), as a cache's save
    and load do."""
    import tempfile
    from pathlib import Path

    from kvpolicy import persist

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "store.kvcache"
        persist.write(path, {"store": "check_action"}, {"state": state})
        return persist.read(path)[1]["state"]


def _action_batches(seed: int) -> list[int]:
    """Token counts of the successive ``add`` calls: a prompt-sized first demotion, then mostly single tokens
    and a few larger ones, more than 256 tokens in all (whole per-channel groups of 128, and a staged tail)."""
    import random

    rng = random.Random(seed)
    sizes = [rng.randint(20, 60)]
    while sum(sizes) < 260:
        sizes.append(rng.choice([1, 1, 1, 2, rng.randint(3, 40), rng.randint(40, 100)]))
    return sizes


def check_action(
    action: Any,
    backend: Any = None,
    *,
    head_dim: int = 64,
    seed: int = 0,
    bits: int | tuple[int, int] | None = None,
    dtype: torch.dtype | None = None,
    per_head: bool | None = None,
) -> None:
    """Check the action contract (:mod:`kvpolicy.actions.base`) on random tokens; call it from a pytest test.

    A store from ``action.new_store(backend, 0)`` is given standard normal keys and values
    ``(2, 2, n, head_dim)`` in several ``add`` calls (a first demotion of 20 to 60 tokens, then mostly single
    tokens, over 256 in all), their positions a random order of ``0..N-1`` (``(1, n)``: a shared policy, or
    ``(kv_heads, n)``: a per-head one; both unless ``per_head`` says which). The store must:

    - *flags*: ``compresses`` and ``keeps_demoted`` are bools; an action that does not compress keeps every
      token exactly (a cache with it returns what it was given, bit for bit) and has no store to check; an
      evicting action (``keeps_demoted=False``) holds no bytes whatever it is given;
    - *positions*: hold each added position exactly once, as ``POSITION_DTYPE`` ``(rows, n)``, with
      ``len(store) == n``;
    - *keys and values*: be ``(2, 2, n, head_dim)`` of the input dtype, token ``i`` the one added at
      ``positions[..., i]``, within the error bound: relative RMS error at most
      :func:`action_error_bound` of its code width (``bits``; for a built-in Quantize or Tiered its own
      widths, its lowest tier's), exact for ``bits=0``;
    - *bytes*: ``nbytes()`` maps roles to ints >= 0 that add up to the bytes of the tensors the store holds
      (found by walking its attributes), more than 0 and fewer than the tokens take at full precision;
    - *parts*: ``parts()`` (what fused decode attention reads) holds every stored token, and attention over
      it equals attention over the materialised keys and values (within float32 rounding);
    - *determinism*: a second store given the same tokens holds the same keys and values, bit for bit;
    - *saving*: ``state_dict()`` written to a saved-cache file and read back (:mod:`kvpolicy.persist`),
      loaded into a fresh store, gives the same positions, keys, values and bytes, bit for bit, passes
      ``validate``, and goes on identically when both are given the same further tokens;
    - *batch ops*: after ``map_batch`` with a reorder of the batch rows, keys and values are the
      materialised ones reordered, bit for bit, and stay so when both are given the same further tokens (the
      reordered store the reordered tokens); after a repeat of every row (beam expansion), each copy is its
      row.

    Parameters
    ----------
    action : Action
        The action (hyperparameters already chosen; its ``serving`` defaults are applied as a cache does).
    backend : Backend, optional
        The backend its store packs with; default the ``torch`` reference backend.
    head_dim : int
        Channels per head.
    seed : int
        Seeds the tokens, their positions and the sizes of the ``add`` calls.
    bits : int or (int, int), optional
        The code width of keys and values (one for both, or a pair) that the error bound is computed for: a
        tiered action's lowest tier. ``0``: the store must keep tokens exactly. Default: the widths of a
        built-in Quantize or Tiered; required for any other action that compresses and keeps its tokens.
    dtype : torch.dtype, optional
        The tokens' dtype (default float32).
    per_head : bool, optional
        Check with per-head positions (True), shared ones (False) or both (None).

    Raises
    ------
    AssertionError
        Naming the clause the store breaks, the action and what was found.
    """
    import torch

    from kvpolicy.backends.torch_backend import TorchBackend

    backend = TorchBackend() if backend is None else backend
    dtype = torch.float32 if dtype is None else dtype
    who = f"check_action({action!r})"
    for flag in ("compresses", "keeps_demoted"):
        assert isinstance(getattr(action, flag), bool), f"{who}: flags: {flag} must be a bool"
    if not action.compresses:
        assert action.keeps_demoted, f"{who}: flags: an action that does not compress must keep its tokens"
        _check_uncompressed(action, backend, head_dim, seed, dtype, who)
        return
    action, _ = action.serving(backend, head_dim, head_dim)
    action.check_backend(backend)
    action.check_head_dim(head_dim, backend.capabilities.group_size_multiple)
    widths = _action_widths(action, bits) if action.keeps_demoted else (None, None)
    bounds = tuple(action_error_bound(b or None, dtype) for b in widths)
    for rows_per_head in (False, True) if per_head is None else (per_head,):
        _check_store(action, backend, head_dim, seed, dtype, rows_per_head, bounds, f"{who}, per_head={rows_per_head}")


def _check_uncompressed(action: Any, backend: Any, head_dim: int, seed: int, dtype: torch.dtype, who: str) -> None:
    """An action that does not compress: a cache with it returns every token as given."""
    import torch

    from kvpolicy.cache import CompressedCache

    g = torch.Generator().manual_seed(seed)
    cache = CompressedCache(policy="recent", window=4, action=action, backend=backend)
    given_k, given_v = [], []
    for n in _action_batches(seed)[:6]:
        k, v = (torch.randn(2, 2, n, head_dim, generator=g).to(dtype) for _ in range(2))
        given_k.append(k)
        given_v.append(v)
        keys, values = cache.update(k, v, 0)
    assert torch.equal(keys, torch.cat(given_k, 2)) and torch.equal(values, torch.cat(given_v, 2)), (
        f"{who}: flags: an action that does not compress must keep every token exactly"
    )


def _check_parts(store: Any, dtype: torch.dtype, who: str) -> None:
    """*parts*: attention over ``parts()`` (what fused decode reads) equals attention over the materialised
    ``keys()`` and ``values()``."""
    import torch

    from kvpolicy.backends.base import dense_attention
    from kvpolicy.fused import attend_parts
    from kvpolicy.layer.parts import Part

    with _clause(who, "parts"):
        parts = store.parts()
        keys, values = store.keys(), store.values()
    assert isinstance(parts, list) and parts and all(isinstance(p, Part) for p in parts), (
        f"{who}: parts: parts() must return a non-empty list of Part for a store holding tokens; got {parts!r}"
    )
    held = sum(p.keys.shape[2] for p in parts)
    assert held == keys.shape[2], f"{who}: parts: parts() hold {held} tokens, keys() {keys.shape[2]}"
    query = torch.randn(keys.shape[0], keys.shape[1], 1, keys.shape[-1], generator=torch.Generator().manual_seed(5))
    with _clause(who, "parts"):
        empty = Part(keys[:, :, :0], values[:, :, :0])  # the full-precision segment a layer appends
        got = attend_parts(query.to(dtype), [*parts, empty], 0.125)
    want, _ = dense_attention(query.to(dtype), keys, values, 0.125)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    err = float((got.float() - want.float()).abs().max())
    assert err <= tol, (
        f"{who}: parts: attention over parts() differs from attention over keys()/values() by {err:.3g} (> {tol})"
    )


def _check_store(
    action: Any, backend: Any, head_dim: int, seed: int, dtype: torch.dtype, per_head: bool,
    bounds: tuple[float, float], who: str,
) -> None:  # fmt: skip
    import torch

    from kvpolicy.positions import POSITION_DTYPE

    batch, heads = 2, 2
    rows = heads if per_head else 1
    sizes = _action_batches(seed)
    g = torch.Generator().manual_seed(seed)
    total = sum(sizes)
    keys_all = torch.randn(batch, heads, total, head_dim, generator=g).to(dtype)
    values_all = torch.randn(batch, heads, total, head_dim, generator=g).to(dtype)
    order = torch.stack([torch.randperm(total, generator=g) for _ in range(rows)]).to(POSITION_DTYPE)
    # the token at position p is keys_all[:, :, p]; the i-th token demoted in row r is at order[r, i]
    cut = len(sizes) - 2  # the last two adds continue a saved, a reordered and a repeated store

    def tokens(start: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pos = order[:, start : start + n]
        index = pos.long()[None, :, :, None].expand(batch, heads, n, head_dim)
        return keys_all.gather(2, index), values_all.gather(2, index), pos

    def new_store() -> Any:
        store = action.new_store(backend, 0)
        store.positions = torch.empty(rows, 0, dtype=POSITION_DTYPE)  # as a layer sets it
        return store

    def fill(store: Any, calls: range, fn: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
        for i in calls:
            k, v, pos = tokens(sum(sizes[:i]), sizes[i])
            store.add(fn(k), fn(v), pos)

    with _clause(who, "adding tokens"):
        store = new_store()
        fill(store, range(cut))
    held = sum(sizes[:cut])
    if not action.keeps_demoted:
        with _clause(who, "flags"):
            fill(store, range(cut, len(sizes)))
        assert sum(store.nbytes().values()) == 0 and _held_bytes(store) == 0, (
            f"{who}: flags: an evicting action (keeps_demoted=False) must hold nothing; nbytes() says "
            f"{store.nbytes()}, and it holds {_held_bytes(store)} bytes of tensors"
        )
        with _clause(who, "saving"):
            fresh = new_store()
            fresh.load_state_dict(_through_a_file(store.state_dict()))
        assert fresh.nbytes() == store.nbytes(), f"{who}: saving: nbytes() differs after a state round trip"
        return
    _check_held(store, held, order, keys_all, values_all, bounds, dtype, rows, who)
    _check_parts(store, dtype, who)

    with _clause(who, "determinism"):
        twin = new_store()
        fill(twin, range(cut))
    assert torch.equal(twin.keys(), store.keys()) and torch.equal(twin.values(), store.values()), (
        f"{who}: determinism: a second store given the same tokens holds other keys or values"
    )

    def reloaded() -> Any:
        fresh = new_store()
        fresh.load_state_dict(_through_a_file(store.state_dict()))
        return fresh

    with _clause(who, "saving"):
        loaded = reloaded()
        _same(loaded, store, f"{who}: saving: after state_dict -> file -> load_state_dict")
        like = keys_all[:, :, :0]
        loaded.validate(like, like)

    # batch ops, on stores loaded from the same state (the original goes on unchanged)
    perm = torch.tensor([1, 0])
    with _clause(who, "batch ops"):
        reordered = reloaded()
        reordered.map_batch(lambda t: t.index_select(0, perm.to(t.device)))
        repeated = reloaded()
        repeated.map_batch(lambda t: t.repeat_interleave(2, dim=0))
    assert _reordered(reordered, store, perm), (
        f"{who}: batch ops: after map_batch(reorder rows) the keys/values are not the materialised ones reordered"
    )
    assert torch.equal(repeated.keys(), store.keys().repeat_interleave(2, dim=0)) and torch.equal(
        repeated.values(), store.values().repeat_interleave(2, dim=0)
    ), f"{who}: batch ops: after map_batch(repeat rows) a copy is not its row"

    # all go on with the same further tokens
    with _clause(who, "adding tokens"):
        fill(store, range(cut, len(sizes)))
    with _clause(who, "saving"):
        fill(loaded, range(cut, len(sizes)))
        _same(loaded, store, f"{who}: saving: a loaded store given further tokens")
    with _clause(who, "batch ops"):
        fill(reordered, range(cut, len(sizes)), lambda t: t[perm])
    assert _reordered(reordered, store, perm), (
        f"{who}: batch ops: a reordered store given the reordered further tokens differs from the original reordered"
    )
    _check_held(store, total, order, keys_all, values_all, bounds, dtype, rows, who)


@contextmanager
def _clause(who: str, clause: str) -> Iterator[None]:
    """Turn an exception other than an AssertionError raised inside into an AssertionError naming ``clause``."""
    try:
        yield
    except AssertionError:
        raise
    except Exception as exc:
        raise AssertionError(f"{who}: {clause}: {type(exc).__name__}: {exc}") from exc


def _reordered(got: Any, want: Any, perm: torch.Tensor) -> bool:
    """Whether ``got`` holds ``want``'s keys and values with the batch rows in the order ``perm``."""
    import torch

    return torch.equal(got.keys(), want.keys()[perm]) and torch.equal(got.values(), want.values()[perm])


def _same(got: Any, want: Any, where: str) -> None:
    import torch

    assert torch.equal(got.positions, want.positions), f"{where}: the positions differ"
    assert torch.equal(got.keys(), want.keys()), f"{where}: the keys differ"
    assert torch.equal(got.values(), want.values()), f"{where}: the values differ"
    assert got.nbytes() == want.nbytes(), f"{where}: nbytes() {got.nbytes()} differs from {want.nbytes()}"
    assert len(got) == len(want), f"{where}: len() {len(got)} differs from {len(want)}"


def _check_held(
    store: Any, n: int, order: torch.Tensor, keys_all: torch.Tensor, values_all: torch.Tensor,
    bounds: tuple[float, float], dtype: torch.dtype, rows: int, who: str,
) -> None:  # fmt: skip
    """The positions, keys, values and bytes of a store that was given the first ``n`` tokens of ``order``."""
    import torch

    from kvpolicy.positions import POSITION_DTYPE

    batch, heads, _, head_dim = keys_all.shape
    pos = store.positions
    assert isinstance(pos, torch.Tensor) and pos.dtype == POSITION_DTYPE and tuple(pos.shape) == (rows, n), (
        f"{who}: positions: expected {POSITION_DTYPE} ({rows}, {n}), got "
        f"{getattr(pos, 'dtype', type(pos))} {tuple(getattr(pos, 'shape', ()))}"
    )
    given = order[:, :n].sort(dim=1).values
    assert torch.equal(pos.sort(dim=1).values, given), f"{who}: positions: not each added position exactly once"
    assert len(store) == n, f"{who}: positions: len(store) is {len(store)} after {n} tokens"
    index = pos.long()[None, :, :, None].expand(batch, heads, n, head_dim)
    full_bytes = 0
    for role, got, source, bound in (
        ("keys", store.keys(), keys_all, bounds[0]),
        ("values", store.values(), values_all, bounds[1]),
    ):
        assert tuple(got.shape) == (batch, heads, n, head_dim) and got.dtype == dtype, (
            f"{who}: keys and values: {role}() is {got.dtype} {tuple(got.shape)}, expected {dtype} "
            f"{(batch, heads, n, head_dim)}"
        )
        want = source.gather(2, index).double()
        error = float((got.double() - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
        assert error <= bound, (
            f"{who}: keys and values: {role} are off by a relative RMS error of {error:.4g} (bound {bound:.4g}); "
            "is token i the one added at positions[..., i]?"
        )
        full_bytes += got.numel() * got.element_size()
    reported = store.nbytes()
    assert isinstance(reported, dict) and all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0 for k, v in reported.items()
    ), f"{who}: bytes: nbytes() must map roles to ints >= 0; got {reported!r}"
    total = sum(reported.values())
    walked = _held_bytes(store)
    assert total == walked, f"{who}: bytes: nbytes() adds up to {total}, but the store holds {walked} bytes of tensors"
    assert 0 < total < full_bytes + 8 * rows * n, (
        f"{who}: bytes: {total} bytes held for {n} tokens, which take {full_bytes} at full precision"
    )


# --------------------------------------------------------------------------------------------------
# the backend contract
# --------------------------------------------------------------------------------------------------

#: head dim :func:`check_backend` quantizes (a multiple of every built-in packing granularity)
BACKEND_HEAD_DIM = 64
#: attention tolerance of :func:`check_backend` by input dtype (kernels score in float32 from the codes;
#: the reference dequantizes to the dtype first)
ATTEND_TOLERANCE = {"float64": 1e-6, "float32": 1e-4, "float16": 2e-2, "bfloat16": 6e-2}


def backend_formats(backend: Any) -> list[Any]:
    """The formats :func:`check_backend` checks by default: the :meth:`~kvpolicy.formats.base.Format.examples`
    of every registered format (built in or a plugin's) that the backend serves (:meth:`Backend.serves`)."""
    from kvpolicy import registry

    return [
        fmt
        for name in registry.names("formats")
        for fmt in registry.get("formats", name).examples(backend)
        if backend.serves(fmt)
    ]


def _inputs(shape: tuple[int, ...], dtype: Any, device: Any, seed: int) -> list[Any]:
    """Gaussian tokens, with outliers, and with constant tokens (a group whose range is zero)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    outliers = torch.where(torch.rand(shape, generator=gen) < 0.02, x * 30, x) + 3.0
    constant = x.clone()
    constant[:, :, ::3, :] = -2.5
    return [t.to(dtype=dtype, device=device) for t in (x, outliers, constant)]


def _tokens(fmt: Any) -> int:
    """Tokens per block: whole groups of a per-channel format, otherwise an odd count."""
    return 2 * fmt.group_size if fmt.axis == "channel" else 7


def _check_reconstruction(name: str, fmt: Any, x: Any, xh: Any, bound: str) -> None:
    """``xh`` (the backend's) against the format's reference reconstruction of ``x``."""
    import torch

    from kvpolicy.formats import MinMax

    ref = fmt.quantize(x, "torch")
    xr = ref.dequantize().double()
    xd, got = x.double(), xh.double()
    eps = torch.finfo(x.dtype).eps
    eps32 = torch.finfo(torch.float32).eps
    if isinstance(fmt, MinMax) and bound == "minmax":
        # one step of the reference grid (the two half steps of two grids) plus the rounding of both
        qmax = (1 << fmt.bits) - 1
        steps = ref.scales.double()  # type: ignore[attr-defined]
        b, h, n, d = x.shape
        g = fmt.group_size
        if fmt.axis == "token":
            s = steps.reshape(b, h, n, d // g).repeat_interleave(g, dim=3)
        else:
            s = steps.reshape(b, h, n // g, d).repeat_interleave(g, dim=2)
        slack = 2 * eps * (2 * qmax * s + 3 * xd.abs()) + 8 * eps32 * (xd.abs() + qmax * s)
        excess = (got - xr).abs() - s - slack
        assert bool((excess <= 0).all()), (
            f"backend {name!r}: {fmt} reconstruction differs from the reference by more than one step "
            f"(worst excess {float(excess.max()):.3g})"
        )
    elif bound in ("minmax", "reference"):
        tol = 4 * eps * (xr.abs() + xd.abs().amax()) + 8 * eps32 * xd.abs().amax()
        excess = (got - xr).abs() - tol
        assert bool((excess <= 0).all()), (
            f"backend {name!r}: {fmt} reconstruction differs from the reference "
            f"(worst excess {float(excess.max()):.3g})"
        )


def check_format(fmt_class: Any, backends: tuple[str, ...] | None = None, *, seed: int = 0) -> None:
    """Check a format (:class:`~kvpolicy.formats.base.Format` subclass) against the format contract; call it from
    a plain pytest test, with the format registered (a plugin's tests register it as its entry point would).

    The format must be registered under its ``name`` (the one registry of formats); say what it is
    (``block``, ``bits_allowed``); give specs that are frozen and hashable, equal to their copies, and refuse a
    width it lacks with a :class:`~kvpolicy.errors.ConfigError` naming ``bits``; build each role's spec from
    ``Quantize``'s shortcuts (:meth:`~kvpolicy.formats.base.Format.for_role`), with defaults among its options;
    and pass :func:`check_backend` (``bound="reference"``) on each backend of ``backends`` (default: those its
    ``backends`` name that are registered) over its :meth:`~kvpolicy.formats.base.Format.examples` the backend
    serves, the format's own reference included.

    Raises
    ------
    AssertionError
        Naming the format and what is wrong.
    """
    import dataclasses

    from kvpolicy import registry
    from kvpolicy.errors import ConfigError
    from kvpolicy.formats.base import Format, QTensor

    assert isinstance(fmt_class, type) and issubclass(fmt_class, Format), f"{fmt_class!r} is not a Format subclass"
    name = fmt_class.name
    assert isinstance(name, str) and name, f"{fmt_class.__name__}: empty name"
    assert name in registry.names("formats") and registry.get("formats", name) is fmt_class, (
        f"format {name!r} is not registered as {fmt_class.__name__} (registered: {registry.names('formats')})"
    )
    assert issubclass(fmt_class.block, QTensor), f"format {name!r}: block {fmt_class.block!r} is not a QTensor"
    assert fmt_class.bits_allowed, f"format {name!r}: no bits_allowed"
    for role in ("key", "value"):
        for bits in fmt_class.bits_allowed:
            spec, defaulted = fmt_class.for_role(role, {"bits": bits})
            assert type(spec) is fmt_class and spec.bits == bits, f"format {name!r}: for_role({role!r}) gave {spec}"
            assert set(defaulted) <= set(fmt_class.options()), f"format {name!r}: defaulted {defaulted}"
    wrong = next(b for b in range(1, 17) if b not in fmt_class.bits_allowed)
    chosen = (
        list(backends) if backends is not None else [b for b in fmt_class.backends if b in registry.names("backends")]
    )
    assert chosen, f"format {name!r}: no registered backend to check it on (its backends: {fmt_class.backends})"
    for backend_name in chosen:
        backend = registry.get("backends", backend_name)()
        specs = [f for f in fmt_class.examples(backend) if backend.serves(f)]
        assert specs, f"format {name!r}: backend {backend_name!r} serves none of its examples"
        for spec in specs:
            assert hash(spec) == hash(dataclasses.replace(spec)) and spec == dataclasses.replace(spec), spec
            try:
                dataclasses.replace(spec, bits=wrong)
            except ConfigError as exc:
                assert f"bits={wrong}" in str(exc), f"format {name!r}: {exc}"
            else:
                raise AssertionError(f"format {name!r} accepts bits={wrong}, which bits_allowed does not list")
        check_backend(backend, formats=specs, bound="reference", seed=seed)


def check_backend(
    backend: Any,
    formats: list[Any] | None = None,
    *,
    bound: str = "minmax",
    device: Any = None,
    seed: int = 0,
) -> None:
    """Check the backend contract (:mod:`kvpolicy.backends.base`); call it from a plain pytest test.

    For every format (default :func:`backend_formats`: what the capabilities list) and every dtype the
    capabilities accept, on ``device`` (default: the first of the capabilities' devices), over Gaussian
    tokens, tokens with outliers and tokens with constant groups, the backend must:

    - quantize to a block of the input's shape and dtype whose ``nbytes()`` are the bytes of the tensors
      it holds, all on the input's device;
    - dequantize to the input's shape, dtype and device, finite, and agree with the format's reference
      (:meth:`~kvpolicy.formats.base.Format.quantize`, then the block's ``dequantize``): for min-max
      formats within one step of the reference grid plus rounding (``bound="minmax"``), for others within
      the dtype's rounding (``bound="reference"``); ``bound="own"`` skips this comparison (a backend with
      its own grid, ``hqq``, checks its own bound);
    - concatenate blocks so that dequantizing the concatenation equals concatenating the dequantized
      blocks, apply batch operations (``map_batch``) as they apply to the dequantized tensor, and, when
      ``capabilities.fused``, ``narrow`` to whole groups as the slice of the dequantized tensor;
    - ``attend`` as :func:`~kvpolicy.formats.base.dense_attention` over the dequantized keys and values
      (every format as keys and as values, by role: keys per channel, values per token where both axes
      exist, in pairs of widths the capabilities serve), out and log-sum-exp, within :data:`ATTEND_TOLERANCE`;
      ``attend_biased`` likewise, with a random score added per query and token;
    - save and load each block it can save (``block_state`` / ``load_block``; 16- and 32-bit inputs, what
      saved caches hold) bit for bit;
    - refuse, with a :class:`~kvpolicy.errors.ConfigError` naming itself, a dtype its capabilities do not
      list (``check_tensor``) and a width they do not list (``check``).

    Parameters
    ----------
    backend : Backend
        An instance.
    formats : list of Format, optional
        The formats to check (default :func:`backend_formats`); a plugin format served by the backend
        belongs here.
    bound : {"minmax", "reference", "own"}
        How the reconstruction is compared with the reference (see above).
    device : torch.device or str, optional
        Where to run.
    seed : int
        Seed of the inputs.

    Raises
    ------
    AssertionError
        Naming the backend, the format and what differs.
    """
    import torch

    from kvpolicy.errors import ConfigError
    from kvpolicy.formats.base import dense_attention

    caps = backend.capabilities
    name = backend.name
    if bound not in ("minmax", "reference", "own"):
        raise ValueError(f"check_backend: bound must be 'minmax', 'reference' or 'own'; got bound={bound!r}")
    assert caps.bits and caps.axes and caps.devices and caps.dtypes, f"backend {name!r}: empty capabilities"
    assert all(isinstance(d, torch.dtype) for d in caps.dtypes), f"backend {name!r}: capabilities.dtypes"
    device = torch.device(device if device is not None else caps.devices[0])
    fmts = backend_formats(backend) if formats is None else list(formats)
    assert fmts, f"backend {name!r}: no format to check"
    for dtype in caps.dtypes:
        for fmt in fmts:
            shape = (2, 2, _tokens(fmt), BACKEND_HEAD_DIM)
            for i, x in enumerate(_inputs(shape, dtype, device, seed)):
                what = f"backend {name!r}, {fmt}, {str(dtype).removeprefix('torch.')} input {i}"
                q = backend.quantize(x, fmt)
                assert tuple(q.shape) == tuple(x.shape) and q.dtype == x.dtype, f"{what}: block {q.shape} {q.dtype}"
                held = q.tensors()
                assert held and all(t.device == x.device for t in held.values()), f"{what}: block tensors' device"
                assert q.nbytes() == {r: t.numel() * t.element_size() for r, t in held.items()}, f"{what}: nbytes"
                xh = backend.dequantize(q)
                assert xh.shape == x.shape and xh.dtype == x.dtype and xh.device == x.device, f"{what}: dequantize"
                assert bool(torch.isfinite(xh).all()), f"{what}: non-finite reconstruction"
                if bound != "own":
                    _check_reconstruction(name, fmt, x, xh, bound)
            _check_blocks(backend, fmt, x, xh, what)
        _check_attend(backend, fmts, dtype, device, seed, dense_attention)
    wrong = next((d for d in (torch.float64, torch.float16, torch.float32) if d not in caps.dtypes), None)
    if wrong is not None:
        try:
            backend.check_tensor(torch.zeros(1, dtype=wrong, device=device))
        except ConfigError as exc:
            assert repr(name) in str(exc) and str(wrong) in str(exc), f"backend {name!r}: {exc}"
        else:
            raise AssertionError(f"backend {name!r} accepts {wrong}, which its capabilities do not list")
    width = next(b for b in range(1, 9) if b not in caps.bits) if len(caps.bits) < 8 else None
    if width is not None:
        try:
            backend.check(bits=width, group_size=32, axis=caps.axes[0])
        except ConfigError as exc:
            assert repr(name) in str(exc) and f"bits={width}" in str(exc), f"backend {name!r}: {exc}"
        else:
            raise AssertionError(f"backend {name!r} accepts bits={width}, which its capabilities do not list")


def _check_blocks(backend: Any, fmt: Any, x: Any, xh: Any, what: str) -> None:
    """``cat``, ``map_batch``, ``narrow`` and the saved state of the blocks of ``x``."""
    import torch

    half = x.shape[2] // 2 if fmt.axis != "channel" else fmt.group_size
    first, second = backend.quantize(x[:, :, :half].contiguous(), fmt), backend.quantize(x[:, :, half:] * 2, fmt)
    joined = backend.cat([first, second])
    want = torch.cat([backend.dequantize(first), backend.dequantize(second)], dim=2)
    assert torch.equal(backend.dequantize(joined), want), f"{what}: cat"
    q = backend.quantize(x, fmt)
    for fn in (lambda t: t.index_select(0, torch.tensor([1, 0, 0], device=t.device)), lambda t: t[1:]):
        assert torch.equal(backend.dequantize(q.map_batch(fn)), fn(xh)), f"{what}: map_batch"
    if backend.capabilities.fused:
        step = fmt.group_size if fmt.axis == "channel" else 1
        cut = q.narrow(step, x.shape[2] - step)
        assert torch.equal(backend.dequantize(cut), xh[:, :, step:]), f"{what}: narrow"
    if type(q).layouts and x.dtype != torch.float64:  # saved caches hold 16- and 32-bit tokens
        again = backend.load_block(backend.block_state(q), fmt)
        assert type(again) is type(q) and torch.equal(backend.dequantize(again), xh), f"{what}: saved state"


def _check_attend(backend: Any, fmts: list[Any], dtype: Any, device: Any, seed: int, dense: Callable) -> None:
    """``attend`` (and ``attend_biased`` with a random bias) against dense attention over the dequantized
    blocks, for each key/value format pair."""
    import torch

    caps = backend.capabilities
    keys = [f for f in fmts if f.axis == "channel"] or [f for f in fmts if f.axis == "token"]
    values = [f for f in fmts if f.axis == "token"] or fmts
    # every key format once and every value format once (their widths paired where the backend pairs them)
    allowed = [(k, v) for k in keys for v in values if caps.bit_pairs is None or (k.bits, v.bits) in caps.bit_pairs]
    pairs = [next((p for p in allowed if p[0] == k), None) for k in keys]
    pairs += [next((p for p in allowed if p[1] == v), None) for v in values]
    pairs = list(dict.fromkeys(p for p in pairs if p is not None))
    gen = torch.Generator().manual_seed(seed + 1)
    tol = ATTEND_TOLERANCE.get(str(dtype).removeprefix("torch."), 1e-2)
    for kf, vf in pairs:
        n = max(_tokens(kf), _tokens(vf))
        n = n - n % kf.group_size if kf.axis == "channel" else n
        n = n - n % vf.group_size if vf.axis == "channel" else n
        shape = (2, 2, n, BACKEND_HEAD_DIM)
        k = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
        v = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
        query = (torch.randn(2, 2, 3, BACKEND_HEAD_DIM, generator=gen) * 0.5).to(dtype=dtype, device=device)
        kq, vq = backend.quantize(k, kf), backend.quantize(v, vf)
        out, lse = backend.attend(query, kq, vq, BACKEND_HEAD_DIM**-0.5)
        ref_out, ref_lse = dense(query, backend.dequantize(kq), backend.dequantize(vq), BACKEND_HEAD_DIM**-0.5)
        what = f"backend {backend.name!r}: attend over keys {kf} and values {vf}, {str(dtype).removeprefix('torch.')}"
        assert out.dtype == lse.dtype == torch.float32, f"{what}: out/lse must be float32"
        assert out.shape == ref_out.shape and lse.shape == ref_lse.shape, f"{what}: shapes"
        worst = max(float((out - ref_out).abs().max()), float((lse - ref_lse).abs().max()))
        assert worst <= tol, f"{what}: differs from dense attention over the dequantized blocks by {worst:.3g}"
        # the same with an additive score per query and token (attend_biased: a score term of a transform)
        bias = torch.randn(2, 2, 3, n, generator=gen).to(device=device)
        out, lse = backend.attend_biased(query, kq, vq, BACKEND_HEAD_DIM**-0.5, bias)
        ref_out, ref_lse = dense(query, backend.dequantize(kq), backend.dequantize(vq), BACKEND_HEAD_DIM**-0.5, bias)
        worst = max(float((out - ref_out).abs().max()), float((lse - ref_lse).abs().max()))
        assert worst <= tol, f"{what}: attend_biased differs from dense attention with the bias by {worst:.3g}"


# --------------------------------------------------------------------------------------------------
# the batch-operation clause (check_batch_operations): a row moved by a batch operation is the row run alone
# --------------------------------------------------------------------------------------------------

#: rows of the batch :func:`check_batch_operations` runs (its model has 2 kv heads and head dim 64, so a tensor
#: of at least 3 dims whose first axis has this length is taken for per-row state)
BATCH_ROWS = 3


def _batch_operations() -> dict[str, tuple[tuple[int, ...], Callable[[Any], None]]]:
    """The batch operations of a ``transformers.Cache``: name -> (the source row of each row after it, the call)."""
    import torch

    return {
        "reorder_cache": ((2, 0, 1), lambda cache: cache.reorder_cache(torch.tensor([2, 0, 1]))),
        "batch_select_indices": ((2, 0), lambda cache: cache.batch_select_indices(torch.tensor([2, 0]))),
        "batch_repeat_interleave": ((0, 0, 1, 1, 2, 2), lambda cache: cache.batch_repeat_interleave(2)),
    }


def check_batch_operations(
    cache: Callable[[], Any] | dict[str, Any],
    *,
    padded: bool | None = None,
    prompt: int = 40,
    steps: int = 2,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    atol: float | None = None,
) -> None:
    """Check that every piece of per-row state moves with its row: the batch-operation clause.

    A tiny random Llama (2 layers, 2 kv heads, float64 by default, kvpolicy's score wrapper enabled:
    :func:`kvpolicy.attention.enable_scores`) runs a batch of 3 prompts into a cache from ``cache``, then
    ``steps`` decode steps. Right after the prompt, and again after those steps, each batch operation of a
    ``transformers.Cache`` is applied to a copy of the cache: ``reorder_cache`` (beam search),
    ``batch_select_indices`` (contrastive search, dropping finished rows) and ``batch_repeat_interleave`` (beam
    expansion, a prompt's cache fanned out to several continuations). ``steps`` more decode steps follow, each row
    given tokens of its own (the two copies of a repeated row different ones). Every row must give the logits of
    its source row run alone through the same tokens (a batch of one), within ``atol``.

    The batch is run twice: with prompts of equal length, through every part's ``map_batch``, where besides the
    logits every tensor of at least 3 dims whose first axis is the batch, reached from a layer's segments by
    attribute, must be the operation applied to it (a part cannot keep per-row state that does not move, even
    state the steps checked do not read); and left-padded (lengths ``prompt``, ``prompt - 5``, ``prompt - 9``),
    one engine per row. In a batch of equal rows a policy that needs attention scores (H2O, SnapKV) holds one
    selection for all rows, chosen from their summed scores, so its rows are not the rows run alone: there
    such a policy is checked by the tensors alone, and by the logits in the padded batch.

    Parameters
    ----------
    cache : callable or dict
        A zero-argument factory of fresh caches (``lambda: CompressedCache(policy=MyPolicy(), ...)``) or the
        keywords of :class:`~kvpolicy.cache.CompressedCache`.
    padded : bool, optional
        Check the padded batch (True), the batch of equal rows (False) or both (None).
    prompt : int
        Tokens of the longest prompt: enough that the policy demotes some (a prompt's demotions are made
        once its forward has returned, all but the last 64 tokens at once for policies that allow it).
    steps : int
        Decode steps before the later operation, and after each operation.
    seed : int
        Seeds the model and the tokens.
    dtype : torch.dtype, optional
        The model's dtype: float64 (default), where a batch row and the row run alone differ by rounding only;
        float32 for a part that serves no float64.
    atol : float, optional
        Largest difference of a logit from the row run alone. Default: 1e-6 in float64; 1e-3 in float32, where
        a value within float noise of a rounding boundary can take the other code in the batch than alone.

    Raises
    ------
    AssertionError
        Naming the operation, when and to which batch it was applied, the row, and the difference or the
        state that did not move.
    """
    import torch

    from kvpolicy.attention import enable_scores
    from kvpolicy.cache import CompressedCache
    from kvpolicy.tiny import random_model

    make = (lambda: CompressedCache(**cache)) if isinstance(cache, dict) else cache
    sample = make()
    who = f"check_batch_operations({sample!r})"
    dtype = torch.float64 if dtype is None else dtype
    atol = (1e-6 if dtype == torch.float64 else 1e-3) if atol is None else atol
    model = random_model("llama", layers=2, seed=seed).to(dtype)
    enable_scores(model)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 96, (n,), generator=g) for n in (prompt, prompt - 5, prompt - 9)]
    with torch.inference_mode():
        for layout in (False, True) if padded is None else (padded,):
            rows = prompts if layout else [p[-(prompt - 9) :] for p in prompts]
            run = _BatchRun(model, make, rows, steps, g)
            scored = sample.policy.needs_scores
            for name, (sources, apply) in _batch_operations().items():
                tokens = torch.randint(3, 96, (len(sources), steps), generator=g)
                for when in (0, steps):
                    where = (
                        f"{who}: batch ops: {name} applied "
                        f"{'right after the prompt' if when == 0 else f'after {steps} decode steps'} to a "
                        f"{'left-padded batch' if layout else 'batch of equal rows'}"
                    )
                    run.check(where, apply, sources, tokens, when, tensors=not layout, logits=layout or not scored,
                              atol=atol)  # fmt: skip


class _BatchRun:
    """A batch of prompts (left-padded when their lengths differ) run into a cache of one composition, and each
    prompt alone, snapshotted after the prompt and after ``steps`` decode steps (:func:`check_batch_operations`)."""

    def __init__(self, model: Any, make: Callable[[], Any], rows: list[Any], steps: int, g: Any) -> None:
        import copy

        import torch

        self.model, self.make, self.steps = model, make, steps
        width = max(len(p) for p in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(rows):
            ids[row, width - len(p) :] = p
            mask[row, width - len(p) :] = 1
        mask = None if bool(mask.all()) else mask
        before = torch.randint(3, 96, (len(rows), steps), generator=g)
        cache = make()
        counts = self.step(cache, ids, mask, [0] * len(rows))[1]
        #: when -> (the batch's cache, its attention mask, tokens per row)
        self.batch = {0: (copy.deepcopy(cache), mask, counts)}
        for j in range(steps):
            mask = None if mask is None else torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            counts = self.step(cache, before[:, j : j + 1], mask, counts)[1]
        self.batch[steps] = (cache, mask, counts)
        #: (row, when) -> (the row's cache run alone, its tokens)
        self.alone: dict[tuple[int, int], tuple[Any, list[int]]] = {}
        for row, p in enumerate(rows):
            cache = make()
            counts = self.step(cache, p[None], None, [0])[1]
            self.alone[(row, 0)] = (copy.deepcopy(cache), counts)
            for j in range(steps):
                counts = self.step(cache, before[row : row + 1, j : j + 1], None, counts)[1]
            self.alone[(row, steps)] = (cache, counts)

    def step(self, cache: Any, ids: Any, mask: Any, counts: list[int]) -> tuple[Any, list[int]]:
        """One forward of ``ids`` ``(rows, n)`` with positions as ``generate`` gives them: the last position's
        logits per row, and the tokens per row after it."""
        import torch

        n = ids.shape[1]
        if mask is None:
            positions = torch.tensor(counts)[:, None] + torch.arange(n)
        else:
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -n:]
        out = self.model(ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        return out.logits[:, -1], [k + n for k in counts]

    def check(
        self, where: str, apply: Callable[[Any], None], sources: tuple[int, ...], tokens: Any, when: int, *,
        tensors: bool, logits: bool, atol: float,
    ) -> None:  # fmt: skip
        import copy

        import torch

        base, mask, counts = self.batch[when]
        moved = copy.deepcopy(base)
        held = _per_row_tensors(base) if tensors else {}
        with _clause(where, "the operation"):
            apply(moved)
        index = torch.tensor(sources)
        for path, t in held.items():
            now = _resolve(moved, path)
            assert isinstance(now, torch.Tensor) and now.shape[0] == len(sources) and torch.equal(now, t[index]), (
                f"{where}: the per-row state {_path_name(path)} did not move with its rows (its first axis is the "
                "batch: map it in the part's map_batch)"
            )
        if not logits:
            return
        mask = None if mask is None else mask[index]
        counts = [counts[s] for s in sources]
        got = []
        with _clause(where, "decoding after it"):
            for j in range(self.steps):
                mask = None if mask is None else torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                step, counts = self.step(moved, tokens[:, j : j + 1], mask, counts)
                got.append(step)
        for i, source in enumerate(sources):
            cache, alone_counts = self.alone[(source, when)]
            cache = copy.deepcopy(cache)
            want = []
            for j in range(self.steps):
                step, alone_counts = self.step(cache, tokens[i : i + 1, j : j + 1], None, alone_counts)
                want.append(step[0])
            diff = float((torch.stack([g[i] for g in got]) - torch.stack(want)).abs().max())
            assert diff <= atol, (
                f"{where}: row {i} (row {source} before it) gives logits {diff:.3g} from that row run alone (> {atol})"
            )


def _per_row_tensors(cache: Any) -> dict[tuple[Any, ...], Any]:
    """Every tensor of at least 3 dims whose first axis is :data:`BATCH_ROWS` long, reached from each compressed
    layer's segments through attributes, dataclass fields and containers (configuration is not walked: the
    backend, action, policy, transform and the position book), by its path."""
    import dataclasses

    import torch

    from kvpolicy.actions.base import Action
    from kvpolicy.backends.base import Backend
    from kvpolicy.policies.base import Policy
    from kvpolicy.positions import PositionBook
    from kvpolicy.transforms.base import Transform

    out: dict[tuple[Any, ...], Any] = {}
    seen: set[int] = set()
    skip = (Backend, Action, Policy, Transform, PositionBook, torch.nn.Module, type, str, bytes, int, float, bool)
    stack: list[tuple[tuple[Any, ...], Any]] = []
    for i, layer in enumerate(cache.layers):
        held = getattr(getattr(layer, "engine", None), "held", None)
        if held is not None:
            stack.append(((("attr", "layers"), ("item", i), ("attr", "engine"), ("attr", "held")), held))
    while stack:
        path, obj = stack.pop()
        if obj is None or id(obj) in seen or isinstance(obj, skip) or (callable(obj) and not hasattr(obj, "__dict__")):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.dim() >= 3 and obj.shape[0] == BATCH_ROWS:
                out[path] = obj.clone()
        elif isinstance(obj, dict):
            stack.extend(((*path, ("item", k)), v) for k, v in obj.items())
        elif isinstance(obj, list | tuple):
            stack.extend(((*path, ("item", k)), v) for k, v in enumerate(obj))
        elif dataclasses.is_dataclass(obj):
            stack.extend(((*path, ("attr", f.name)), getattr(obj, f.name)) for f in dataclasses.fields(obj))
        elif hasattr(obj, "__dict__"):
            stack.extend(((*path, ("attr", k)), v) for k, v in vars(obj).items())
    return out


def _resolve(root: Any, path: tuple[Any, ...]) -> Any:
    """The object at ``path`` (from :func:`_per_row_tensors`) under ``root``, or None where it is gone."""
    obj = root
    for kind, key in path:
        try:
            obj = getattr(obj, key) if kind == "attr" else obj[key]
        except (AttributeError, IndexError, KeyError, TypeError):
            return None
    return obj


def _path_name(path: tuple[Any, ...]) -> str:
    """``layers[0].engine.held.store.k.first_centre`` for a path of :func:`_per_row_tensors`."""
    text = ""
    for kind, key in path:
        text += f".{key}" if kind == "attr" else f"[{key!r}]"
    return text.lstrip(".")
