"""Stateful fuzzing of ``CompressedCache``: random operation sequences checked against references.

A hypothesis ``RuleBasedStateMachine`` drives one ``CompressedCache`` (the subject) inside a tiny
random Llama or Qwen2 (2 layers, fp32, GQA) through random sequences of

- prefills of random length and batch size (1..3),
- runs of single-token decode steps and multi-token second turns,
- ``crop(-k)`` (assisted decoding's rollback of the drafts of the latest multi-token forward),
- ``reorder_cache(beam_idx)`` (beam search; indices may repeat), ``batch_select_indices`` and
  ``batch_repeat_interleave`` on batches > 1,
- ``reset()`` (a fresh sequence, possibly of another batch size, in the same cache object),

and after every step compares its logits and its positions with a reference. The test runs once
per model family x policy (``log``, ``recent`` sliding/flush, ``sink``, ``h2o``) x action
(``quantize``, ``evict``, ``none``) x layout x attention path; the hyperparameters (windows, bits,
group size, key/value axes) and, for ``attention="auto"``/``"materialized"``, whether the model
runs kvpolicy's fused function (:func:`kvpolicy.fused.enable_fused`) or only the score wrapper
(:func:`kvpolicy.attention.enable_scores`), are drawn per run. Compositions that must be refused
(``attention="fused"`` with ``action="none"``, or with H2O and ``"quantize"``) assert the
``ConfigError`` instead.

References (the strongest that stay cheap and do not reuse kvpolicy's cache code):

``action="none"``
    transformers' ``DynamicCache`` on the plain sdpa model, mirrored through every operation:
    logits equal bit for bit; ``positions`` say every token is held at full precision.

``action="quantize"``
    An oracle cache (a ``DynamicCache`` subclass) holds every token at full precision and hands
    attention, in position order, the history as the spec says the subject holds it: positions
    outside the demoted set unchanged, demoted ones replaced by ``dequantize(quantize(x))`` with
    the groups of policies-spec.md (e): per-token groups one token at a time, per-channel groups
    of ``G`` consecutive tokens *in demotion order*, the last ``len % G`` demoted keys (values)
    left at full precision (staged). The demotion order and ``FP(T)`` come from the spec's closed
    forms for ``log``/``recent``/``sink`` (a prefill behaves as single appends, so the order is
    single-step order; the flush prompt is one event), never from the subject. Only the quantizer
    primitive (``TorchBackend.quantize``/``dequantize``, unit-tested against the spec on its own)
    is shared.

    The oracle stores the keys and values the subject's layers *received* in the same step (the
    subject is a ``CompressedCache`` subclass that records its ``update`` inputs), not the ones
    its own forward computes. Quantization is discontinuous: the agnostic layout or the fused
    path add float rounding (~1e-7) to the hidden states after layer 0, which is enough to round a
    later key to the neighbouring code, a step of ~0.3 at 4 bits (seen in practice), so an oracle
    that quantized its own keys would fail spuriously. With the same inputs the codes are the
    same and only attention's rounding remains: logits agree within 1e-5 on every layout and
    attention path (observed <= 6e-7; the ordered materialized path is bit-identical). A wrong
    attention in the subject still shows: its own residual stream, hence its logits, carry it.

``action="evict"``
    The same oracle cache returns the *whole* history, and a per-layer boolean mask built from
    ``FP`` (an attention function registered for the reference model only) hides what the
    subject evicted: decode steps see exactly ``FP(T)``, a multi-token forward sees ``FP(T0)``
    plus its own tokens causally. That is eviction by definition (masking) against eviction by
    construction (gathering, logical RoPE positions, ``get_mask_sizes``); logits within 1e-5.

``policy="h2o"``
    Its selection depends on attention scores, so ``FP`` is read from the subject and checked
    against the spec's invariants instead: ``|FP| = min(T, heavy + recent)`` per kv head, the
    newest ``recent`` always held, monotone (a demoted token never returns, the compressed set
    only grows), full and compressed disjoint, their union every position for quantize, nothing
    compressed for evict; staged keys are the newest ``len % G`` demotions of each head. The
    oracle then attends with *those* sets, so the logits check that attention really used what
    the subject reports. ``crop`` must be refused (``ValueError``).

After every step, besides: ``get_seq_length()`` is the logical length; ``positions(layer)``
(``full``, ``compressed``, ``staged_keys``) equals the reference for every layer;
``memory_report()`` counts ``length * batch * kv_heads * head_dim * 4`` baseline bytes per layer
(16-bit keys and values), the full-precision bytes of exactly ``|FP|`` tokens, the staging bytes
of exactly the staged keys and values, and codes exactly when something is quantized; after a
decode step with something quantized, ``attention_paths()`` is ``"fused (<backend>)"`` on every layer
exactly when the fused path must be taken (``"fused"``, or ``"auto"`` on a fused model, with a
data-independent policy), and a ``"materialized: ..."`` path otherwise. ``crop(-k)`` succeeds
exactly when ``k`` is at most the tokens of the latest multi-token forward that are still
undemoted (any ``k`` for ``"none"``), ``is_croppable`` says so beforehand, a successful crop is
mirrored on the reference, and otherwise it raises ``ValueError``. ``positions()`` and
``memory_report()`` apply deferred demotions (after which crop is refused), so they are not
called while a crop of pending tokens may follow; they are checked at the next step.

Hypothesis profiles (tests/conftest.py): ``ci`` (loaded by default) keeps each combination to a
few short runs, so the file takes ~20 s on 2 cores; ``deep`` runs many long sequences per
combination, about an hour on 2 cores:
``pytest tests/test_fuzz_stateful.py --hypothesis-profile=deep`` (narrow it with ``-k``, e.g.
``-k "log and quantize"``; ``HYPOTHESIS_PROFILE=deep`` works too).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvpolicy import CompressedCache
from kvpolicy.attention import enable_scores
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.errors import ConfigError
from kvpolicy.formats.packed import DEFAULT_KEY_FIT
from kvpolicy.fused import enable_fused
from kvpolicy.tiny import random_model

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ("llama", "qwen2")
POLICIES = ("log", "recent", "sink", "h2o")
ACTIONS = ("quantize", "evict", "none")
LAYOUTS = ("ordered", "agnostic")
ATTENTION = ("auto", "fused", "materialized")
VOCAB = 96  # kvpolicy.tiny.random_model
SEEDS = st.integers(0, 2**16 - 1)
TOLERANCE = {"quantize": 1e-5, "evict": 1e-5}
BACKEND = TorchBackend()


# --------------------------------------------------------------------------------------------------
# reference policies: the closed forms of policies-spec.md
# --------------------------------------------------------------------------------------------------


def log_fp(w: int, t: int) -> list[int]:
    """(a): ``s = max(0, (T - W - 1) // W)``, ``S_1 = [0, W)``, ``S_{k+1} = (S_k ++ [kW, (k+1)W))[0::2]``,
    ``FP(T) = S_s ∪ [sW, T)``."""
    s = max(0, (t - w - 1) // w)
    sparse: list[int] = list(range(w)) if s >= 1 else []
    for k in range(1, s):
        sparse = (sparse + list(range(k * w, (k + 1) * w)))[0::2]
    return sparse + list(range(s * w, t))


class SharedReference:
    """``FP(T)`` and the demotion order of a data-independent policy (the same for every layer and head).

    ``prompt`` is the first append the policy sees (the prefill after any crop of it); only the
    flush variant depends on it. ``settle(T)`` extends the demotion order to ``T`` appended positions
    as single appends (policies-spec.md: a prefill behaves as single appends), within one step in
    ascending order; the flush variant's prompt is demoted in one event.
    """

    def __init__(self, policy: str, params: dict) -> None:
        self.policy = policy
        self.params = params
        self.reset()

    def reset(self) -> None:
        self.prompt: int | None = None
        self.settled = 0
        self.order: list[int] = []

    def fp(self, t: int) -> list[int]:
        p = self.params
        if t == 0:
            return []
        if self.policy == "log":
            return log_fp(p["window"], t)
        if self.policy == "sink":
            s, r = p["sinks"], p["window"]
            return list(range(min(s, t))) + list(range(max(s, t - r), t))
        r = p["window"]
        if p.get("variant", "sliding") == "sliding":
            return list(range(max(0, t - r), t))
        assert self.prompt is not None and t >= self.prompt
        lo0 = self.prompt if p["prompt"] == "quantize" else self.prompt - self.prompt % r
        return list(range(lo0 + r * max(0, (t - lo0 - 1) // r), t))

    def settle(self, t: int) -> None:
        assert t >= self.settled, f"the reference cannot take back settled positions ({self.settled} -> {t})"
        if self.settled == 0 and t > 0 and self.params.get("variant") == "flush":
            assert self.prompt is not None
            self.order += sorted(set(range(self.prompt)) - set(self.fp(self.prompt)))
            self.settled = self.prompt
        while self.settled < t:
            before = set(self.fp(self.settled)) | {self.settled}
            self.settled += 1
            after = set(self.fp(self.settled))
            assert after <= before, "reference FP not monotone"
            self.order += sorted(before - after)


# --------------------------------------------------------------------------------------------------
# the oracle: every token at full precision, attention shown what the spec says the subject holds
# --------------------------------------------------------------------------------------------------

ORACLE_ATTENTION = "fuzz_oracle_sdpa"
_oracle_masks: dict[int, torch.Tensor] = {}  # layer_idx -> (batch, 1 or q_heads, q, keys) bool, for one forward


def _oracle_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa, with the mask replaced by the per-layer mask of ``_oracle_masks`` when one is set."""
    mask = _oracle_masks.get(module.layer_idx)
    return sdpa_attention_forward(module, query, key, value, attention_mask if mask is None else mask, **kwargs)


AttentionInterface.register(ORACLE_ATTENTION, _oracle_attention)
AttentionMaskInterface.register(ORACLE_ATTENTION, sdpa_mask)


class RecordingCache(CompressedCache):
    """The subject: a ``CompressedCache`` that also keeps a copy of what each layer's latest ``update`` received
    (its return value is passed through untouched)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.received: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.received[layer_idx] = (key_states.clone(), value_states.clone())
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class OracleCache(DynamicCache):
    """A ``DynamicCache`` that stores ``feed[layer_idx]`` (the keys and values the subject's layer received in
    the same step) instead of its own, and returns ``view(layer_idx, keys, values)`` of the full history."""

    def __init__(self) -> None:
        super().__init__()
        self.view = None
        self.feed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        fed_keys, fed_values = self.feed.pop(layer_idx)
        assert fed_keys.shape == key_states.shape, (fed_keys.shape, key_states.shape)
        keys, values = super().update(fed_keys, fed_values, layer_idx, *args, **kwargs)
        return (keys, values) if self.view is None else self.view(layer_idx, keys, values)


def dequantized(
    raw: torch.Tensor, orders: list[list[int]], bits: int, group: int, axis: str, fit: str = "minmax"
) -> torch.Tensor:
    """``raw`` (``(batch, kv_heads, T, d)``) with its demoted positions replaced by their quantized values.

    ``orders``: the demotion order, one list for all heads or one per kv head. Per-token groups:
    every demoted token; per-channel groups: the first ``len // G * G`` in demotion order, in groups of
    ``G`` consecutive demotions (the rest stay staged at full precision). ``fit``: how each group's
    range is chosen (the keys' default is ``"mse"``, the values' ``"minmax"``).
    """
    out = raw.clone()
    for r, order in enumerate(orders):
        heads = slice(None) if len(orders) == 1 else slice(r, r + 1)
        n = len(order) if axis == "token" else len(order) // group * group
        if n == 0:
            continue
        idx = torch.tensor(order[:n], dtype=torch.long)
        block = raw[:, heads].index_select(2, idx).contiguous()
        out[:, heads, idx] = BACKEND.dequantize(BACKEND.quantize(block, bits, group, axis, fit=fit))
    return out


def visible(rows: list[list[int]], q: int, total: int, batch: int, q_heads: int, own: bool) -> torch.Tensor:
    """``(batch, 1 or q_heads, q, total)`` bool: the query at position ``total - q + i`` sees the positions of
    ``rows`` (one list for every head, or one per kv head) and, when ``own``, the tokens of its forward up
    to itself (a multi-token forward); a decode step sees exactly ``rows`` (``FP(T)``)."""
    held = torch.zeros(len(rows), total, dtype=torch.bool)
    for r, row in enumerate(rows):
        held[r, row] = True
    keys, start = torch.arange(total), total - q
    causal = (keys[None, :] >= start) & (keys[None, :] <= start + torch.arange(q)[:, None]) & own  # (q, total)
    mask = held[:, None, :] | causal[None]  # (rows, q, total)
    if len(rows) > 1:
        mask = mask.repeat_interleave(q_heads // len(rows), dim=0)
    return mask[None].expand(batch, -1, -1, -1)


# --------------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_models():
    """Per family, four copies of one tiny random model: ``fused`` (enable_fused), ``scores``
    (enable_scores), ``plain`` (transformers' sdpa, for DynamicCache) and ``oracle`` (sdpa with
    the oracle's per-layer masks)."""
    built: dict[str, dict[str, torch.nn.Module]] = {}

    def get(family: str) -> dict[str, torch.nn.Module]:
        if family not in built:
            plain = random_model(family, layers=2, seed=3)
            fused, scores, oracle = (copy.deepcopy(plain) for _ in range(3))
            enable_fused(fused)
            enable_scores(scores)
            oracle.set_attn_implementation(ORACLE_ATTENTION)
            built[family] = dict(plain=plain, fused=fused, scores=scores, oracle=oracle)
        return built[family]

    return get


def params_for(policy: str, action: str) -> st.SearchStrategy[dict]:
    """Random hyperparameters of a composition, small enough to demote within a few dozen tokens."""
    if policy == "log":
        pol = st.fixed_dictionaries({"window": st.integers(1, 6)})
    elif policy == "sink":
        pol = st.fixed_dictionaries({"sinks": st.integers(0, 4), "window": st.integers(1, 10)})
    elif policy == "recent":
        pol = st.one_of(
            st.fixed_dictionaries({"window": st.integers(1, 12), "variant": st.just("sliding")}),
            st.fixed_dictionaries(
                {
                    "window": st.integers(1, 12),
                    "variant": st.just("flush"),
                    "prompt": st.sampled_from(["quantize", "keep_tail"]),
                }
            ),
        )
    else:
        pol = st.fixed_dictionaries({"heavy": st.integers(0, 6), "recent": st.integers(0, 6)}).filter(
            lambda p: p["heavy"] + p["recent"] >= 1
        )
    act = st.just({})
    if action == "quantize":
        act = st.fixed_dictionaries(
            {
                "bits": st.sampled_from([2, 3, 4, 8]),
                "group_size": st.sampled_from([16, 32, 64]),
                "key_axis": st.sampled_from(["channel", "token"]),
                "value_axis": st.sampled_from(["token", "channel"]),
                "key_fit": st.sampled_from(["minmax", "mse", None]),  # None: the default (DEFAULT_KEY_FIT)
            }
        )
    return st.tuples(pol, act).map(lambda pa: {**pa[0], **pa[1]})


def fused_refused(policy: str, action: str) -> bool:
    """Compositions ``attention="fused"`` cannot serve: nothing compressed, or a per-head/score-based policy
    with a kept (quantized) history."""
    return action == "none" or (action == "quantize" and policy == "h2o")


# --------------------------------------------------------------------------------------------------
# the state machine
# --------------------------------------------------------------------------------------------------


class CacheMachine(RuleBasedStateMachine):
    """One subject cache and its reference, driven in lockstep (see the module docstring)."""

    # set per combination by machine_for()
    family: str
    policy: str
    action: str
    layout: str
    attention: str
    models: dict[str, torch.nn.Module]

    def setup(self, params: dict, on_fused_model: bool) -> None:
        self.params = params
        self.fused_model = on_fused_model or self.attention == "fused"
        self.model = self.models["fused" if self.fused_model else "scores"]
        self.cache = RecordingCache(
            policy=self.policy, action=self.action, layout=self.layout, attention=self.attention, **params
        )
        config = self.model.config
        self.kv_heads = config.num_key_value_heads
        self.q_heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.layers = config.num_hidden_layers
        self.compresses = self.action != "none"
        self.per_head = self.policy == "h2o"
        if self.compresses:
            self.ref_model, self.ref_cache = self.models["oracle"], OracleCache()
        else:
            self.ref_model, self.ref_cache = self.models["plain"], DynamicCache()
        self.shared = None if self.per_head or not self.compresses else SharedReference(self.policy, params)
        self.length = 0  # logical length
        self.batch = 0
        self.fresh = True  # no batch yet (start, or after reset): the next prefill picks one
        self.pending = 0  # tokens of the latest multi-token forward not demoted yet (crop may remove them)
        self.quiet = 0  # the latest single-token forwards that demoted nothing (crop may take them back)
        self.last_start = 0  # length before the latest forward
        self._reset_h2o()

    def _reset_h2o(self) -> None:
        self.h2o_checked = 0  # length at the latest check
        # per layer, per kv head: held positions and demotion order, as read from the subject
        self.h2o_full = [[[] for _ in range(self.kv_heads)] for _ in range(self.layers)]
        self.h2o_compressed = [[set() for _ in range(self.kv_heads)] for _ in range(self.layers)]
        self.h2o_order = [[[] for _ in range(self.kv_heads)] for _ in range(self.layers)]

    # ------------------------------------------------------------------ the reference's plan
    def _plan(self, settled: int) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
        """Per layer: rows of held positions and rows of demotion order after ``settled`` appends."""
        if self.per_head:
            return [list(map(list, f)) for f in self.h2o_full], [list(map(list, o)) for o in self.h2o_order]
        self.shared.settle(settled)
        full, order = [self.shared.fp(settled)], [list(self.shared.order)]
        return [full] * self.layers, [order] * self.layers

    def _run_reference(self, ids: torch.Tensor, start: int, plan) -> torch.Tensor:
        q = ids.shape[1]
        if not self.compresses:
            return self.ref_model(ids, cache=self.ref_cache, use_cache=True).logits
        fulls, orders = plan
        p = self.params
        self.ref_cache.feed = dict(self.cache.received)
        if self.action == "quantize":

            def view(layer_idx, keys, values):
                o = orders[layer_idx]
                return (
                    dequantized(keys, o, p["bits"], p["group_size"], p["key_axis"], p["key_fit"] or DEFAULT_KEY_FIT),
                    dequantized(values, o, p["bits"], p["group_size"], p["value_axis"]),
                )

            self.ref_cache.view = view
        else:
            for layer_idx in range(self.layers):
                _oracle_masks[layer_idx] = visible(fulls[layer_idx], q, start + q, self.batch, self.q_heads, own=q > 1)
        try:
            return self.ref_model(ids, cache=self.ref_cache, use_cache=True).logits
        finally:
            self.ref_cache.view = None
            self.ref_cache.feed = {}
            _oracle_masks.clear()

    # ------------------------------------------------------------------ one forward, checked
    def _forward(self, n: int, seed: int) -> None:
        ids = torch.randint(3, VOCAB, (self.batch, n), generator=torch.Generator().manual_seed(seed))
        start = self.length
        if self.shared is not None and start == 0:
            self.shared.prompt = n
        # a multi-token forward attends to what was held before it (settled) plus its own tokens
        plan = self._plan(start) if n > 1 and self.compresses else None
        self.cache.received.clear()
        with torch.inference_mode():
            got = self.model(ids, cache=self.cache, use_cache=True).logits
        self.length += n
        self.last_start = start
        self.pending = n if n > 1 else 0
        # a single step that demoted nothing, for a policy whose state is a function of the length, can be cropped
        quiet = n == 1 and self._rewinds_by_length() and set(self.shared.fp(start)) <= set(self.shared.fp(start + 1))
        self.quiet = self.quiet + 1 if quiet else 0
        self.check(reference=False)
        if n == 1:
            self._check_paths()
            if self.compresses:
                plan = self._plan(self.length)  # a decode step attends to FP(T) (after its own demotions)
        with torch.inference_mode():
            ref = self._run_reference(ids, start, plan)
        where = f"forward of {n} token(s) at T={start} (batch {self.batch})"
        assert self.ref_cache.get_seq_length() == self.length, where
        if not self.compresses:
            assert torch.equal(got, ref), f"{where}: logits differ from DynamicCache's"
        else:
            torch.testing.assert_close(got, ref, rtol=0, atol=TOLERANCE[self.action], msg=lambda m: f"{where}: {m}")

    def _check_paths(self) -> None:
        if not self.compresses:
            return
        paths = self.cache.attention_paths()
        assert sorted(paths) == list(range(self.layers)), paths
        for layer_idx, path in paths.items():
            compressed = self._has_compressed(layer_idx)
            if self.action == "evict" or not compressed:
                assert path == "full-precision", f"layer {layer_idx}: {path!r}"
            elif self.fused_model and not self.per_head and self.attention != "materialized":
                want = f"fused ({self.cache.layers[layer_idx].engine.backend.name})"
                assert path == want, f"layer {layer_idx}: {path!r}, expected the fused path"
            else:
                assert path.startswith("materialized"), f"layer {layer_idx}: {path!r}"

    def _has_compressed(self, layer_idx: int) -> bool:
        if self.per_head:
            return any(self.h2o_order[layer_idx])
        return bool(self.shared.order)

    # ------------------------------------------------------------------ positions, invariants, bytes
    def check(self, reference: bool = True) -> None:
        """Length, positions, invariants and bytes of the subject (and the reference's length)."""
        assert self.cache.get_seq_length() == self.length
        if reference:
            assert self.ref_cache.get_seq_length() == self.length
        if not self.cache.layers:
            return
        if self.compresses and not self.per_head and self.pending:
            return  # positions() would demote tokens a crop may still remove: checked at the next step
        self.pending = 0
        for layer_idx in range(self.layers):
            pos = self.cache.positions(layer_idx)
            if not self.compresses:
                expected = {"full": list(range(self.length)), "compressed": [], "staged_keys": []}
                assert {k: v.tolist() for k, v in pos.items()} == expected, f"layer {layer_idx}"
            elif self.per_head:
                self._check_h2o(layer_idx, pos)
            else:
                self._check_shared(layer_idx, pos)
        self.h2o_checked = self.length
        self._check_bytes()

    def _staged(self, order: list[int], axis: str) -> list[int]:
        if self.action != "quantize" or axis == "token":
            return []
        g = self.params["group_size"]
        return sorted(order[len(order) // g * g :])

    def _check_shared(self, layer_idx: int, pos: dict) -> None:
        self.shared.settle(self.length)
        order = self.shared.order
        expected = {
            "full": self.shared.fp(self.length),
            "compressed": sorted(order) if self.action == "quantize" else [],
            "staged_keys": self._staged(order, self.params.get("key_axis")),
        }
        got = {k: v.tolist() for k, v in pos.items()}
        assert got == expected, f"layer {layer_idx}, T={self.length}, {self.params}: {got} != {expected}"

    def _check_h2o(self, layer_idx: int, pos: dict) -> None:
        t, budget, recent = self.length, self.params["heavy"] + self.params["recent"], self.params["recent"]
        where = f"layer {layer_idx}, T={t}, {self.params}"
        if t == 0:
            assert all(x.numel() == 0 for x in pos.values()), where
            return
        full, comp, staged = pos["full"], pos["compressed"], pos["staged_keys"]
        assert full.shape == (self.batch, self.kv_heads, min(t, budget)), f"{where}: {tuple(full.shape)}"
        for name, x in pos.items():
            assert (x == x[:1]).all(), f"{where}: {name} differs between batch rows"
        for h in range(self.kv_heads):
            f, c = full[0, h].tolist(), comp[0, h].tolist()
            assert f == sorted(set(f)) and all(0 <= p < t for p in f), f"{where}, head {h}: {f}"
            assert set(range(max(0, t - recent), t)) <= set(f), f"{where}, head {h}: newest {recent} not all held: {f}"
            before = set(self.h2o_full[layer_idx][h]) | set(range(self.h2o_checked, t))
            assert set(f) <= before, f"{where}, head {h}: {sorted(set(f) - before)} came back or appeared"
            if self.action == "quantize":
                assert not set(f) & set(c), f"{where}, head {h}: full and compressed overlap"
                assert sorted(f + c) == list(range(t)), f"{where}, head {h}: full + compressed != all positions"
                old = self.h2o_compressed[layer_idx][h]
                assert old <= set(c), f"{where}, head {h}: compressed positions vanished: {sorted(old - set(c))}"
                self.h2o_order[layer_idx][h] += sorted(set(c) - old)
                self.h2o_compressed[layer_idx][h] = set(c)
            else:
                assert c == [], f"{where}: evict keeps nothing compressed: {c}"
            key_axis = self.params.get("key_axis")
            assert staged[0, h].tolist() == self._staged(self.h2o_order[layer_idx][h], key_axis), where
            self.h2o_full[layer_idx][h] = f

    def _check_bytes(self) -> None:
        report = self.cache.memory_report()
        row = self.batch * self.kv_heads * self.head_dim  # elements of one token's keys (or values), all rows
        for lb in report.layers:
            where = f"layer {lb.layer_idx}, T={self.length}: {lb.segments}"
            assert lb.tokens == self.length, where
            assert lb.baseline_bytes == self.length * row * 2 * 2, where
            if not self.compresses:
                held, order = self.length, []
            elif self.per_head:
                held, order = len(self.h2o_full[lb.layer_idx][0]), self.h2o_order[lb.layer_idx][0]
            else:
                held, order = len(self.shared.fp(self.length)), self.shared.order
            staged_k = len(self._staged(order, self.params.get("key_axis")))
            staged_v = len(self._staged(order, self.params.get("value_axis")))
            quantized = 2 * len(order) - staged_k - staged_v if self.action == "quantize" else 0
            assert lb.segments["full_precision"] == held * row * 2 * 4, where  # fp32 keys and values
            assert lb.segments.get("staging", 0) == (staged_k + staged_v) * row * 4, where
            assert (lb.segments.get("codes", 0) > 0) == (quantized > 0), where

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: self.length == 0)
    @rule(n=st.integers(1, 40), batch=st.integers(1, 3), seed=SEEDS)
    def prefill(self, n: int, batch: int, seed: int) -> None:
        if self.fresh:
            self.batch, self.fresh = batch, False
        self._forward(n, seed)

    @precondition(lambda self: self.length > 0)
    @rule(steps=st.integers(1, 6), seed=SEEDS)
    def decode(self, steps: int, seed: int) -> None:
        for i in range(steps):
            self._forward(1, seed + i)

    @precondition(lambda self: self.length > 0)
    @rule(n=st.integers(2, 12), seed=SEEDS)
    def turn(self, n: int, seed: int) -> None:
        self._forward(n, seed)

    @precondition(lambda self: self.length > 0)
    @rule(data=st.data())
    def crop(self, data: st.DataObject) -> None:
        small = max(1, min(self.pending, self.length))
        k = data.draw(st.one_of(st.integers(1, small), st.integers(1, self.length)), label="tokens to remove")
        # transformers' Cache.is_croppable: whether crop can undo the latest update now
        rewinds = self.quiet if not self.pending else 0
        croppable = not self.compresses or (not self.per_head and (self.pending > 0 or rewinds > 0))
        assert self.cache.is_croppable == croppable, f"is_croppable with {self.pending} pending token(s)"
        if self.compresses and self.per_head:
            with pytest.raises(ValueError, match="cannot be taken"):
                self.cache.crop(-k)
        elif self.compresses and k > max(self.pending, rewinds):
            with pytest.raises(ValueError, match=rf"only the {self.pending} token\(s\)"):
                self.cache.crop(-k)
        else:
            self.cache.crop(-k)
            self.ref_cache.crop(-k)
            self.length -= k
            if self.compresses and k > self.pending:  # single steps taken back: nothing they did was demoted
                self.quiet -= k
                self.shared.settled = min(self.shared.settled, self.length)
            self.pending = max(0, self.pending - k)
            if self.shared is not None and self.last_start == 0:  # the prompt itself was cut
                self.shared.prompt = (self.shared.prompt - k) or None
        self.check()

    @precondition(lambda self: self.length > 0 and self.batch > 1)
    @rule(data=st.data())
    def reorder(self, data: st.DataObject) -> None:
        beams = data.draw(st.lists(st.integers(0, self.batch - 1), min_size=self.batch, max_size=self.batch))
        self.cache.reorder_cache(torch.tensor(beams))
        self.ref_cache.reorder_cache(torch.tensor(beams))
        self.check()

    @precondition(lambda self: self.length > 0 and self.batch > 1)
    @rule(data=st.data())
    def select(self, data: st.DataObject) -> None:
        rows = data.draw(st.lists(st.integers(0, self.batch - 1), min_size=1, max_size=self.batch, unique=True))
        self.cache.batch_select_indices(torch.tensor(rows))
        self.ref_cache.batch_select_indices(torch.tensor(rows))
        self.batch = len(rows)
        self.check()

    @precondition(lambda self: self.length > 0 and self.batch <= 2)
    @rule()
    def repeat(self) -> None:
        self.cache.batch_repeat_interleave(2)
        self.ref_cache.batch_repeat_interleave(2)
        self.batch *= 2
        self.check()

    def _rewinds_by_length(self) -> bool:
        """Whether the subject's crop can take back single steps of this policy (its state is its length's)."""
        return self.compresses and not self.per_head and bool(self.cache.policy.splits_appends)

    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self.ref_cache.reset()
        self.length = self.pending = self.last_start = self.quiet = 0
        self.fresh = True
        if self.shared is not None:
            self.shared.reset()
        self._reset_h2o()
        self.check()


def machine_for(family: str, policy: str, action: str, layout: str, attention: str, models: dict) -> type:
    """The machine class of one combination (hypothesis builds machines without arguments)."""

    class Machine(CacheMachine):
        @initialize(params=params_for(policy, action), on_fused_model=st.booleans())
        def start(self, params: dict, on_fused_model: bool) -> None:
            self.setup(params, on_fused_model)

    Machine.family, Machine.policy, Machine.action = family, policy, action
    Machine.layout, Machine.attention, Machine.models = layout, attention, models
    Machine.__name__ = Machine.__qualname__ = f"CacheMachine_{family}_{policy}_{action}_{layout}_{attention}"
    return Machine


@pytest.mark.parametrize(
    ("policy", "action", "layout", "attention"), list(itertools.product(POLICIES, ACTIONS, LAYOUTS, ATTENTION))
)
@pytest.mark.parametrize("family", FAMILIES)
def test_random_operation_sequences_match_the_reference(fuzz_models, family, policy, action, layout, attention):
    if attention == "fused" and fused_refused(policy, action):
        with pytest.raises(ConfigError, match="attention='fused' cannot serve"):
            CompressedCache(policy=policy, action=action, layout=layout, attention=attention)
        return
    machine = machine_for(family, policy, action, layout, attention, fuzz_models(family))
    run_state_machine_as_test(
        machine,
        settings=settings(
            settings.default, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
        ),
    )


def test_per_head_positions_shape_does_not_depend_on_the_kv_head_count(fuzz_models):
    """Found by the fuzzer: ``positions()`` documents ``(batch, kv_heads, n)`` for per-head policies (H2O),
    but answers 1-D on a model with a single kv head (tiny Qwen2), like a shared policy."""
    model = fuzz_models("qwen2")["scores"]
    cache = CompressedCache(policy="h2o", heavy=2, recent=2, action="quantize", bits=4, group_size=16)
    with torch.inference_mode():
        model(torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0)), cache=cache)
    assert model.config.num_key_value_heads == 1
    for key, value in cache.positions(0).items():
        assert value.shape[:2] == (2, 1), f"{key}: shape {tuple(value.shape)}, expected (batch=2, kv_heads=1, n)"
