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


# --------------------------------------------------------------------------------------------------
# the backend contract
# --------------------------------------------------------------------------------------------------

#: head dim :func:`check_backend` quantizes (a multiple of every built-in packing granularity)
BACKEND_HEAD_DIM = 64
#: attention tolerance of :func:`check_backend` by input dtype (kernels score in float32 from the codes;
#: the reference dequantizes to the dtype first)
ATTEND_TOLERANCE = {"float64": 1e-6, "float32": 1e-4, "float16": 2e-2, "bfloat16": 6e-2}


def backend_formats(backend: Any) -> list[Any]:
    """The formats :func:`check_backend` checks by default: min-max groups at every width and axis the
    backend's capabilities list (one group size each: 32, or the smallest multiple of its granularity
    dividing the head dim), and codebook formats at every codebook width when ``"codebook"`` is served."""
    from kvpolicy.formats import Codebook, MinMax

    caps = backend.capabilities
    out: list[Any] = []
    if "minmax" in caps.schemes:
        mult = max(caps.group_size_multiple, 8)
        group = 32 if 32 % mult == 0 else next(g for g in range(mult, BACKEND_HEAD_DIM + 1, mult) if 64 % g == 0)
        out += [MinMax(bits, group, axis) for bits in caps.bits for axis in caps.axes]
    if "codebook" in caps.schemes:
        out += [Codebook(bits) for bits in caps.codebook_bits]
    return out


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
    """``attend`` against dense attention over the dequantized blocks, for each key/value format pair."""
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
