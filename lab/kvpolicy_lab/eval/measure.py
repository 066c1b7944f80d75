"""One cache on one task's samples: the measurements of a grid cell.

The uncompressed reference (transformers' ``DynamicCache``) of each sample is computed once
(:func:`reference`) and reused by every cache. Metrics (evaluation.md §2):

- ``delta_nll``: teacher-forced NLL minus the reference's, per token (mean and its standard error
  over tokens; the tokens of one text are correlated, so the error is a lower bound);
- ``kl`` and ``top1``: ``KL(p_reference || p_cache)`` of each next-token distribution and the
  agreement of their argmax;
- ``kl_worst``: the largest of the texts' mean KLs; ``kl_p99`` and ``kl_p999``: the 99th and 99.9th
  percentiles of the per-token KL over every scored token of every text
  (:func:`kvpolicy_lab.quality.token_percentile`), each text's own in ``extra["per_text"]``;
- ``attn_error``: attention-output relative error per layer (:mod:`kvpolicy_lab.eval.probes`), over the
  teacher-forced decoding steps; the value is the mean over layers;
- task scores (accuracy, exact match, edit similarity, LongBench score);
- ``bytes_held`` and ``ratio`` (16-bit bytes of the same tokens / bytes held) after the last token;
- ``prefill_ms`` and ``decode_ms`` (median per token) from the ``speed`` task.

Prefill replay: every cache of this project lets prefill attention see the uncompressed prompt, so
the prefill's logits and keys/values are those of the reference. With ``replay=True`` a cache
receives the reference's prefill keys and values through its public ``update`` (as the model would
pass them) instead of re-running the prefill forward, which saves most of the CPU time of a cell.
Caches whose policy needs attention scores (H2O) always run the prefill. Timings never use replay.

Batches: ``teacher_forced(..., batch=n)`` (a grid's ``batch``) decodes up to ``n`` samples of equal
length together, each row of the batch with the reference of its own sample. A cache that treats
the rows of a batch independently gives each sample what it gets alone, up to float rounding. The
bytes held are those of the last sample's row, selected alone from its batch after its last token,
which are then those of one sequence (a batch holds what its rows share, such as a rotation matrix or
position indices, once).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from kvpolicy_lab.eval.caches import baseline_bytes, budget_bits, global_layers, held_bytes
from kvpolicy_lab.eval.metrics import last_only, next_token_kl, nll
from kvpolicy_lab.eval.probes import AttentionErrorProbe
from kvpolicy_lab.eval.stats import mean_se
from kvpolicy_lab.eval.tasks import Sample, Task
from kvpolicy_lab.quality import TAIL, token_percentile


@dataclass
class Reference:
    """The uncompressed run of one sample.

    Attributes
    ----------
    prefill_kv : list of (torch.Tensor, torch.Tensor) or None
        Per layer, keys and values after the prefill, ``(1, kv_heads, prefill, head_dim)``; None when
        some layer did not hold every prompt token (sliding-window layers): replay is then off.
    last_logits : torch.Tensor
        ``(1, vocab)`` prediction after the prefill.
    logits, nll : torch.Tensor
        Teacher-forced samples only: ``(n, vocab)`` predictions and ``(n,)`` NLL of the continuation.
    tokens : list of int
        Samples scored against the reference only (``Sample.against_reference``): its own greedy
        continuation.
    """

    prefill_kv: list[tuple[torch.Tensor, torch.Tensor]] | None
    last_logits: torch.Tensor
    logits: torch.Tensor | None = None
    nll: torch.Tensor | None = None
    tokens: list[int] | None = None


@dataclass
class Metric:
    """One measured quantity of a cell."""

    name: str
    value: float
    se: float | None = None
    n: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


def _forward(model: torch.nn.Module, ids: torch.Tensor, cache: Any) -> torch.Tensor:
    """Logits of the last position only (every caller reads ``[:, -1]``): ``(batch, 1, vocab)``."""
    return model(ids, cache=cache, use_cache=True, **last_only(model)).logits


@torch.inference_mode()
def reference(model: torch.nn.Module, sample: Sample) -> Reference:
    """Run ``sample`` with a ``DynamicCache`` (see :class:`Reference`)."""
    ref, cache = _reference_prefill(model, sample)
    if sample.kind == "teacher_forced":
        _reference_decode(model, [sample], [ref], cache)
    elif sample.against_reference:
        ref.tokens = _greedy(model, ref.last_logits, cache, sample.max_new_tokens, None)
    return ref


@torch.inference_mode()
def references(model: torch.nn.Module, samples: list[Sample], batch: int = 1) -> list[Reference]:
    """:func:`reference` of each of ``samples``, with the teacher-forced decode steps of up to ``batch``
    samples of equal length run together (:func:`batches`).

    Each sample's prefill still runs alone, so its prefill keys and values and its last logits are
    those of :func:`reference` exactly; the later logits equal its up to float rounding. Samples whose
    prefill keys and values cannot be joined into one batch (sliding-window layers keep only a window)
    decode alone.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1; got batch={batch!r}")
    from transformers import DynamicCache

    out: list[Reference | None] = [None] * len(samples)
    for group in batches(samples, batch):
        if len(group) == 1 or samples[group[0]].kind != "teacher_forced":
            for i in group:
                out[i] = reference(model, samples[i])
            continue
        rows = [_reference_prefill(model, samples[i]) for i in group]
        refs = [ref for ref, _ in rows]
        if any(ref.prefill_kv is None for ref in refs):
            for i, (ref, cache) in zip(group, rows, strict=True):
                _reference_decode(model, [samples[i]], [ref], cache)
                out[i] = ref
            continue
        del rows  # their caches hold nothing beyond each reference's prefill keys and values
        cache = DynamicCache(config=model.config)
        prompts = torch.tensor([samples[i].ids[: samples[i].prefill] for i in group], device=model.device)
        _prefill_rows(model, prompts, cache, refs, None)  # replays the joined prefills, runs no forward
        _reference_decode(model, [samples[i] for i in group], refs, cache)
        for i, ref in zip(group, refs, strict=True):
            out[i] = ref
    return out  # type: ignore[return-value]


def _reference_prefill(model: torch.nn.Module, sample: Sample) -> tuple[Reference, Any]:
    """The prefill of ``sample`` alone into a new ``DynamicCache``: its :class:`Reference` so far (prefill
    keys and values, last logits) and the cache."""
    from transformers import DynamicCache

    ids = torch.tensor([sample.ids[: sample.prefill]], device=model.device)
    cache = DynamicCache(config=model.config)
    logits = _forward(model, ids, cache)[:, -1].float()
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    if any(k is None or k.dim() != 4 or k.shape[-2] != sample.prefill for k, _ in kv):
        kv = None
    return Reference(kv, logits), cache


def _reference_decode(model: torch.nn.Module, samples: list[Sample], refs: list[Reference], cache: Any) -> None:
    """Teacher-force ``samples`` (equal length and prefill; row ``r`` of ``cache`` holds the prefill of
    ``samples[r]``) and set each reference's logits ``(n, vocab)`` and per-token NLL."""
    ids = torch.tensor([s.ids for s in samples], device=model.device)
    steps = [torch.cat([r.last_logits for r in refs])]
    for t in range(samples[0].prefill, ids.shape[1] - 1):
        steps.append(_forward(model, ids[:, t : t + 1], cache)[:, -1].float())
    logits = torch.stack(steps, dim=1)  # (rows, n, vocab)
    for row, ref in enumerate(refs):
        ref.logits = logits[row]
        ref.nll = nll(ref.logits, ids[row, samples[0].prefill :])


def _prefill(
    model: torch.nn.Module, ids: torch.Tensor, cache: Any, ref: Reference | None, probe: AttentionErrorProbe | None
) -> torch.Tensor:
    """Prefill ``ids`` (``(1, n)``) into ``cache`` (replayed from ``ref`` when given); ``(1, vocab)`` logits."""
    return _prefill_rows(model, ids, cache, None if ref is None else [ref], probe)


def _prefill_rows(
    model: torch.nn.Module, ids: torch.Tensor, cache: Any, refs: list[Reference] | None,
    probe: AttentionErrorProbe | None,
) -> torch.Tensor:  # fmt: skip
    """Prefill ``ids`` (``(batch, n)``) into ``cache``, replayed from ``refs`` (one per row) when each
    has its prefill keys and values; ``(batch, vocab)`` logits."""
    if refs is None or any(r.prefill_kv is None for r in refs):
        return _forward(model, ids, cache)[:, -1].float()
    for i in range(len(refs[0].prefill_kv)):  # type: ignore[arg-type]
        k = torch.cat([r.prefill_kv[i][0] for r in refs])  # type: ignore[index]
        v = torch.cat([r.prefill_kv[i][1] for r in refs])  # type: ignore[index]
        cache.update(k, v, i)
        if probe is not None:
            probe.shadow.update(k, v, i)
    return torch.cat([r.last_logits for r in refs])


#: the metrics of the bytes a cache holds (:func:`_finish_bytes`); the last only for hybrid models
BYTES_METRICS = ("bytes_held", "ratio", "bits_per_element", "bits_per_element_16", "bits_per_element_16_global")


def _finish_bytes(cache: Any, model: torch.nn.Module, tokens: int) -> list[Metric]:
    """Bytes held, the ratio to a 16-bit cache, and bits per element (as held, and with
    full-precision tensors counted at 16 bits: the figure to compare across model dtypes). A hybrid
    model (sliding-window and full-attention layers) also gets ``bits_per_element_16_global``: the same
    over its full-attention layers only, the layers a cache compresses, comparable across models."""
    held = held_bytes(cache)
    base = baseline_bytes(model.config, tokens)
    out = [
        Metric("bytes_held", float(held), extra={"tokens": tokens}),
        Metric("ratio", base / held if held else math.inf, extra={"baseline_16bit": base}),
        Metric("bits_per_element", 16 * held / base),
        Metric("bits_per_element_16", 16 * held_bytes(cache, at_16bit=True) / base),
    ]
    layers = global_layers(model.config)
    if layers:
        out.append(Metric("bits_per_element_16_global", budget_bits(cache, model.config, tokens),
                          extra={"layers": layers}))  # fmt: skip
    return out


def _mean_se(x: torch.Tensor) -> tuple[float, float]:
    """The mean of ``x``'s elements and its standard error (:func:`~kvpolicy_lab.eval.stats.mean_se`: ``ddof=1``,
    NaN for one element)."""
    return mean_se(x.detach().double().flatten().cpu().numpy())


def batches(samples: list[Sample], batch: int) -> list[list[int]]:
    """Indices of ``samples`` grouped for :func:`teacher_forced` and :func:`references`: runs of
    consecutive samples of the same kind, length and prefill, at most ``batch`` each."""
    shape = lambda s: (s.kind, len(s.ids), s.prefill)  # noqa: E731
    groups: list[list[int]] = []
    for i, s in enumerate(samples):
        if groups and len(groups[-1]) < batch and shape(s) == shape(samples[groups[-1][0]]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@torch.inference_mode()
def teacher_forced(
    model: torch.nn.Module,
    samples: list[Sample],
    refs: list[Reference],
    make_cache: Any,
    replay: bool = True,
    progress: bool = False,
    attention_error: bool = True,
    batch: int = 1,
) -> list[Metric]:
    """ΔNLL, KL, top-1, attention error and bytes held of a cache over teacher-forced samples.

    ``make_cache()`` returns a fresh cache for each sample, or each batch of samples. ``attention_error=False``
    skips the attention-error probe (its shadow cache repeats every attention call uncompressed: about a
    third of a decode step at 8k tokens) and its ``attn_error`` metric; nothing else changes.

    ``batch``: decode up to this many samples of equal length together (:func:`batches`). The bytes held
    are those of the last sample's row, selected alone from its batch (``batch_select_indices``) after
    its last token: what the rows of a batch share (a rotation matrix, position indices) is held once,
    as in a cache that ran one sequence. Only for caches that treat the sequences of a batch
    independently (kvpolicy's and ``DynamicCache``; not hqq's ``QuantizedCache``, whose groups span the
    batch): each sample then gets the metrics it gets alone, up to float rounding, in less time on CPU,
    where a decode step of 5 sequences costs about what 1.6 single ones do.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1; got batch={batch!r}")
    device = model.device
    # per sample, in the samples' order
    deltas: list[Any] = [None] * len(samples)
    kls, agree, nlls = list(deltas), list(deltas), list(deltas)
    layer_err: list[list[float]] = []
    cache = None
    group: list[int] = []
    for group in batches(samples, batch):
        ids = torch.tensor([samples[i].ids for i in group], device=device)
        prefill = samples[group[0]].prefill
        cache = make_cache()
        probe = AttentionErrorProbe(model) if attention_error else None
        with probe if probe is not None else contextlib.nullcontext():
            if probe is not None:
                probe.active = False
            given = [refs[i] for i in group] if replay else None
            steps = [_prefill_rows(model, ids[:, :prefill], cache, given, probe)]
            if probe is not None:
                probe.active = True
            todo = range(prefill, ids.shape[1] - 1)
            for t in tqdm(todo, desc="  tokens", leave=False, disable=not progress):
                steps.append(_forward(model, ids[:, t : t + 1], cache)[:, -1].float())
        logits = torch.stack(steps, dim=1)  # (rows, n, vocab)
        for row, i in enumerate(group):
            ref = refs[i]
            loss = nll(logits[row], ids[row, prefill:])
            nlls[i] = loss
            deltas[i] = loss - ref.nll
            kls[i] = next_token_kl(ref.logits, logits[row])
            agree[i] = (ref.logits.argmax(-1) == logits[row].argmax(-1)).double()
        if probe is not None:
            layer_err += probe.per_layer_rows(len(group))
    d, kl, top1 = torch.cat(deltas), torch.cat(kls), torch.cat(agree)
    out = [
        Metric("delta_nll", *_mean_se(d), n=d.numel()),
        Metric("nll", *_mean_se(torch.cat(nlls)), n=d.numel()),
        Metric("kl", *_mean_se(kl), n=kl.numel()),
        Metric("top1", *_mean_se(top1), n=top1.numel()),
        _worst_text(samples, kls),
        *_tail(samples, kls),
    ]
    if layer_err:
        per_layer = [statistics.fmean(v) for v in zip(*layer_err, strict=True)]
        out.append(Metric("attn_error", statistics.fmean(per_layer), n=len(per_layer), extra={"per_layer": per_layer}))
    if cache is not None and len(group) > 1:
        cache.batch_select_indices(torch.tensor([len(group) - 1], device=device))  # the last sample's row
    # the last token is a target only: the cache has seen every token but that one
    return out + _finish_bytes(cache, model, len(samples[-1].ids) - 1)


def _worst_text(samples: list[Sample], kls: list[torch.Tensor]) -> Metric:
    """``kl_worst``: the largest of the samples' mean next-token KLs (a mean over texts hides a tail).

    ``kls[i]`` is sample ``i``'s per-token KL, ``(tokens,)``; ``extra["per_text"]`` maps each sample's id
    to its mean, in the samples' order.
    """
    means = {s.sample_id: float(k.mean()) for s, k in zip(samples, kls, strict=True)}
    return Metric("kl_worst", max(means.values()), n=len(means), extra={"per_text": means})


def _tail(samples: list[Sample], kls: list[torch.Tensor]) -> list[Metric]:
    """``kl_p99`` and ``kl_p999``: percentiles of the per-token KL pooled over every sample's scored tokens
    (``n`` of them; :func:`kvpolicy_lab.quality.token_percentile`). ``extra["per_text"]`` maps each sample's id
    to its own percentile, and ``extra["max"]`` is the largest token KL (with 1,001 tokens or fewer the
    99.9th percentile lies between the two largest)."""
    pooled = torch.cat([k.flatten() for k in kls])
    out = []
    for name, q in TAIL.items():
        per_text = {s.sample_id: token_percentile(k, q) for s, k in zip(samples, kls, strict=True)}
        out.append(Metric(name, token_percentile(pooled, q), n=pooled.numel(),
                          extra={"per_text": per_text, "max": float(pooled.max())}))  # fmt: skip
    return out


@dataclass(frozen=True)
class Generated:
    """A greedy continuation: ``tokens`` and the text they decode to."""

    tokens: list[int]
    text: str


@torch.inference_mode()
def generate(
    model: torch.nn.Module, tokenizer: Any, sample: Sample, cache: Any, ref: Reference | None = None
) -> Generated:
    """Greedy decoding of ``sample`` through ``cache`` (prefill replayed from ``ref`` when given)."""
    ids = torch.tensor([sample.ids], device=model.device)
    logits = _prefill(model, ids, cache, ref, None)
    eos = tokenizer.eos_token_id
    # compared with the reference token by token: both run the full length, end of sequence or not
    eos_ids = None if sample.against_reference else set(eos) if isinstance(eos, (list, tuple)) else {eos}
    stop = None
    if sample.stop_at_newline:
        stop = lambda tokens: "\n" in tokenizer.decode(tokens, skip_special_tokens=True).lstrip("\n")  # noqa: E731
    tokens = _greedy(model, logits, cache, sample.max_new_tokens, eos_ids, stop)
    return Generated(tokens, tokenizer.decode(tokens, skip_special_tokens=True))


def _greedy(
    model: torch.nn.Module, logits: torch.Tensor, cache: Any, max_new_tokens: int, eos_ids: set[int] | None,
    stop: Any = None,
) -> list[int]:  # fmt: skip
    """Up to ``max_new_tokens`` greedy tokens after ``logits`` (``(1, vocab)``), through ``cache``;
    ends before a token of ``eos_ids`` or after the token where ``stop(tokens)`` holds."""
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(logits.argmax(-1))
        if eos_ids is not None and nxt in eos_ids:
            break
        tokens.append(nxt)
        if (stop is not None and stop(tokens)) or len(tokens) == max_new_tokens:
            break
        logits = _forward(model, torch.tensor([[nxt]], device=model.device), cache)[:, -1].float()
    return tokens


def task_scores(
    model: torch.nn.Module,
    tokenizer: Any,
    task: Task,
    samples: list[Sample],
    refs: list[Reference | None],
    make_cache: Any,
    progress: bool = False,
    replay: bool = True,
) -> tuple[list[Metric], list[dict[str, Any]]]:
    """Scores of a generation task, and one record per sample (answer, generation, scores).

    ``refs`` replay the prefill where given (``replay``); samples scored against the reference
    (``Sample.against_reference``) need their reference whatever ``replay`` says, and replay it only
    when ``replay`` is true."""
    scores: dict[str, list[float]] = {}
    records = []
    cache = None
    length = 0
    for sample, ref in tqdm(list(zip(samples, refs, strict=True)), desc="  samples", leave=False, disable=not progress):
        cache = make_cache()
        if sample.against_reference:
            if ref is None or ref.tokens is None:
                raise ValueError(f"task {task.name!r} needs the reference's greedy tokens of sample {sample.sample_id}")
            gen = generate(model, tokenizer, sample, cache, ref if replay else None)
            got = task.score_against(sample, gen.tokens, ref.tokens, tokenizer)
        else:
            gen = generate(model, tokenizer, sample, cache, ref)
            got = task.score(sample, gen.text)
        length = len(sample.ids) + len(gen.tokens)
        for k, v in got.items():
            scores.setdefault(k, []).append(v)
        records.append({"sample": sample.sample_id, "meta": sample.meta, "answer": _jsonable(sample.answer),
                        "generated": gen.text, "scores": got})  # fmt: skip
    out = []
    for k, values in scores.items():
        t = torch.tensor(values, dtype=torch.float64)
        by: dict[str, list[float]] = {}
        for rec in records:
            if "depth" in rec["meta"]:
                by.setdefault(str(rec["meta"]["depth"]), []).append(rec["scores"][k])
        extra = {"by_depth": {d: statistics.fmean(v) for d, v in by.items()}} if by else {}
        out.append(Metric(k, *_mean_se(t), n=len(values), extra=extra))
    return out + _finish_bytes(cache, model, length), records


def quality(
    model: torch.nn.Module,
    tokenizer: Any,
    task: Task,
    samples: list[Sample],
    refs: list[Reference | None] | None,
    make_cache: Any,
    replay: bool = True,
    progress: bool = False,
    attention_error: bool = True,
    batch: int = 1,
) -> tuple[list[Metric], list[dict[str, Any]]]:
    """The metrics of a cache on a task's samples, and one record per generated sample.

    Teacher-forced samples give :func:`teacher_forced`'s metrics, generated ones :func:`task_scores`'s;
    a task with both kinds (``hotpotqa``) gets both, the bytes held measured after its last generation.

    Parameters
    ----------
    refs : list of Reference or None
        The samples' uncompressed references (:func:`reference`); required when some sample is
        teacher-forced or scored against the reference.
    replay : bool
        Replay the references' prefill instead of running it (see the module docstring), where given.
    attention_error : bool
        Measure ``attn_error`` on the teacher-forced samples (see :func:`teacher_forced`).
    batch : int
        Teacher-forced samples decoded together (see :func:`teacher_forced`); generated ones run alone.
    """
    forced = [i for i, s in enumerate(samples) if s.kind == "teacher_forced"]
    generated = [i for i, s in enumerate(samples) if s.kind != "teacher_forced"]
    if refs is None and (forced or any(s.against_reference for s in samples)):
        raise ValueError(f"task {task.name!r}: its samples are scored against their uncompressed references")
    metrics: list[Metric] = []
    records: list[dict[str, Any]] = []
    if generated:
        given = [refs[i] if refs is not None and (replay or samples[i].against_reference) else None for i in generated]
        metrics, records = task_scores(model, tokenizer, task, [samples[i] for i in generated], given, make_cache,
                                       progress=progress, replay=replay)  # fmt: skip
    if forced:
        got = teacher_forced(model, [samples[i] for i in forced], [refs[i] for i in forced], make_cache,  # type: ignore
                             replay=replay, progress=progress, attention_error=attention_error,
                             batch=batch)  # fmt: skip
        metrics += [m for m in got if not (generated and m.name in BYTES_METRICS)]
    return metrics, records


def _jsonable(x: Any) -> Any:
    return x if isinstance(x, (str, int, float, bool, type(None), list, dict)) else repr(x)


@torch.inference_mode()
def speed(model: torch.nn.Module, ids: list[int], make_cache: Any, steps: int = 8, repeats: int = 1) -> list[Metric]:
    """Prefill ms (real forward, best of ``repeats``) and median decode ms per token over ``steps``
    greedy steps, through a fresh cache."""
    device = model.device
    x = torch.tensor([ids], device=device)
    prefill_ms: list[float] = []
    decode_ms: list[float] = []
    cache = None
    for _ in range(repeats):
        cache = make_cache()
        t0 = time.perf_counter()
        logits = _forward(model, x, cache)[:, -1]
        prefill_ms.append((time.perf_counter() - t0) * 1e3)
        for _ in range(steps):
            nxt = logits.argmax(-1, keepdim=True)
            t0 = time.perf_counter()
            logits = _forward(model, nxt, cache)[:, -1]
            decode_ms.append((time.perf_counter() - t0) * 1e3)
    return [
        Metric("prefill_ms", min(prefill_ms), n=repeats, extra={"tokens": len(ids)}),
        Metric("decode_ms", statistics.median(decode_ms), n=len(decode_ms)),
        *_finish_bytes(cache, model, len(ids) + steps),
    ]
