"""The 2-rank worker of tests/test_tensor_parallel.py (run under ``torchrun``; not a test module).

Usage::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 tests/tp_worker.py --work DIR --out summary.json

Rank 0 saves two tiny Llama models under ``DIR`` (fixed seed; nothing is downloaded): ``heads4``
(8 query heads, 4 kv heads, head_dim 32, 2 layers, float32) and ``heads3`` (3 kv heads, which 2 ranks
cannot split). Every rank loads ``heads4`` twice, as a single-process reference (no ``tp_plan``: all
4 heads) and tensor-parallel (``tp_plan="auto"``: 2 heads per rank, gloo), and runs every case on
both: each policy (log, recent sliding and flush, sink, h2o, the snapkv plugin, and a test policy
that shares one score-based selection across heads) with each action (none, evict, quantize 4 and 2
bits, quantize 4 bits with ``transform="hadamard"``, and the ``kvpolicy-3bit`` composition in small:
two tiers of centred codebook blocks under the rotation), teacher-forced (a prefill of ``PREFILL``
tokens, then ``DECODE`` single tokens), so both runs see the same tokens whatever their logits. Each
rank compares its heads with the same heads of its reference:

- logits of every step (max absolute difference);
- ``cache.positions(l)`` of every layer (per-head policies: the rank's heads of the reference);
- every quantization call (a recording ``torch`` backend keeps each input and its result): codes,
  float16 minimums and scales (codebook blocks: codes, scales and centres), with a proof for each
  difference (see :func:`tie_analysis`);
- the stores held at the end, and the bytes held (``memory_report``);
- for h2o and snapkv, the smallest relative score gap at a selection boundary (distance from a tie).

Rank 0 then replays each quantized case on the reference model with the codes and metadata the
ranks stored (gathered, heads concatenated) in place of its own: if the stored state is the whole
difference, the replayed logits equal the tensor-parallel ones to float noise. Last, the ``heads3``
model shows what a kv-head count the TP size does not divide does. Rank 0 writes everything to
``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kvpolicy import CompressedCache, Quantize, Tiered, distributed, registry
from kvpolicy.attention import enable_scores
from kvpolicy.backends.torch_backend import PackedTensor, TorchBackend, _grouped, unpack
from kvpolicy.errors import CacheFileError, ConfigError
from kvpolicy.formats import codebook
from kvpolicy.formats.codebook import CodebookTensor
from kvpolicy.policies import LogWindow, Policy, PolicyState, RecentWindow, SinkWindow
from kvpolicy.policies.h2o import HeavyHitters, HeavyHittersState

#: prompt tokens, then decode steps (one token each)
PREFILL = 48
DECODE = 24
VOCAB = 128
HEAD_DIM = 32
#: quantization group size (keys: 16 tokens of one channel; values: 16 channels of one token)
GROUP = 16
#: a differing code or float16 minimum/scale counts as a rounding tie when the group's inputs in the
#: two runs are within this fraction of a quantization step of each other
TIE_GAP = 1e-3

ACTIONS: dict[str, dict[str, Any]] = {
    "none": {"action": "none"},
    "evict": {"action": "evict"},
    "quantize4": {"action": "quantize", "bits": 4, "group_size": GROUP},
    "quantize2": {"action": "quantize", "bits": 2, "group_size": GROUP},
    "quantize4-hadamard": {"action": "quantize", "bits": 4, "group_size": GROUP, "transform": "hadamard"},
    # kvpolicy-3bit in small: centred 4-bit codebook keys and values for the demoted tokens the log rule
    # at 8 keeps, 3-bit keys and 2-bit values below (tokens moving down are re-quantized)
    "quantize-tiered-codebook": {
        "action": Tiered(
            tiers=[
                Quantize(bits=4, scheme="codebook", key_centre=True),
                Quantize(key_bits=3, value_bits=2, scheme="codebook", key_centre=True),
            ],
            keep=[LogWindow(window=8)],
        ),
        "transform": "hadamard",
    },
}


# ---------------------------------------------------------------------- models
def build_model(path: Path, kv_heads: int, heads: int, head_dim: int, hidden: int = 128, seed: int = 0) -> None:
    """Save a tiny random float32 Llama to ``path``; query/key projections scaled x4 so attention is
    peaked (selections and quantization errors then matter)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=256, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=1024, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    model.save_pretrained(path)


def load(path: Path, tp: bool) -> torch.nn.Module:
    """The saved model, tensor-parallel over every rank (``tp_plan="auto"``) or whole, with kvpolicy's
    score-reporting attention (outputs unchanged; score-based policies get their scores)."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tp_plan= is deprecated in favour of distributed_config=
        kwargs = {"tp_plan": "auto"} if tp else {}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()
    enable_scores(model)
    return model


# ---------------------------------------------------------------------- instrumentation
class RecordingBackend(TorchBackend):
    """The ``torch`` backend, keeping every ``quantize`` input and result.

    Parameters
    ----------
    replay : list of PackedTensor, optional
        Returned by the calls in order instead of the backend's own results (the replay).
    """

    def __init__(self, replay: list[PackedTensor] | None = None) -> None:
        self.calls: list[tuple[torch.Tensor, PackedTensor]] = []
        self.replay = replay

    def quantize(  # type: ignore[override]
        self, x: torch.Tensor, fmt: Any, centre: torch.Tensor | None = None
    ) -> PackedTensor | CodebookTensor:
        q = super().quantize(x, fmt, centre=centre)
        if self.replay is not None:
            q = self.replay[len(self.calls)]
        self.calls.append((x.detach().clone(), q))
        return q


def _gap(sorted_desc: torch.Tensor, keep: int) -> float:
    """Smallest relative gap between the lowest kept and the highest dropped score of ``(heads, n)``
    scores sorted in descending order, ``keep`` kept (``inf`` when nothing is dropped)."""
    if keep <= 0 or keep >= sorted_desc.shape[1]:
        return float("inf")
    kept, dropped = sorted_desc[:, keep - 1], sorted_desc[:, keep]
    return float(((kept - dropped) / kept.abs().clamp_min(1e-30)).min())


class SharedScoresState(PolicyState):
    """State of :class:`SharedScores` (positions as a list, scores summed over every head it is given)."""

    def __init__(self, heavy: int, recent: int) -> None:
        self.heavy, self.recent = heavy, recent
        self.length = 0
        self.pos: list[int] = []
        self.acc = torch.empty(0, dtype=torch.float64)
        self.local = torch.empty(0, dtype=torch.float64)  # the same from this rank's heads only
        self.pending = torch.empty(0, dtype=torch.float64)
        self.pending_local = torch.empty(0, dtype=torch.float64)
        self.rows_seen: set[int] = set()
        self.local_differs = False

    def observe(self, scores: torch.Tensor, positions: torch.Tensor) -> None:
        rows = scores.shape[0]
        self.rows_seen.add(rows)
        world = dist.get_world_size() if dist.is_initialized() else 1
        mine = rows // world if world > 1 and rows % world == 0 else rows
        start = dist.get_rank() * mine if mine != rows else 0
        total, local = scores.double().sum(0).cpu(), scores[start : start + mine].double().sum(0).cpu()
        held = len(self.pos)
        self.acc, self.local = self.acc + total[:held], self.local + local[:held]
        self.pending, self.pending_local = total[held:].clone(), local[held:].clone()

    def append(self, n: int) -> list[int]:
        k = min(n, self.pending.shape[0])
        own, own_local = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
        own[:k], own_local[:k] = self.pending[:k], self.pending_local[:k]
        self.pending, self.pending_local = self.pending[k:], self.pending_local[k:]
        self.pos += range(self.length, self.length + n)
        self.acc, self.local = torch.cat([self.acc, own]), torch.cat([self.local, own_local])
        self.length += n
        if len(self.pos) <= self.heavy + self.recent:
            return []
        old = len(self.pos) - self.recent
        keep = sorted(torch.sort(-self.acc[:old], stable=True).indices[: self.heavy].tolist())
        keep_local = sorted(torch.sort(-self.local[:old], stable=True).indices[: self.heavy].tolist())
        self.local_differs |= keep != keep_local
        kept = set(keep)
        demoted = [self.pos[i] for i in range(old) if i not in kept]
        idx = keep + list(range(old, len(self.pos)))
        self.pos = [self.pos[i] for i in idx]
        self.acc, self.local = self.acc[idx], self.local[idx]
        return demoted

    def full_positions(self) -> list[int]:
        return list(self.pos)

    def full_count_after(self, n: int) -> int:
        return min(len(self.pos) + n, self.heavy + self.recent)


@dataclass(frozen=True)
class SharedScores(Policy):
    """A test policy sharing one score-based selection across heads (none is built in): the ``recent``
    newest tokens and the ``heavy`` others with the most attention summed over every head. Its state
    records how many heads' scores it was given and whether this rank's heads alone would have chosen
    differently (what :func:`kvpolicy.distributed.gather_heads` prevents)."""

    heavy: int = 8
    recent: int = 8

    name = "shared-scores"
    needs_scores = True

    def new_state(self, num_heads: int = 1) -> SharedScoresState:
        return SharedScoresState(self.heavy, self.recent)


def policies() -> tuple[dict[str, Policy], list[float]]:
    """The policies of the run by case name, and the list h2o and snapkv append their smallest relative
    score gap at each selection boundary to (instrumented subclasses: they select what the originals do).
    snapkv comes from the installed plugin, through its entry point; absent if it is not installed."""
    gaps: list[float] = []

    class GapH2OState(HeavyHittersState):
        def append(self, n: int) -> torch.Tensor:
            own = torch.zeros(self.num_heads, n)
            k = min(n, self._pending.shape[1])
            own[:, :k] = self._pending[:, :k]
            acc = torch.cat([self.acc, own], dim=1)
            if acc.shape[1] > self.heavy + self.recent:
                old = acc.shape[1] - self.recent
                gaps.append(_gap(torch.sort(acc[:, :old], dim=1, descending=True).values, self.heavy))
            return super().append(n)

    @dataclass(frozen=True)
    class GapH2O(HeavyHitters):
        def new_state(self, num_heads: int = 1) -> GapH2OState:
            return GapH2OState(self.heavy, self.recent, num_heads)

    out: dict[str, Policy] = {
        "log": LogWindow(window=8),
        "recent": RecentWindow(window=16),
        "recent-flush": RecentWindow(window=16, variant="flush"),
        "sink": SinkWindow(sinks=4, window=12),
        "h2o": GapH2O(heavy=8, recent=8),
    }
    try:
        snap = registry.get("policies", "snapkv")
    except ConfigError:
        snap = None
    if snap is not None:
        from kvpolicy_snapkv.policy import SnapKVState, votes

        class GapSnapState(SnapKVState):
            def _select_prompt(self, n: int) -> torch.Tensor:
                p = self.policy
                if n > p.capacity + p.window and self._prompt_scores is not None:
                    pooled = votes(self._prompt_scores[:, : n - p.window], p.kernel_size, p.pooling)
                    gaps.append(_gap(torch.sort(pooled, dim=1, descending=True).values, p.capacity))
                return super()._select_prompt(n)

        @dataclass(frozen=True)
        class GapSnapKV(snap):
            def new_state(self, num_heads: int = 1) -> GapSnapState:
                return GapSnapState(self, num_heads)

        out["snapkv"] = GapSnapKV(capacity=16, window=8, kernel_size=5)
    out["shared-scores"] = SharedScores(heavy=8, recent=8)
    return out, gaps


def quantizes(action: str) -> bool:
    """Whether the case's action quantizes (its calls are recorded and compared)."""
    return action.startswith("quantize")


def make_cache(policy: Policy, action: str, backend: RecordingBackend) -> CompressedCache:
    kwargs = dict(ACTIONS[action])
    if quantizes(action):
        kwargs["backend"] = backend
    return CompressedCache(policy=policy, **kwargs)


# ---------------------------------------------------------------------- one run
@dataclass
class Run:
    """What a teacher-forced run leaves: ``logits`` ``(1 + DECODE, vocab)`` (the prefill's last
    position, then each decode step), the cache, and the recording backend."""

    logits: torch.Tensor
    cache: CompressedCache | Any
    backend: RecordingBackend | None


def run(model: torch.nn.Module, ids: torch.Tensor, cache: Any, backend: RecordingBackend | None = None) -> Run:
    with torch.no_grad():
        out = model(ids[:, :PREFILL], cache=cache, use_cache=True)
        steps = [out.logits[0, -1].float()]
        for t in range(PREFILL, ids.shape[1]):
            steps.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[0, -1].float())
    return Run(torch.stack(steps), cache, backend)


# ---------------------------------------------------------------------- comparisons
def restrict_heads(q: PackedTensor | CodebookTensor, heads: slice) -> PackedTensor | CodebookTensor:
    """``q`` restricted to some kv heads (dim 1 of its codes, scales and minimums or centre)."""
    codes = q.codes[:, heads]
    if isinstance(q, CodebookTensor):
        centre = None if q.centre is None else q.centre[:, heads]
        return CodebookTensor(codes, q.scales[:, heads], q.bits, (q.shape[0], codes.shape[1], *q.shape[2:]), q.dtype,
                              centre)  # fmt: skip
    return PackedTensor(
        codes, q.scales[:, heads], q.zeros[:, heads], q.bits, q.group_size, q.axis,
        (q.shape[0], codes.shape[1], *q.shape[2:]), q.dtype,
    )  # fmt: skip


def merge_heads(parts: list[PackedTensor | CodebookTensor]) -> PackedTensor | CodebookTensor:
    """The ranks' containers of one quantization call as the single-process one (heads concatenated)."""
    first, codes = parts[0], torch.cat([p.codes for p in parts], dim=1)
    if isinstance(first, CodebookTensor):
        centre = None if first.centre is None else torch.cat([p.centre for p in parts], dim=1)
        return CodebookTensor(codes, torch.cat([p.scales for p in parts], dim=1), first.bits,
                              (first.shape[0], codes.shape[1], *first.shape[2:]), first.dtype, centre)  # fmt: skip
    return PackedTensor(
        codes, torch.cat([p.scales for p in parts], dim=1), torch.cat([p.zeros for p in parts], dim=1),
        first.bits, first.group_size, first.axis, (first.shape[0], codes.shape[1], *first.shape[2:]), first.dtype,
    )  # fmt: skip


def compare_positions(ref: CompressedCache, tp: CompressedCache, heads: slice) -> tuple[bool, str]:
    """Whether every layer's positions (full, compressed, staged) agree on the rank's heads."""
    for layer in range(len(ref.layers)):
        a, b = ref.positions(layer), tp.positions(layer)
        for key in a:
            x, y = a[key], b[key]
            if x.dim() == 3:  # per head: (batch, kv_heads, n)
                x = x[:, heads]
            if x.shape != y.shape or not torch.equal(x.cpu(), y.cpu()):
                return False, f"layer {layer} {key}: reference {x.tolist()} vs tp {y.tolist()}"
    return True, ""


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Whether float16/bfloat16 values ``a`` and ``b`` are equal or neighbours (one ulp apart)."""
    lo, hi = torch.minimum(a, b), torch.maximum(a, b)
    return (lo == hi) | (torch.nextafter(lo, torch.full_like(lo, float("inf"))) == hi)


def _straddles(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether a rounding boundary ``k + 0.5`` lies between ``a`` and ``b``, and that boundary."""
    low, high = torch.minimum(a, b), torch.maximum(a, b)
    boundary = torch.floor(low + 0.5) + 0.5  # the first half-integer above the smaller value
    return (low <= boundary) & (boundary <= high), boundary


def _unit(x: torch.Tensor, q: CodebookTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the codebook quantizer bucketizes, ``u = (x - μ) · √d / ‖x - μ‖`` with the stored centre
    ``μ``, computed as it does, and ``‖x - μ‖`` per vector."""
    xf = x.float()
    if q.centre is not None:
        xf = xf - q.centre.float()
    norm = torch.linalg.vector_norm(xf, dim=-1)
    scale = math.sqrt(x.shape[-1]) / norm.clamp_min(torch.finfo(torch.float32).tiny)
    return xf * scale.unsqueeze(-1), norm


def codebook_ties(i: int, xr: torch.Tensor, qr: CodebookTensor, xt: torch.Tensor, qt: CodebookTensor,
                  out: dict[str, Any]) -> None:  # fmt: skip
    """:func:`tie_analysis` of one codebook call (a group is one vector: one token of one head).

    - The stored centres (a stream's first block's mean) are equal or neighbouring numbers of their dtype.
    - A code that differs is a tie when the two runs' ``u`` are within ``TIE_GAP`` (plus the centres'
      difference, in units of ``u``) of each other: an edge of the codebook lies between them, which
      the differing codes themselves show once ``u`` is checked to give the stored codes.
    - A scale (``‖x - μ‖ / ‖C[codes]‖``) that differs is a tie when the vector's codes all agree, the
      stored scales are neighbouring numbers and every input moved by less than ``TIE_GAP`` of the
      vector's coordinate scale; in a vector with a proved flip the reconstruction's norm differs, and
      so may its scale.
    """
    _, edges = codebook._tables(qr.bits, "cpu")
    ur, nr = _unit(xr, qr)
    ut, _ = _unit(xt, qt)
    cr, ct = unpack(qr.codes, qr.bits), unpack(qt.codes, qt.bits)
    for name, u, c in (("reference", ur, cr), ("tensor-parallel", ut, ct)):
        if not torch.equal(torch.bucketize(u, edges, right=True).to(c.dtype), c):
            out["unproven"].append(f"call {i}: the {name} codes are not what its inputs give (analysis out of date)")
            return
    shift = torch.zeros_like(nr)
    if qr.centre is not None:
        if not bool(_adjacent(qr.centre, qt.centre).all()):
            out["unproven"].append(f"call {i}: centres differ beyond a rounding tie")
        moved = (qr.centre.float() - qt.centre.float()).abs().amax(-1)  # (B, H, 1)
        shift = moved * math.sqrt(xr.shape[-1]) / nr.clamp_min(1e-30)
    gap = (ur - ut).abs()
    flip = cr != ct
    out["codes"] += cr.numel()
    out["flipped"] += int(flip.sum())
    out["groups"] += nr.numel()
    out["max_input_diff"] = max(out["max_input_diff"], float((xr.float() - xt.float()).abs().max()))
    if (~flip).any():
        out["max_gap"] = max(out["max_gap"], float(gap[~flip].max()))
    if flip.any():
        proven = gap[flip] <= TIE_GAP + shift.unsqueeze(-1).expand_as(gap)[flip]
        out["flips_proven"] += int(proven.sum())
        out["max_flip_gap"] = max(out["max_flip_gap"], float(gap[flip].max()))
        if not bool(proven.all()):
            out["unproven"].append(f"call {i}: {int((~proven).sum())} flipped code(s) not at a codebook edge tie")
    differ = qr.scales != qt.scales
    if differ.any():
        noise = (xr.float() - xt.float()).abs().amax(-1)
        quiet = noise <= TIE_GAP * nr / math.sqrt(xr.shape[-1])
        flipped_vector = flip.any(-1)
        ok = flipped_vector | (_adjacent(qr.scales, qt.scales) & quiet)
        out["groups_meta_differ"] += int(differ.sum())
        out["groups_scale_differ"] += int(differ.sum())
        out["groups_meta_proven"] += int((ok & differ).sum())
        if not bool(ok[differ].all()):
            out["unproven"].append(f"call {i}: {int((differ & ~ok).sum())} scale(s) differ beyond a rounding tie")


def tie_analysis(ref_calls: list, tp_calls: list, heads: slice) -> dict[str, Any]:
    """Compare the quantization calls of the two runs on the rank's heads and prove each difference a tie
    (codebook calls: :func:`codebook_ties`).

    For every group, with ``u = (x - min) * (1 / scale)`` computed as the quantizer does:

    - same float16 minimum and scale: a code that differs is a rounding tie when a boundary ``k + 0.5``
      lies between the two runs' ``u`` and they are within ``TIE_GAP`` of a step of each other;
    - a float16 minimum or scale that differs is a tie of the metadata's own rounding when the stored
      values are neighbouring float16 numbers and every input of the group moved by less than
      ``TIE_GAP`` of a step; a code of such a group that differs must have a boundary between its two
      ``u``, no farther apart than the grid shift (one float16 step of minimum and scale) plus the noise.

    Returns
    -------
    dict
        Counts (``codes``, ``flipped``, ``flips_proven``, ``groups``, ``groups_meta_differ``...),
        the largest gaps, and ``unproven``: a message per call where a difference is not a proved tie.
    """
    keys = ("codes", "flipped", "flips_proven", "groups", "groups_meta_differ", "groups_meta_proven",
            "groups_zero_differ", "groups_scale_differ", "codes_in_meta_groups", "flipped_in_meta_groups")  # fmt: skip
    out: dict[str, Any] = dict.fromkeys(keys, 0)
    out.update(
        max_gap=0.0, max_input_diff=0.0, max_flip_gap=0.0, max_flip_boundary_distance=0.0, max_meta_flip_gap=0.0,
        unproven=[],
    )  # fmt: skip
    if len(ref_calls) != len(tp_calls):
        out["unproven"].append(f"{len(ref_calls)} quantize calls in the reference, {len(tp_calls)} under TP")
        return out
    for i, ((xr, qr), (xt, qt)) in enumerate(zip(ref_calls, tp_calls, strict=True)):
        xr, qr = xr[:, heads], restrict_heads(qr, heads)
        if xr.shape != xt.shape:
            out["unproven"].append(f"call {i}: shapes {tuple(xr.shape)} vs {tuple(xt.shape)}")
            continue
        if isinstance(qr, CodebookTensor):
            codebook_ties(i, xr, qr, xt, qt, out)
            continue
        out["max_input_diff"] = max(out["max_input_diff"], float((xr.float() - xt.float()).abs().max()))
        gr, gt = _grouped(xr, qr.group_size, qr.axis).float(), _grouped(xt, qt.group_size, qt.axis).float()
        cr, ct = unpack(qr.codes, qr.bits), unpack(qt.codes, qt.bits)
        zr, zt, sr, st = qr.zeros.float(), qt.zeros.float(), qr.scales.float(), qt.scales.float()
        ur = (gr - zr.unsqueeze(-1)) * torch.where(sr > 0, 1.0 / sr, torch.zeros_like(sr)).unsqueeze(-1)
        ut = (gt - zt.unsqueeze(-1)) * torch.where(st > 0, 1.0 / st, torch.zeros_like(st)).unsqueeze(-1)
        gap = (ur - ut).abs()
        same_meta = (zr == zt) & (sr == st)  # per group
        flip = cr != ct
        out["codes"] += cr.numel()
        out["flipped"] += int(flip.sum())
        out["groups"] += same_meta.numel()
        plain_gaps = gap[same_meta]
        if plain_gaps.numel():
            out["max_gap"] = max(out["max_gap"], float(plain_gaps.max()))
        plain = flip & same_meta.unsqueeze(-1)
        if plain.any():
            g = gap[plain]
            straddles, boundary = _straddles(ur[plain], ut[plain])
            proven = straddles & (g <= TIE_GAP)
            out["flips_proven"] += int(proven.sum())
            out["max_flip_gap"] = max(out["max_flip_gap"], float(g.max()))
            distance = float((ur[plain] - boundary).abs().max())
            out["max_flip_boundary_distance"] = max(out["max_flip_boundary_distance"], distance)
            if not bool(proven.all()):
                out["unproven"].append(f"call {i}: {int((~proven).sum())} flipped code(s) not at a rounding tie")
        differ = ~same_meta
        if not differ.any():
            continue
        qmax = (1 << qr.bits) - 1
        noise = (gr - gt).abs().amax(-1)
        step = torch.minimum(sr, st)
        group_ok = _adjacent(qr.zeros, qt.zeros) & _adjacent(qr.scales, qt.scales) & (noise <= TIE_GAP * step)
        out["groups_meta_differ"] += int(differ.sum())
        out["groups_meta_proven"] += int((group_ok & differ).sum())
        out["groups_zero_differ"] += int((zr != zt).sum())
        out["groups_scale_differ"] += int((sr != st).sum())
        out["codes_in_meta_groups"] += int(differ.sum()) * cr.shape[-1]
        if not bool(group_ok[differ].all()):
            bad = differ & ~group_ok
            out["unproven"].append(
                f"call {i}: {int(bad.sum())} group(s) whose metadata differs beyond a rounding tie: minimums "
                f"{zr[bad].tolist()} vs {zt[bad].tolist()}, scales {sr[bad].tolist()} vs {st[bad].tolist()}, "
                f"input noise {noise[bad].tolist()}"
            )
        meta = flip & differ.unsqueeze(-1)
        if meta.any():
            shift = ((zr - zt).abs() + qmax * (sr - st).abs() + noise) / step  # the grid's move, in steps
            g = gap[meta]
            straddles, _ = _straddles(ur[meta], ut[meta])
            bound = shift.unsqueeze(-1).expand_as(gap)[meta] * (1 + 1e-3) + 1e-5
            proven = straddles & (g <= bound) & group_ok.unsqueeze(-1).expand_as(gap)[meta]
            out["flipped_in_meta_groups"] += int(meta.sum())
            out["flips_proven"] += int(proven.sum())
            out["max_meta_flip_gap"] = max(out["max_meta_flip_gap"], float(g.max()))
            if not bool(proven.all()):
                out["unproven"].append(f"call {i}: {int((~proven).sum())} flipped code(s) in a metadata-tie group")
    out["flipped_share"] = out["flipped"] / max(out["codes"], 1)
    return out


def _streams(store: Any) -> list[tuple[Any, Any]]:
    """The (keys, values) streams of a layer's store: one pair, or one per tier."""
    stores = store._stores() if hasattr(store, "_stores") else [store]
    return [(s.k, s.v) for s in stores]


def compare_stores(ref: CompressedCache, tp: CompressedCache, heads: slice) -> dict[str, Any]:
    """Codes, scales, minimums (centres) and staged tokens held at the end, on the rank's heads."""
    out: dict[str, Any] = {"codes": 0, "flipped": 0, "meta_differ": 0, "staging_max_diff": 0.0}
    for lr, lt in zip(ref.layers, tp.layers, strict=True):
        streams = zip(_streams(lr.engine.held.store), _streams(lt.engine.held.store), strict=True)
        pairs = [p for a, b in streams for p in zip(a, b, strict=True)]
        for a, b in pairs:
            if a.q is not None:
                qa = restrict_heads(a.q, heads)
                ca, cb = unpack(qa.codes, qa.bits), unpack(b.q.codes, b.q.bits)
                out["codes"] += ca.numel()
                out["flipped"] += int((ca != cb).sum())
                if isinstance(qa, CodebookTensor):
                    centre = 0 if qa.centre is None else int((qa.centre != b.q.centre).sum())
                    out["meta_differ"] += int((qa.scales != b.q.scales).sum()) + centre
                else:
                    out["meta_differ"] += int(((qa.scales != b.q.scales) | (qa.zeros != b.q.zeros)).sum())
            if a.staging is not None:
                diff = float((a.staging[:, heads] - b.staging).abs().max())
                out["staging_max_diff"] = max(out["staging_max_diff"], diff)
    return out


# ---------------------------------------------------------------------- the cases
def run_cases(ref_model: Any, tp_model: Any, ids: torch.Tensor, rank: int, world: int) -> list[dict[str, Any]]:
    """Every policy x action on both models; one summary per case, for this rank's heads."""
    by_name, gaps = policies()
    local = tp_model.config.num_key_value_heads // world
    heads = slice(rank * local, (rank + 1) * local)
    results = []
    for policy_name, policy in by_name.items():
        for action in ACTIONS:
            start = time.perf_counter()
            gaps.clear()
            ref = run(ref_model, ids, make_cache(policy, action, b := RecordingBackend()), b)
            ref_gap = min(gaps, default=float("inf"))
            gaps.clear()
            tp = run(tp_model, ids, make_cache(policy, action, b := RecordingBackend()), b)
            tp_gap = min(gaps, default=float("inf"))
            same, detail = compare_positions(ref.cache, tp.cache, heads)
            entry: dict[str, Any] = {
                "policy": policy_name,
                "action": action,
                "rank": rank,
                "kv_heads_reference": int(ref.cache.layers[0].keys.shape[1]),
                "kv_heads_rank": int(tp.cache.layers[0].keys.shape[1]),
                "logits_max_diff": float((ref.logits - tp.logits).abs().max()),
                "logits_max_diff_prefill": float((ref.logits[0] - tp.logits[0]).abs().max()),
                "logits_max_abs": float(ref.logits.abs().max()),
                "positions_equal": same,
                "positions_detail": detail,
                "bytes_reference": ref.cache.memory_report().total_bytes,
                "bytes_rank": tp.cache.memory_report().total_bytes,
                "score_gap_reference": ref_gap,
                "score_gap_rank": tp_gap,
                "tp_logits": tp.logits,
            }
            if quantizes(action):
                entry["ties"] = tie_analysis(ref.backend.calls, tp.backend.calls, heads)
                entry["store"] = compare_stores(ref.cache, tp.cache, heads)
                entry["tp_calls"] = [q for _, q in tp.backend.calls]  # for the replay on rank 0
                if ACTIONS[action].get("transform") == "hadamard":
                    ref_matrix = ref.cache.transform.matrix(HEAD_DIM)
                    entry["hadamard_matrix"] = tp.cache.transform.matrix(HEAD_DIM)
                    entry["hadamard_same_as_reference"] = bool(torch.equal(entry["hadamard_matrix"], ref_matrix))
            if isinstance(policy, SharedScores) and action != "none":
                states = [layer.engine.held.state for layer in tp.cache.layers]
                entry["shared_rows_seen"] = sorted({r for s in states for r in s.rows_seen})
                entry["shared_local_would_differ"] = any(s.local_differs for s in states)
            entry["seconds"] = time.perf_counter() - start
            results.append(entry)
    return results


def replay(ref_model: Any, ids: torch.Tensor, per_rank: list[list[dict[str, Any]]]) -> dict[str, float | None]:
    """Rank 0: each quantized case again on the reference, the ranks' stored codes in place of its own.

    Returns the max absolute difference of its logits from the tensor-parallel ones, by case
    (``None`` when the ranks made different numbers of quantization calls)."""
    by_name, _ = policies()
    out: dict[str, float | None] = {}
    for i, entry in enumerate(per_rank[0]):
        if "tp_calls" not in entry:
            continue
        calls = [entries[i]["tp_calls"] for entries in per_rank]
        case = f"{entry['policy']}/{entry['action']}"
        if len({len(c) for c in calls}) != 1:
            out[case] = None
            continue
        b = RecordingBackend(replay=[merge_heads(list(parts)) for parts in zip(*calls, strict=True)])
        result = run(ref_model, ids, make_cache(by_name[entry["policy"]], entry["action"], b), b)
        out[case] = float((result.logits - entry["tp_logits"]).abs().max())
    return out


def bad_heads(path: Path) -> dict[str, Any]:
    """What a kv-head count the TP size does not divide does: transformers, then kvpolicy."""
    out: dict[str, Any] = {}
    model = load(path, tp=True)
    out["loaded"] = True
    out["num_key_value_heads"] = model.config.num_key_value_heads
    out["k_proj_local_rows"] = int(model.model.layers[0].self_attn.k_proj.weight.to_local().shape[0])
    checks = {
        "check_model": lambda: distributed.check_model(model),
        "check_config": lambda: distributed.check_config(model.config),
        "cache_with_config": lambda: CompressedCache(policy="recent", window=4, action="evict", config=model.config),
    }
    for what, call in checks.items():
        try:
            call()
            out[what] = {"raised": None}
        except ConfigError as exc:
            out[what] = {"raised": type(exc).__name__, "message": str(exc)}
    try:  # without config= no cache sees the model before its attention fails
        with torch.no_grad():
            model(torch.arange(3, 13)[None], cache=CompressedCache(policy="recent", window=4, action="evict"))
        out["forward"] = {"raised": None}
    except Exception as exc:
        out["forward"] = {"raised": type(exc).__name__, "message": str(exc)[:300]}
    return out


def saved_caches(tp_model: Any, ref_model: Any, ids: torch.Tensor, rank: int, work: Path) -> dict[str, Any]:
    """Each rank saves its cache (with and without ``model=``) and loads its own and the other rank's.

    Returns, for this rank: whether its own file continues bit for bit, and the message of each refusal
    (``None``: it loaded): the other rank's file with and without ``model=``, this rank's file saved
    without ``model=`` loaded on the other rank, and this rank's file on the whole (untensor-parallel) model.
    """

    def attempt(path: Path, model: Any = None) -> str | None:
        try:
            CompressedCache.load(path, model=model)
        except CacheFileError as exc:
            return str(exc)
        return None

    split = PREFILL // 2
    cache = CompressedCache(policy="log", window=4, bits=2, group_size=GROUP, backend="torch", config=tp_model.config)
    bare = CompressedCache(policy="log", window=4, bits=2, group_size=GROUP, backend="torch")
    with torch.no_grad():
        tp_model(ids[:, :split], cache=cache, use_cache=True)
        tp_model(ids[:, :split], cache=bare, use_cache=True)
    own, unnamed = work / f"rank{rank}.kvc", work / f"rank{rank}-unnamed.kvc"
    cache.save(own, model=tp_model)
    bare.save(unnamed)
    dist.barrier()
    other, other_unnamed = work / f"rank{1 - rank}.kvc", work / f"rank{1 - rank}-unnamed.kvc"
    out: dict[str, Any] = {
        "other_with_model": attempt(other, tp_model),
        "other_without_model": attempt(other),
        "other_saved_without_model": attempt(other_unnamed),
        "own_on_whole_model": attempt(own, ref_model),
    }
    loaded = CompressedCache.load(own, model=tp_model)
    with torch.no_grad():  # both ranks run the same forwards in the same order (their collectives pair up)
        a = [tp_model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(split, split + 4)]
        b = [tp_model(ids[:, t : t + 1], cache=loaded, use_cache=True).logits for t in range(split, split + 4)]
    out["own_continues_exactly"] = all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    return out


_PRIVATE = ("tp_calls", "hadamard_matrix", "tp_logits")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="2-rank tensor-parallel check of kvpolicy (run under torchrun)")
    parser.add_argument("--work", type=Path, required=True, help="directory for the two saved models")
    parser.add_argument("--out", type=Path, required=True, help="JSON summary written by rank 0")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    good, bad = args.work / "heads4", args.work / "heads3"
    if rank == 0:
        build_model(good, kv_heads=4, heads=8, head_dim=HEAD_DIM)
        build_model(bad, kv_heads=3, heads=6, head_dim=16, hidden=96)
    dist.barrier()
    ids = torch.randint(3, VOCAB, (1, PREFILL + DECODE), generator=torch.Generator().manual_seed(1))
    ref_model, tp_model = load(good, tp=False), load(good, tp=True)
    t_load = time.perf_counter()
    from transformers import DynamicCache

    dynamic_ref, dynamic_tp = run(ref_model, ids, DynamicCache()), run(tp_model, ids, DynamicCache())
    dynamic = float((dynamic_ref.logits - dynamic_tp.logits).abs().max())
    entries = run_cases(ref_model, tp_model, ids, rank, world)
    t_cases = time.perf_counter()
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object((entries, dynamic), gathered, dst=0)
    summary: dict[str, Any] = {}
    if rank == 0:
        per_rank = [g[0] for g in gathered]
        matrices = [e["hadamard_matrix"] for entries_ in per_rank for e in entries_ if "hadamard_matrix" in e]
        summary = {
            "world": world,
            "prefill": PREFILL,
            "decode": DECODE,
            "group_size": GROUP,
            "tie_gap": TIE_GAP,
            "dynamic_cache_logits_max_diff": [g[1] for g in gathered],
            "cases": [[{k: v for k, v in e.items() if k not in _PRIVATE} for e in entries_] for entries_ in per_rank],
            "replay_logits_max_diff": replay(ref_model, ids, per_rank),
            "hadamard_identical_across_ranks": bool(matrices) and all(torch.equal(m, matrices[0]) for m in matrices),
        }
    saved_all: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(saved_caches(tp_model, ref_model, ids, rank, args.work), saved_all, dst=0)
    if rank == 0:
        summary["saved_caches"] = saved_all
    t_replay = time.perf_counter()
    bad_all: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(bad_heads(bad), bad_all, dst=0)
    if rank == 0:
        summary["bad_heads"] = bad_all
        summary["seconds"] = {
            "save_and_load": t_load - t0, "cases": t_cases - t_load, "replay": t_replay - t_cases,
            "bad_heads": time.perf_counter() - t_replay, "total": time.perf_counter() - t0,
        }  # fmt: skip
        args.out.write_text(json.dumps(summary, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
