"""``--equal-bytes``: size every method so that all hold the same bytes.

Method. The bytes a cache holds after ``T`` tokens depend on the token counts its policy keeps and
demotes, on the action and backend, and on the shapes of the keys and values; not on the text (H2O
keeps ``heavy + recent`` tokens whatever it selects). So the bytes are *measured*, with the real
cache code, on a one-layer twin of the model: the same config (hidden size, heads, head_dim, dtype)
with a single full-attention layer, a tiny MLP and vocabulary, and random weights, run for a prefill
of ``context`` tokens and ``steps`` decoding steps. Every full-attention layer of the real model holds
the same bytes, so equal twin bytes mean equal model bytes (layers left to transformers, such as
sliding-window layers, hold the same bytes for every method).

For each method one integer knob ``x`` is searched (``size_params``: ``window`` for log, recent and
sink; ``heavy`` + ``recent`` split evenly for h2o; ``budget`` for the presets that have it;
``residual_length`` for transformers' ``QuantizedCache``): the largest ``x`` whose bytes do not exceed
the anchor's, by bisection and then a scan of the neighbours (bytes are not exactly monotone in
``x`` for the log policy). A method that holds fewer bytes than the anchor even at ``x = T`` keeps
``x = T`` and the shortfall is reported.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from kvpolicy.errors import ConfigError, did_you_mean
from kvpolicy_lab.eval.caches import CacheSpec, held_bytes

#: knob of each built-in policy / preset / baseline (plugins: give CacheSpec.size_params)
POLICY_SIZE_PARAMS = {"log": ("window",), "recent": ("window",), "sink": ("window",), "h2o": ("heavy", "recent")}
PRESET_SIZE_PARAMS = {"logquant": ("budget",), "logquant-4bit": ("budget",), "h2o": ("budget",),
                      "streamingllm": ("budget",), "kivi": ("residual",)}  # fmt: skip
HF_SIZE_PARAMS = ("residual_length",)


def size_params(spec: CacheSpec) -> tuple[str, ...]:
    """The integer parameters ``--equal-bytes`` sets for ``spec``."""
    if spec.size_params:
        return spec.size_params
    if spec.kind == "hf-quantized":
        return HF_SIZE_PARAMS
    if spec.kind == "preset":
        found = PRESET_SIZE_PARAMS.get(spec.args.get("name", ""))
    elif spec.kind == "compressed":
        policy = spec.args.get("policy", "log")
        found = POLICY_SIZE_PARAMS.get(policy if isinstance(policy, str) else getattr(policy, "name", ""))
    else:
        found = None
    if not found:
        raise ConfigError(
            f"--equal-bytes does not know which parameter sizes cache {spec.label!r}; give its integer size "
            "parameter(s) as size_params in the cache's config entry"
        )
    return found


def with_size(spec: CacheSpec, x: int) -> CacheSpec:
    """``spec`` with its size parameters set to ``x`` (split evenly when there are several)."""
    names = size_params(spec)
    values = {n: x // len(names) + (1 if i < x % len(names) else 0) for i, n in enumerate(names)}
    policy = spec.args.get("policy")
    if spec.kind == "compressed" and not isinstance(policy, str) and dataclasses.is_dataclass(policy):
        new = copy.deepcopy(spec)
        new.args["policy"] = dataclasses.replace(policy, **values)
        new.label = f"{spec.label}@{x}"
        return new
    label = spec.label.split("@")[0] + f"@{x}"
    return spec.with_args(label=label, **values)


def twin(model: torch.nn.Module) -> torch.nn.Module:
    """A one-layer random copy of ``model``'s architecture (same attention shapes and dtype)."""
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(model.config.get_text_config(decoder=True))
    cfg.num_hidden_layers = 1
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = ["full_attention"]
    cfg.vocab_size = 64
    if hasattr(cfg, "intermediate_size"):
        cfg.intermediate_size = 8
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if getattr(cfg, name, None) is not None:
            setattr(cfg, name, 0)
    torch.manual_seed(0)
    small = AutoModelForCausalLM.from_config(cfg, dtype=model.dtype, attn_implementation="sdpa")
    return small.to(model.device).eval()


@torch.inference_mode()
def measure_bytes(small: torch.nn.Module, spec: CacheSpec, context: int, steps: int) -> int:
    """Bytes ``spec`` holds in the twin's layer after ``context`` prefill tokens and ``steps`` decoding steps."""
    from kvpolicy.modes import decode_mode

    with decode_mode(small, "scores") if spec.needs_scores() or spec.needs_queries() else nullcontext():
        cache = spec.build(small)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1, 64, (1, context + steps), generator=g).to(small.device)
        small(ids[:, :context], cache=cache, use_cache=True)
        for t in range(context, context + steps):
            small(ids[:, t : t + 1], cache=cache, use_cache=True)
        return held_bytes(cache)


@dataclass(frozen=True)
class Sizing:
    """The outcome for one method: the chosen knob, its bytes and the anchor's bytes (per layer)."""

    label: str
    value: int
    bytes: int
    target: int


def equalize(
    model: torch.nn.Module,
    anchor: CacheSpec,
    specs: list[CacheSpec],
    context: int,
    steps: int,
    memo: dict[str, list[int]] | None = None,
) -> tuple[list[CacheSpec], list[Sizing]]:
    """Resize each of ``specs`` (not ``anchor``, not uncompressed ones) to hold at most the anchor's bytes.

    ``memo`` (updated in place) maps ``"context|steps|anchor|spec"`` (caches by their canonical dicts) to
    ``[value, bytes, target]`` of earlier searches, which are then reused (the search is deterministic).
    """
    memo = {} if memo is None else memo
    small = None
    total = context + steps
    out, report = [], []
    for spec in specs:
        if not resizable(spec, anchor):
            out.append(spec)
            continue
        size_params(spec)  # raise early for unknown knobs
        key = f"{context}|{steps}|{_named(anchor)}|{_named(spec)}"
        if key in memo:
            value, nbytes, target = memo[key]
            chosen = with_size(spec, value)
            out.append(chosen)
            report.append(Sizing(chosen.label, value, nbytes, target))
            continue
        if small is None:
            small = twin(model)
            target = measure_bytes(small, anchor, context, steps)
        cache: dict[int, int] = {}

        def bytes_at(x: int, spec: CacheSpec = spec, cache: dict[int, int] = cache, small=small) -> int:
            if x not in cache:
                cache[x] = measure_bytes(small, with_size(spec, x), context, steps)
            return cache[x]

        lo_min = max(1, len(size_params(spec)))
        lo, hi = lo_min, max(lo_min, total)
        if bytes_at(hi) <= target:
            best = hi
        elif bytes_at(lo) > target:
            best = lo
        else:
            while hi - lo > 1:  # invariant: bytes(lo) <= target < bytes(hi)
                mid = (lo + hi) // 2
                if bytes_at(mid) <= target:
                    lo = mid
                else:
                    hi = mid
            best = lo
            for x in range(lo + 1, min(total, lo + 8) + 1):
                if bytes_at(x) <= target:
                    best = x
        chosen = with_size(spec, best)
        chosen.validate()
        out.append(chosen)
        report.append(Sizing(chosen.label, best, bytes_at(best), target))
        memo[key] = [best, bytes_at(best), target]
    return out, report


def _named(spec: CacheSpec) -> str:
    return json.dumps(spec.canonical(), sort_keys=True)


def resizable(spec: CacheSpec, anchor: CacheSpec) -> bool:
    """Whether ``--equal-bytes`` makes a resized copy of ``spec``."""
    return spec is not anchor and spec.compresses and spec.resize


def describe_method() -> str:
    """The method, for summaries."""
    return __doc__.split("Method.", 1)[1].strip()


def anchor_of(specs: list[CacheSpec], name: str | None) -> CacheSpec:
    """The spec labelled ``name`` (default: the first compressing spec)."""
    if name in (None, "", "auto"):
        for s in specs:
            if s.compresses:
                return s
        raise ConfigError("--equal-bytes needs at least one compressing cache in the grid")
    for s in specs:
        if s.label == name:
            return s
    labels = [s.label for s in specs]
    raise ConfigError(
        f"--equal-bytes anchor {name!r} is not a cache label of the grid{did_you_mean(name, labels)} (labels: {labels})"
    )
